"""SavedModel export: reloaded in a fresh process, it answers as the Python model."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.export import GenerationModule, export
from tfgpt.tokenizers import BytePairTokenizer
from tfgpt.tokenizers.byte_pair_tokenizer import bytes_to_unicode

PROMPTS = ["the theme of the thesis", "", "Hello, world! 42", "the"]
# A chat template of short pieces (the context is 14 tokens): "u:the\na:" asks.
CHAT = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}")
CONVERSATIONS = [[("user", "the")],
                 [("system", "be"), ("user", "the the"), ("assistant", "th"), ("user", "e")]]
NEW_TOKENS = 6
CONTEXT = 14


def small_tokenizer():
    """A byte-level BPE vocabulary: 256 byte symbols, three merges, end-of-text."""
    symbols = list(bytes_to_unicode().values())
    merges = ["t h", "th e", "Ġ the"]
    vocabulary = {symbol: index for index, symbol in enumerate(symbols)}
    for merge in merges:
        vocabulary[merge.replace(" ", "")] = len(vocabulary)
    vocabulary["<|endoftext|>"] = len(vocabulary)
    return BytePairTokenizer(vocabulary, merges)


def small_model(vocabulary_size, seed=0):
    model = GPT(
        vocabulary_size=vocabulary_size, num_layers=2, num_heads=2, hidden_dim=10,
        intermediate_dim=18, max_sequence_length=CONTEXT,
    )
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        if len(weight.shape) == 2:
            weight.assign(rng.normal(0.0, 1.0 if weight.shape[0] == vocabulary_size else 0.3, weight.shape))
    return model


def python_reference(model, tokenizer, prompts, **options):
    """What `model.generate` and the Python tokenizer give for `prompts`.

    One batch, as the export runs it: sampled ids depend on the whole batch.
    """
    ids = [tokenizer.encode(p)[-(CONTEXT - NEW_TOKENS):] or [tokenizer.eos_id] for p in prompts]
    new_ids = model.generate(ids, NEW_TOKENS, stop_token_ids=[tokenizer.eos_id], **options)
    return [tokenizer.decode(row) for row in new_ids], new_ids


LOADER = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  registers the ops the tokenizers use
    results = {}
    for name, path in json.loads(sys.argv[1]).items():
        loaded = tf.saved_model.load(path)
        out = loaded.signatures["serving_default"](prompts=tf.constant(json.loads(sys.argv[2])))
        logits = loaded.signatures["logits"](token_ids=tf.constant([[1, 2, 3], [4, 5, 6]]))
        if "chat" in loaded.signatures:
            roles, contents = json.loads(sys.argv[3])
            chat = loaded.signatures["chat"](roles=tf.constant(roles),
                                             contents=tf.constant(contents))
            results[name + "-chat"] = [t.decode("utf-8") for t in chat["replies"].numpy()]
        results[name] = {
            "completions": [t.decode("utf-8") for t in out["completions"].numpy()],
            "texts": [t.decode("utf-8") for t in out["texts"].numpy()],
            "token_ids": out["token_ids"].numpy().tolist(),
            "lengths": out["lengths"].numpy().tolist(),
            "logits": logits["logits"].numpy().tolist(),
        }
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_saved_model_in_a_fresh_process_equals_the_python_model(tmp_path):
    from pipelines.tokenizer import train_tokenizer

    from pipelines.chat_template import ChatTemplate

    bpe = small_tokenizer()
    bpe_model = small_model(bpe.vocabulary_size, seed=1)
    export(bpe_model, bpe, str(tmp_path / "bpe"), NEW_TOKENS, chat_template=ChatTemplate(CHAT))

    documents = [f"the theme {i} of the thesis, hello world {i * 3}" for i in range(60)]
    sentencepiece = train_tokenizer(documents, 300, str(tmp_path / "t.model"), num_threads=1)
    sampled = dict(temperature=0.9, top_k=20, top_p=0.95, seed=5)
    sentencepiece_model = small_model(sentencepiece.vocabulary_size, seed=2)
    export(sentencepiece_model, sentencepiece, str(tmp_path / "sp"), NEW_TOKENS, **sampled)

    paths = {"bpe": str(tmp_path / "bpe"), "sp": str(tmp_path / "sp")}
    width = max(map(len, CONVERSATIONS))  # rows padded with "" roles
    turns = [[list(turn) for turn in conversation] + [["", ""]] * (width - len(conversation))
             for conversation in CONVERSATIONS]
    roles_and_contents = [[[role for role, _ in row] for row in turns],
                          [[content for _, content in row] for row in turns]]
    completed = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(paths), json.dumps(PROMPTS),
         json.dumps(roles_and_contents)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])

    for name, model, tokenizer, options in [
        ("bpe", bpe_model, bpe, {}),
        ("sp", sentencepiece_model, sentencepiece, sampled),
    ]:
        result = results[name]
        completions, token_ids = python_reference(model, tokenizer, PROMPTS, **options)
        assert result["completions"] == completions
        assert [row[:n] for row, n in zip(result["token_ids"], result["lengths"])] == token_ids
        expected = model(np.array([[1, 2, 3], [4, 5, 6]])).numpy()
        assert np.abs(np.array(result["logits"]) - expected).max() < 1e-5
    # The chat signature: the rendered conversations' completions, cut at the
    # end of the turn ("\n").
    rendered = [ChatTemplate(CHAT).render([{"role": role, "content": content}
                                           for role, content in conversation],
                                          add_generation_prompt=True)
                for conversation in CONVERSATIONS]
    assert rendered[1] == "s:be\nu:the the\na:th\nu:e\na:"
    replies, _ = python_reference(bpe_model, bpe, rendered)
    assert results["bpe-chat"] == [reply.split("\n")[0] for reply in replies]
    # The byte-level BPE round-trips a prompt exactly; the first prompt was
    # longer than the 8 tokens that fit and kept its end.
    assert results["bpe"]["texts"][3] == PROMPTS[3] + results["bpe"]["completions"][3]
    assert results["bpe"]["texts"][0].startswith(" of the thesis")


def test_module_truncates_long_prompts_and_starts_empty_ones_at_eos():
    tokenizer = small_tokenizer()
    model = small_model(tokenizer.vocabulary_size)
    module = GenerationModule(model, tokenizer, NEW_TOKENS)
    long_prompt = "the thesis " * 5
    out = module.generate(tf.constant([long_prompt, ""]))
    completions, token_ids = python_reference(model, tokenizer, [long_prompt, ""])
    assert [t.decode() for t in out["completions"].numpy()] == completions
    assert out["token_ids"].shape == (2, NEW_TOKENS)
    assert out["texts"].numpy()[1].decode().startswith("<|endoftext|>")


def test_chat_refuses_templates_it_cannot_render_and_rows_out_of_order():
    from pipelines.chat_template import ChatTemplate

    tokenizer = small_tokenizer()
    model = small_model(tokenizer.vocabulary_size)
    trimming = "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render a conversation as fixed text around "
                                         "each turn's content"):
        GenerationModule(model, tokenizer, NEW_TOKENS, chat_template=ChatTemplate(trimming))
    module = GenerationModule(model, tokenizer, NEW_TOKENS, chat_template=ChatTemplate(CHAT))
    with pytest.raises(tf.errors.InvalidArgumentError, match="roles must be \\[system,\\] user, assistant"):
        module.chat(tf.constant([["assistant", "user"]]), tf.constant([["a", "b"]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="roles must be \\[system,\\] user, assistant"):
        module.chat(tf.constant([["user", "assistant"]]), tf.constant([["a", "b"]]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=CONTEXT), rf"max_new_tokens={CONTEXT}.*max_sequence_length={CONTEXT}"),
        (dict(max_new_tokens=3, temperature=-1.0), r"temperature=-1.0"),
        (dict(max_new_tokens=3, seed=None), r"seed=None"),
    ],
)
def test_bad_export_settings_raise(tmp_path, kwargs, message):
    tokenizer = small_tokenizer()
    with pytest.raises(ValueError, match=message):
        export(small_model(tokenizer.vocabulary_size), tokenizer, str(tmp_path), **kwargs)
