"""Instruction records (`pipelines.prepare --format instructions`, `pipelines.instruction_data`).

The oracle: the tokenizer's own ids of each prompt and completion, and the
rule that only the completion's tokens and the EOS after it are learned.
"""

import json
import re

import numpy as np
import pytest

from pipelines import prepare
from pipelines.instruction_data import make_instruction_dataset
from pipelines.reader import load_manifest
from pipelines.tokenizer import Tokenizer

WORDS = "the cat sat on a mat and ran to the big red door then it came back".split()


def _examples(count=40):
    rng = np.random.default_rng(0)
    pick = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    examples = []
    for index in range(count):
        if index % 5 == 4:
            examples.append({"text": pick(3)})
        else:
            examples.append({"prompt": pick(int(rng.integers(1, 4))),
                             "completion": pick(int(rng.integers(1, 4)))})
    return examples


def _prepare(tmp_path, tiny_data, examples, *flags):
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "examples.jsonl"
    source.write_text("".join(json.dumps(example) + "\n" for example in examples))
    out = tmp_path / "instructions"
    code = prepare.main(["--input", str(source), "--output", str(out), "--seq-len", "16",
                         "--format", "instructions", "--tokenizer", str(tiny_data),
                         "--val-fraction", "0.2", "--shard-size", "2K", *flags])
    return code, out


def _rows(out, split):
    dataset = make_instruction_dataset(str(out), split, 1, shuffle=False, repeat=False)
    return [tuple(part.numpy()[0] for part in batch) for batch in dataset]


def test_only_the_completion_and_its_eos_are_learned(tmp_path, tiny_data):
    examples = _examples()
    code, out = _prepare(tmp_path, tiny_data, examples)
    assert code == 0
    tokenizer = Tokenizer.load(str(tiny_data / "tokenizer.model"))
    expected, too_long = {}, 0
    for example in examples:
        prompt = tokenizer.encode(example.get("prompt", ""))
        completion = tokenizer.encode(example.get("completion", example.get("text")))
        ids = [*prompt, *completion, tokenizer.eos_id]
        learned = [0] * len(prompt) + [1] * (len(completion) + 1)
        if len(ids) > 17:  # --seq-len 16 + 1
            too_long += 1
            continue
        expected[tuple(ids)] = learned
    seen, learned_total = set(), 0
    for split in ("train", "val"):
        for inputs, targets, weights in _rows(out, split):
            assert inputs.shape == targets.shape == weights.shape == (16,)
            length = int(np.nonzero(weights)[0].max()) + 2  # the EOS is the last learned
            ids = tuple(np.r_[inputs[:1], targets][:length].tolist())
            assert ids in expected, ids
            np.testing.assert_array_equal(weights[:length - 1], expected[ids][1:])
            assert not weights[length - 1:].any()  # padding: never learned
            np.testing.assert_array_equal(targets[:length - 1], ids[1:])
            seen.add(ids)
            learned_total += int(weights.sum())
    assert seen == set(expected)
    manifest = load_manifest(str(out))
    assert manifest["format"] == "tfgpt-instruction-examples"
    assert manifest["too_long"] == "drop"
    assert 0 < len(expected) and sum(manifest["splits"][split]["dropped_examples"]
                                     for split in ("train", "val")) == too_long
    assert sum(manifest["splits"][split]["learned_tokens"] for split in ("train", "val")) == (
        learned_total)


def test_too_long_examples_are_dropped_or_truncated_and_counted(tmp_path, tiny_data):
    long = {"prompt": "the cat", "completion": " ".join(WORDS * 2)}
    examples = _examples(20) + [long] * 3
    for mode in ("drop", "truncate"):
        code, out = _prepare(tmp_path / mode, tiny_data, examples, "--too-long", mode)
        assert code == 0
        manifest = load_manifest(str(out))
        counts = {key: sum(manifest["splits"][split][key] for split in ("train", "val"))
                  for key in ("dropped_examples", "truncated_examples", "sequences")}
        assert counts["dropped_examples" if mode == "drop" else "truncated_examples"] == 3
        assert counts["truncated_examples" if mode == "drop" else "dropped_examples"] == 0
        assert counts["sequences"] == 20 + (3 if mode == "truncate" else 0)
        if mode == "truncate":  # a full record: every target after the prompt learned
            full = [row for split in ("train", "val") for row in _rows(out, split)
                    if row[2].sum() == 16 - len(Tokenizer.load(
                        str(tiny_data / "tokenizer.model")).encode("the cat")) + 1]
            assert len(full) == 3


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "user", "content": "hi"}]},
     r"examples.jsonl:2: no assistant turn: nothing to learn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     r"examples.jsonl:2: message 2 has the role 'bot'; expected one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": 3}]},
     r"""examples.jsonl:2: message 1's "content" must be a string, got int"""),
    ({"prompt": "a"}, r'examples.jsonl:2: "completion" must be a string, got nothing'),
    ({"prompt": "a", "completion": "  "}, r'examples.jsonl:2: the "completion" is empty'),
    ({"question": "a"},
     r'examples.jsonl:2: expected "prompt" and "completion", "messages" or "text", got the keys '
     r"\['question'\]"),
])
def test_a_bad_example_is_one_line_naming_file_and_line(tmp_path, tiny_data, capsys, line,
                                                        message):
    code, _ = _prepare(tmp_path, tiny_data, [{"text": "the cat"}, line])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and re.search(message, error), error


def test_instructions_need_the_models_tokenizer_and_json_lines(tmp_path, tiny_data, capsys):
    source = tmp_path / "examples.jsonl"
    source.write_text(json.dumps({"text": "the cat"}) + "\n")
    assert prepare.main(["--input", str(source), "--output", str(tmp_path / "a"), "--seq-len",
                         "16", "--format", "instructions", "--vocab-size", "300"]) == 2
    assert "--format instructions needs --tokenizer" in capsys.readouterr().err
    text = tmp_path / "plain.txt"
    text.write_text("the cat sat\n")
    assert prepare.main(["--input", str(text), "--output", str(tmp_path / "b"), "--seq-len", "16",
                         "--format", "instructions", "--tokenizer", str(tiny_data)]) == 2
    assert "instruction examples come from JSON Lines files" in capsys.readouterr().err


# ---- Conversations ({"messages"}) and the chat template ----------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"}],
    [{"role": "system", "content": "red"}, {"role": "user", "content": "the"},
     {"role": "assistant", "content": "cat"}, {"role": "user", "content": "and"},
     {"role": "assistant", "content": "ran to the door"}],
]


def _chatml_pieces(messages):
    """ChatML by hand: each turn `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`, an
    assistant turn learned from its content through its end marker."""
    pieces = []
    for message in messages:
        opening = f"<|im_start|>{message['role']}\n"
        if message["role"] == "assistant":
            pieces += [(opening, False), (message["content"] + "<|im_end|>\n", True)]
        else:
            pieces.append((opening + message["content"] + "<|im_end|>\n", False))
    return pieces


def _records(out):
    """`{token ids: learned flags}` of every record written (both splits)."""
    rows = {}
    for split in ("train", "val"):
        for inputs, targets, weights in _rows(out, split):
            length = int(np.nonzero(weights)[0].max()) + 2
            rows[tuple(np.r_[inputs[:1], targets][:length].tolist())] = weights[:length - 1]
    return rows


@pytest.mark.parametrize("learn", ["completions", "all"])
def test_conversations_learn_their_assistant_turns_or_everything(tmp_path, tiny_data, learn):
    code, out = _prepare(tmp_path, tiny_data, [{"messages": m} for m in CONVERSATIONS * 3],
                         "--seq-len", "256", "--learn", learn)
    assert code == 0
    tokenizer = Tokenizer.load(str(tiny_data / "tokenizer.model"))
    expected = {}
    for messages in CONVERSATIONS:
        pieces = _chatml_pieces(messages)
        # Pieces merged where they touch with the same flag: one text each.
        ids, flags = [], []
        for text, learned in pieces:
            encoded = tokenizer.encode(text)
            ids += encoded
            flags += [int(learned or learn == "all")] * len(encoded)
        expected[tuple(ids + [tokenizer.eos_id])] = flags[1:] + [1]
    got = _records(out)
    assert set(got) == set(expected)
    for ids, weights in got.items():
        np.testing.assert_array_equal(weights, expected[ids])
    manifest = load_manifest(str(out))
    assert manifest["learn"] == learn
    assert manifest["chat_template"]["where"] == "the default chat template"


TEMPLATES = {
    # A system turn folded into the first user turn, the BOS once, EOS after replies.
    "folded-system": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + ' | ' %}{% set messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{% if message['role'] == 'user' %}[Q] {{ (system if loop.first else '') + "
        "message['content'] }} [/Q]"
        "{% else %}{% generation %} {{ message['content'] }}{{ eos_token }}{% endgeneration %}"
        "{% endif %}{% endfor %}"
    ),
    # Headers per turn, white space trimmed by the environment, tojson of non-ASCII text.
    "headers": (
        "{% for message in messages %}\n"
        "  <|{{ message.role }}|>\n"
        "{{ message.content | trim }}{% if not loop.last %}\n{% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        "{{ {'n': messages | length, 'é': 'ü'} | tojson }}"
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(name):
    """The oracle: transformers' `apply_chat_template` on a tokenizer with
    the same template and special tokens."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from pipelines.chat_template import ChatTemplate

    reference = PreTrainedTokenizerFast(
        tokenizer_object=RustTokenizer(models.WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>")),
        bos_token="<s>", eos_token="</s>")
    reference.chat_template = TEMPLATES[name]
    ours = ChatTemplate(TEMPLATES[name], {"bos_token": "<s>", "eos_token": "</s>"})
    for messages in [CONVERSATIONS[0], CONVERSATIONS[1][:3], CONVERSATIONS[1]]:
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == expected
    if name == "folded-system":
        segments = ours.segments(CONVERSATIONS[1])
        assert [text for text, learned in segments if learned] == [" cat</s>",
                                                                   " ran to the door</s>"]
        assert "".join(text for text, _ in segments) == ours.render(CONVERSATIONS[1])
        assert ours.end_of_turn() == "</s>"


def test_a_template_from_a_hugging_face_directory(tmp_path, tiny_data):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATES["folded-system"], "bos_token": {"content": "<s>"},
        "eos_token": "</s>"}))
    code, out = _prepare(tmp_path, tiny_data, [{"messages": m} for m in CONVERSATIONS * 2],
                         "--seq-len", "256", "--chat-template", str(model))
    assert code == 0
    tokenizer = Tokenizer.load(str(tiny_data / "tokenizer.model"))
    learned = {tuple(ids[1:][np.asarray(weights) == 1][:-1])  # (the EOS of the record)
               for ids, weights in ((np.asarray(k), v) for k, v in _records(out).items())}
    assert tuple(tokenizer.encode(" cat</s>")) in {piece[:len(tokenizer.encode(" cat</s>"))]
                                                   for piece in learned}
    assert load_manifest(str(out))["chat_template"]["special_tokens"] == {
        "bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('no system turns here') }}",
     r"examples.jsonl:2: .*template.jinja: the chat template failed to render: no system turns "
     r"here"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>"
     "{% endif %}",
     r"examples.jsonl:2: .*template.jinja: the chat template does not render a conversation's "
     r"first turns as the start of the whole \(turn 2\)"),
])
def test_a_template_that_fails_is_one_line_naming_file_and_line(tmp_path, tiny_data, capsys,
                                                                template, message):
    (tmp_path / "template.jinja").write_text(template)
    code, _ = _prepare(tmp_path, tiny_data, [{"text": "the cat"}, {"messages": CONVERSATIONS[0]}],
                       "--chat-template", str(tmp_path / "template.jinja"))
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and re.search(message, error), error


# ---- Fine-tuning a pretrained GPT on them (train_hvd.py --task sft --init RUN) ---------------

TINY = ["--num-layers", "2", "--num-heads", "2", "--hidden-dim", "16", "--intermediate-dim",
        "24", "--max-sequence-length", "16", "--dropout", "0.0", "--batch-size", "4",
        "--warmup-steps", "0", "--eval-batches", "0", "--log-every", "5"]


def _train(argv):
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    return train(train_config, overrides, LocalDistribution())


def test_sft_starts_from_the_init_runs_weights_and_learns_the_completions(tmp_path, tiny_data):
    from tfgpt.loading import load_model

    pretrained = tmp_path / "pretrained"
    _train(["--data", str(tiny_data), "--out", str(pretrained), "--steps", "4", *TINY])
    # Examples whose completion follows from the prompt: "X" -> "X X".
    words = WORDS[:8]
    examples = [{"prompt": f"{word} {other}", "completion": f"{other} {word}"}
                for word in words for other in words]
    code, data = _prepare(tmp_path, tiny_data, examples)
    assert code == 0
    common = ["--data", str(data), "--task", "sft", "--init", str(pretrained), *TINY[-8:]]
    # A learning rate of 1e-30: the init run's weights, and its loss on the completions.
    still, before = _train([*common, "--out", str(tmp_path / "still"), "--steps", "1",
                            "--learning-rate", "1e-30"])
    loaded, _ = load_model(str(pretrained))
    for mine, theirs in zip(still.weights, loaded.weights):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-20)
    tuned, after = _train([*common, "--out", str(tmp_path / "tuned"), "--steps", "40",
                           "--learning-rate", "0.02"])
    assert after["val_loss"] < before["val_loss"] - 0.5, (before["val_loss"], after["val_loss"])
    config = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert config["train"]["init"] == str(pretrained) and config["task"] == "sft"
    # Low-rank adapters: the base weights stay the init run's, bit for bit;
    # only the adapters train (and hold optimizer state), and they learn too.
    from tfgpt.models.adapters import adapter_variables

    adapted, with_adapters = _train([*common, "--out", str(tmp_path / "lora"), "--steps", "40",
                                     "--learning-rate", "0.02", "--lora-rank", "4",
                                     "--lora-targets", "query_key_value,feedforward_output"])
    adapters = {id(v) for v in adapter_variables(adapted)}
    assert len(adapters) == 2 * 2 * 2  # A and B, 2 projections, 2 blocks
    assert {id(v) for v in adapted.trainable_variables} == adapters
    base = [v for v in adapted.weights if id(v) not in adapters]
    for mine, theirs in zip(base, loaded.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert with_adapters["val_loss"] < before["val_loss"] - 0.05, (
        before["val_loss"], with_adapters["val_loss"])
    # The run's checkpoint loads (tfgpt.generate, export) with its adapters folded in.
    folded, _ = load_model(str(tmp_path / "lora"))
    ids = np.arange(12, dtype="int32").reshape(2, 6) % 50
    np.testing.assert_allclose(folded(ids).numpy(), adapted(ids).numpy(), rtol=0, atol=1e-5)
    assert np.abs(folded(ids).numpy() - loaded(ids).numpy()).max() > 1e-3  # not the base
    # `python -m tfgpt.convert merge` writes a plain run with them folded in,
    # which loads (and converts) as any run does.
    from tfgpt import convert
    from tfgpt.checkpoint.files import Reader, latest

    convert.main(["merge", str(tmp_path / "lora"), str(tmp_path / "merged")])
    assert "base" not in Reader(latest(str(tmp_path / "merged"))).index
    merged_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "train" not in merged_config
    # The run's chat template (its data's, ChatML's here) goes with it, for generate --chat.
    lora_config = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert merged_config["chat_template"] == lora_config["chat_template"] is not None
    plain, _ = load_model(str(tmp_path / "merged"))
    assert not adapter_variables(plain)
    np.testing.assert_allclose(plain(ids).numpy(), adapted(ids).numpy(), rtol=0, atol=1e-5)
    convert.main(["to-gpt2", str(tmp_path / "merged"), str(tmp_path / "gpt2")])
    converted, _ = convert.load_gpt2_checkpoint(str(tmp_path / "gpt2"), load_tokenizer=False)
    np.testing.assert_allclose(converted(ids).numpy(), adapted(ids).numpy(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=f"{tmp_path / 'tuned'} trained no adapters .*: "
                       "nothing to merge"):
        convert.merge(str(tmp_path / "tuned"), str(tmp_path / "not-merged"))
    # --init takes the merged run: its weights are the merged ones.
    still_merged, _ = _train([*common[:4], "--init", str(tmp_path / "merged"), *common[6:], "--out",
                              str(tmp_path / "from-merged"), "--steps", "1",
                              "--learning-rate", "1e-30"])
    np.testing.assert_allclose(still_merged(ids).numpy(), plain(ids).numpy(), rtol=0, atol=1e-5)


def test_a_lora_target_the_model_lacks_is_one_line(tmp_path, tiny_data):
    # The MLP of TINY is not gated: it has no feedforward_gate.
    with pytest.raises(ValueError, match="the adapter target 'feedforward_gate' names no "
                       "projection of this model, which has feedforward_intermediate, "
                       "feedforward_output, output_projection, query_key_value$") as raised:
        _train(["--data", str(tiny_data), "--out", str(tmp_path / "a"), "--steps", "1", *TINY,
                "--lora-rank", "2", "--lora-targets", "query_key_value,feedforward_gate"])
    assert "\n" not in str(raised.value)


def test_init_is_checked_against_the_family_and_the_datas_tokenizer(tmp_path, tiny_data):
    with pytest.raises(FileNotFoundError, match="not a tfgpt run directory"):
        _train(["--data", str(tiny_data), "--out", str(tmp_path / "a"), "--steps", "1",
                "--init", str(tmp_path / "nowhere"), *TINY])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"family": "gpt", "model": {}}))
    (other / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(ValueError, match="prepared with another tokenizer than the model of "
                       "--init .*: prepare it with --tokenizer"):
        _train(["--data", str(tiny_data), "--out", str(tmp_path / "b"), "--steps", "1",
                "--init", str(other), *TINY])


def test_a_split_whose_examples_are_all_too_long_says_how_to_keep_them(tmp_path, tiny_data,
                                                                       capsys):
    code, _ = _prepare(tmp_path, tiny_data,
                       [{"prompt": WORDS[index], "completion": " ".join(WORDS * 3)}
                        for index in range(12)])
    assert code == 2
    error = capsys.readouterr().err
    assert "split got no example: all " in error
    assert ("were longer than --seq-len 16 + 1 tokens; raise --seq-len, or cut them with "
            "--too-long truncate") in error


def test_an_adapter_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path, tiny_data):
    """Bit for bit: the adapters, their optimizer state and the data position."""
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.loop import Callback, StoppedEarly
    from tfgpt.training.trainer import train

    class StopAt(Callback):
        def should_stop(self, step):
            return "stopped for the test" if step == 3 else None

    pretrained = tmp_path / "pretrained"
    _train(["--data", str(tiny_data), "--out", str(pretrained), "--steps", "2", *TINY])
    code, data = _prepare(tmp_path, tiny_data, _examples(60))
    assert code == 0
    common = ["--data", str(data), "--task", "sft", "--init", str(pretrained), *TINY[-8:],
              "--steps", "6", "--learning-rate", "0.02", "--lora-rank", "2",
              "--lora-dropout", "0.1"]
    straight, _ = _train([*common, "--out", str(tmp_path / "straight")])
    config, overrides = parse_flags([*common, "--out", str(tmp_path / "resumed")])
    with pytest.raises(StoppedEarly):
        train(config, overrides, LocalDistribution(), callbacks=[StopAt()])
    resumed, _ = _train([*common, "--out", str(tmp_path / "resumed"), "--resume"])
    for mine, theirs in zip(resumed.weights, straight.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=mine.path)
    # Its checkpoints hold the adapters alone (and their optimizer state, the
    # step, the dropout states) and name the base: the --init run's checkpoint.
    from tfgpt.checkpoint.files import Reader, latest
    from tfgpt.checkpoint.state import model_entries
    from tfgpt.models.adapters import adapter_variables, base_keys

    adapters = {id(v) for v in adapter_variables(resumed)}
    adapter_keys = {e.key for e in model_entries(resumed) if id(e.variable) in adapters}
    assert len(adapter_keys) == 2 * 2 * 2  # A and B of 2 projections in 2 blocks
    checkpoint = latest(str(tmp_path / "resumed"))
    reader = Reader(checkpoint)
    assert reader.index["base"]["run"] == str(pretrained)
    assert reader.index["base"]["checkpoint"] == latest(str(pretrained))
    assert not set(reader.keys) & base_keys(resumed)
    assert adapter_keys <= set(reader.keys)
    rest = {key for key in reader.keys if key not in adapter_keys}
    assert all(key in ("step",) or key.startswith(("optimizer/", "rng/"))
               or key.rsplit("/", 1)[0] in adapter_keys for key in rest), sorted(rest)
    saved = sum(int(np.prod(entry["shape"])) for key, entry in reader.keys.items()
                if not key.startswith("rng/"))
    assert saved < sum(int(np.prod(v.shape)) for v in resumed.weights if id(v) not in adapters)


def test_adapters_on_another_or_a_missing_base_are_one_line_naming_both(tmp_path, tiny_data):
    import shutil

    from tfgpt.checkpoint import save_weights
    from tfgpt.checkpoint.files import latest
    from tfgpt.loading import load_model

    pretrained = tmp_path / "pretrained"
    _train(["--data", str(tiny_data), "--out", str(pretrained), "--steps", "2", *TINY])
    code, data = _prepare(tmp_path, tiny_data, _examples(60))
    assert code == 0
    common = ["--data", str(data), "--task", "sft", "--init", str(pretrained), *TINY[-8:],
              "--steps", "2", "--learning-rate", "0.02", "--lora-rank", "2"]
    lora = tmp_path / "lora"
    _train([*common, "--out", str(lora)])
    base_checkpoint = latest(str(pretrained))
    adapters = latest(str(lora))
    # An adapter run is no --init: its checkpoints lack the base weights.
    with pytest.raises(ValueError, match=f"--init {lora} is an adapter run .* merge {lora} DIR"):
        _train([*common[:4], "--init", str(lora), *common[6:-2], "--out", str(tmp_path / "x")])

    # The base checkpoint rewritten with other weights (one of them changed).
    base, _ = load_model(str(pretrained))
    base.weights[0].assign(base.weights[0] + 1e-3)
    save_weights(str(pretrained), base, step=2)
    assert latest(str(pretrained)) == base_checkpoint
    message = (f"the adapters of {adapters} were trained on another base than "
               f"{base_checkpoint} holds now")
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        load_model(str(lora))
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=re.escape(message)):  # a resume, alike
        _train([*common, "--out", str(lora), "--steps", "3", "--resume"])

    shutil.rmtree(base_checkpoint)
    with pytest.raises(ValueError, match=re.escape(
            f"the adapters of {adapters} were trained on the base {base_checkpoint}, which "
            "is missing")) as raised:
        load_model(str(lora))
    assert "\n" not in str(raised.value)


# A template short enough for TINY's 16 tokens: "X Y =" asks, " Y X." answers.
SHORT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }} ="
                  "{% elif m.role == 'assistant' %} {{ m.content }}.{% endif %}{% endfor %}")


def test_a_chat_fine_tune_learns_its_replies_and_generate_chat_prints_one(tmp_path, tiny_data,
                                                                          capsys):
    from pipelines.chat_template import ChatTemplate
    from tfgpt import generate
    from tfgpt.loading import load_model

    pretrained = tmp_path / "pretrained"
    _train(["--data", str(tiny_data), "--out", str(pretrained), "--steps", "4", *TINY])
    (tmp_path / "short.jinja").write_text(SHORT_TEMPLATE)
    words = WORDS[:8]
    chats = [{"messages": [{"role": "user", "content": f"{word} {other}"},
                           {"role": "assistant", "content": f"{other} {word}"}]}
             for word in words for other in words]
    code, data = _prepare(tmp_path, tiny_data, chats, "--chat-template",
                          str(tmp_path / "short.jinja"))
    assert code == 0
    common = ["--data", str(data), "--task", "sft", "--init", str(pretrained), *TINY[-8:]]
    _, before = _train([*common, "--out", str(tmp_path / "still"), "--steps", "1",
                        "--learning-rate", "1e-30"])
    _, after = _train([*common, "--out", str(tmp_path / "tuned"), "--steps", "40",
                       "--learning-rate", "0.02"])
    assert after["val_loss"] < before["val_loss"] - 0.5, (before["val_loss"], after["val_loss"])
    config = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert config["chat_template"]["source"] == SHORT_TEMPLATE

    capsys.readouterr()
    generate.main(["--checkpoint", str(tmp_path / "tuned"), "--chat", "--prompt", "cat mat",
                   "--max-new-tokens", "6"])
    printed = capsys.readouterr().out.strip()
    # The oracle: the reply to the rendered conversation, cut at the end of its turn.
    model, tokenizer = load_model(str(tmp_path / "tuned"))
    prompt = ChatTemplate(SHORT_TEMPLATE).render([{"role": "user", "content": "cat mat"}],
                                                 add_generation_prompt=True)
    assert prompt == "cat mat ="
    reply = tokenizer.decode(model.generate([tokenizer.encode(prompt)], 6,
                                            stop_token_ids=[tokenizer.eos_id])[0])
    assert printed == reply.split(".")[0].strip() and printed and "=" not in printed, (
        printed, reply)


def test_a_built_in_corpus_document_is_a_conversation_of_its_first_sentence_and_the_rest():
    from pipelines.chat_template import DEFAULT_TEMPLATE, ChatTemplate
    from pipelines.sources import default_corpus_example

    chat = ChatTemplate(DEFAULT_TEMPLATE)
    assert default_corpus_example("Return the length. It counts items.\n", chat) == [
        ("<|im_start|>user\nReturn the length.<|im_end|>\n<|im_start|>assistant\n", False),
        ("It counts items.<|im_end|>\n", True)]
    assert default_corpus_example("One sentence only.", chat) is None
