"""Fine-tuning a Hugging Face decoder from its own directory, with its own tokenizer.

`pipelines.prepare --tokenizer HF_DIR` encodes with the directory's byte-level
BPE `tokenizer.json`, and `train_hvd.py --init HF_DIR` starts from its weights.
The oracles: the `tokenizers` library's ids of each text, and transformers'
loss of the model on the run's first batch, with the same loss weights. The
model and the tokenizer are tiny, trained or drawn here; nothing is downloaded.
"""

import json
import os
import shutil
import types

import numpy as np
import pytest

from pipelines import prepare
from pipelines.instruction_data import make_instruction_dataset
from pipelines.reader import load_manifest
from tests.test_hf_tokenizers import train_byte_level
from tests.test_instruction_data import _prepare as prepare_instructions
from tfgpt.tokenizers.tokenizer_json import LLAMA3_SPLIT_PATTERN

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|eot_id|>{{ message['role'] }}\n"
            "{{ message['content'] }}<|end_of_text|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|eot_id|>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over lazy dog data model value self".split()
TRAIN = ["--batch-size", "2", "--warmup-steps", "0", "--eval-batches", "1", "--log-every", "1",
         "--no-shuffle", "--learning-rate", "0.01"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random transformers Llama with a Llama 3 style byte-level BPE
    tokenizer (its post-processor puts `<|begin_of_text|>` first), saved as
    `save_pretrained` and `tokenizers` write them."""
    directory = tmp_path_factory.mktemp("hf") / "llama"
    directory.mkdir()
    path = train_byte_level(LLAMA3_SPLIT_PATTERN, directory, SPECIAL,
                            template="<|begin_of_text|>", ignore_merges=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}))
    vocabulary_size = tokenizers.Tokenizer.from_file(str(path)).get_vocab_size()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocabulary_size, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # logits far from uniform: a loss that tells weights apart
        for parameter in model.parameters():
            if parameter.ndim > 1:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(str(directory))
    return directory


def _examples(count=24):
    rng = np.random.default_rng(1)
    pick = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    examples = []
    for index in range(count):
        if index % 4 == 3:
            examples.append({"text": pick(3)})
        elif index % 4 == 2:
            examples.append({"messages": [{"role": "user", "content": pick(2)},
                                          {"role": "assistant", "content": pick(2)}]})
        else:
            examples.append({"prompt": pick(2), "completion": " " + pick(2)})
    return examples


def _prepare(directory, examples, tokenizer):
    """`tests.test_instruction_data._prepare` with `tokenizer` (a directory), in
    one process; returns the data directory."""
    code, out = prepare_instructions(directory, tokenizer, examples, "--workers", "1")
    assert code == 0
    return out


def _train(argv):
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags([str(value) for value in argv])
    return train(train_config, overrides, LocalDistribution())


def test_prepare_encodes_text_and_examples_as_the_tokenizers_library(tmp_path, hf_llama):
    oracle = tokenizers.Tokenizer.from_file(str(hf_llama / "tokenizer.json"))
    eos = oracle.token_to_id("<|eot_id|>")  # tokenizer_config.json's eos_token

    def ids(text):  # without the post-processor's <|begin_of_text|>, as records hold it
        return oracle.encode(text, add_special_tokens=False).ids

    # Text: a stream of documents, each followed by the eos, cut into records.
    documents = [" ".join(np.random.default_rng(index).choice(WORDS, 9)) for index in range(12)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    packed = tmp_path / "packed"
    assert prepare.main(["--input", str(tmp_path / "corpus.txt"), "--output", str(packed),
                         "--seq-len", "16", "--tokenizer", str(hf_llama / "tokenizer.json"),
                         "--val-fraction", "0", "--workers", "1"]) == 0
    import tensorflow as tf

    manifest = load_manifest(str(packed))
    records = tf.data.TFRecordDataset(
        [str(packed / shard["filename"]) for shard in manifest["splits"]["train"]["shards"]])
    stream = [token for record in records for token in tf.train.Example.FromString(
        record.numpy()).features.feature["input_ids"].int64_list.value]
    expected = [token for document in documents for token in [*ids(document), eos]]
    assert len(stream) == len(expected) // 17 * 17 > 0
    assert stream == expected[:len(stream)]
    tokenizer = manifest["tokenizer"]
    assert tokenizer["type"] == "byte-level-bpe" and tokenizer["model_file"] == "tokenizer.json"
    assert (tokenizer["eos_id"], tokenizer["eos_piece"]) == (eos, "<|eot_id|>")
    assert tokenizer["vocabulary_size"] == oracle.get_vocab_size()
    assert tokenizer["source"] == str(hf_llama / "tokenizer.json")
    assert (packed / "tokenizer.json").read_bytes() == (hf_llama / "tokenizer.json").read_bytes()

    # Examples: prompt and completion, text, and messages in the directory's chat template.
    examples = _examples()
    out = _prepare(tmp_path, examples, hf_llama)
    chat = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_llama / "tokenizer.json"), chat_template=TEMPLATE,
        bos_token="<|begin_of_text|>")
    expected = {}
    for example in examples:
        if "messages" in example:
            before = chat.apply_chat_template(example["messages"][:1], tokenize=False,
                                              add_generation_prompt=True)
            whole = chat.apply_chat_template(example["messages"], tokenize=False)
            pieces = [(ids(before), 0), (ids(whole[len(before):]), 1)]
        else:
            pieces = [(ids(example.get("prompt", "")), 0),
                      (ids(example.get("completion", example.get("text"))), 1)]
        tokens = [token for piece, _ in pieces for token in piece] + [eos]
        learned = [flag for piece, flag in pieces for _ in piece] + [1]
        expected[tuple(tokens)] = learned
    seen = set()
    for split in ("train", "val"):
        for inputs, targets, weights in make_instruction_dataset(str(out), split, 1,
                                                                 shuffle=False, repeat=False):
            inputs, targets, weights = inputs[0].numpy(), targets[0].numpy(), weights[0].numpy()
            length = int(np.nonzero(weights)[0].max()) + 2  # the eos is the last learned
            tokens = tuple(np.r_[inputs[:1], targets][:length].tolist())
            assert tokens in expected, tokens
            np.testing.assert_array_equal(weights[:length - 1], expected[tokens][1:])
            seen.add(tokens)
    assert seen == {tokens for tokens in expected if len(tokens) <= 17}
    assert load_manifest(str(out))["chat_template"]["source"] == TEMPLATE


def _first_loss(run):
    with open(os.path.join(run, "metrics.jsonl")) as file:
        records = [json.loads(line) for line in file]
    return next(record for record in records if record.get("step") == 1)["loss"]


def _transformers_loss(hf_dir, data):
    """transformers' weighted mean token loss on the run's first batch."""
    inputs, targets, weights = (part.numpy() for part in next(iter(
        make_instruction_dataset(str(data), "train", 2, shuffle=False))))
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(inputs, dtype=torch.long)).logits
        losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(targets.reshape(-1),
                                                               dtype=torch.long),
            reduction="none").numpy()
    return float((losses * weights.reshape(-1)).sum() / weights.sum())


@pytest.mark.slow
def test_sft_and_adapters_start_from_a_transformers_directory(tmp_path, hf_llama):
    from tfgpt import convert
    from tfgpt.checkpoint.files import Reader, latest
    from tfgpt.loading import load_model

    data = _prepare(tmp_path, _examples(40), hf_llama)
    expected = _transformers_loss(hf_llama, data)
    common = ["--data", data, "--task", "sft", "--init", hf_llama, *TRAIN]

    # The whole model: its first loss is transformers' on that batch.
    _train([*common, "--out", tmp_path / "full", "--steps", "2"])
    assert _first_loss(tmp_path / "full") == pytest.approx(expected, rel=0, abs=1e-5)
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["train"]["init"] == str(hf_llama)
    assert config["init"]["directory"] == str(hf_llama)
    assert config["init"]["model_type"] == "llama"
    assert set(config["init"]["files"]) == {"config.json", "tokenizer.json",
                                            "tokenizer_config.json", "model.safetensors"}
    assert config["model"]["num_key_value_heads"] == 1 and config["model"]["hidden_dim"] == 16

    # Adapters: the same first loss; the checkpoints name the directory as their base.
    lora = tmp_path / "lora"
    _train([*common, "--out", lora, "--steps", "2", "--lora-rank", "4"])
    assert _first_loss(lora) == pytest.approx(expected, rel=0, abs=1e-5)
    reader = Reader(latest(str(lora)))
    assert reader.index["base"]["run"] == reader.index["base"]["checkpoint"] == str(hf_llama)
    assert not any(key.endswith("query/kernel") for key in reader.keys)  # the base left out
    # ... and a resume reads the base from there, and goes on.
    resumed, _ = _train([*common, "--out", lora, "--steps", "3", "--lora-rank", "4",
                         "--resume"])
    assert latest(str(lora)).endswith("ckpt-3")
    # `tfgpt.convert merge` folds them into the directory's weights.
    convert.main(["merge", str(lora), str(tmp_path / "merged")])
    merged, tokenizer = load_model(str(tmp_path / "merged"))
    base, _ = load_model(str(hf_llama))
    ids = np.arange(12, dtype="int32").reshape(2, 6) * 7
    np.testing.assert_allclose(merged(ids).numpy(), resumed(ids).numpy(), rtol=0, atol=1e-5)
    assert np.abs(merged(ids).numpy() - base(ids).numpy()).max() > 1e-3
    oracle = tokenizers.Tokenizer.from_file(str(hf_llama / "tokenizer.json"))
    assert tokenizer.encode("the quick fox") == oracle.encode("the quick fox").ids
    assert tokenizer.eos_id == oracle.token_to_id("<|eot_id|>")  # the directory's, kept


def test_init_refuses_an_unknown_model_type_and_data_of_another_tokenizer(
        tmp_path, hf_llama, tiny_data):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    config = json.loads((hf_llama / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    common = ["--task", "clm", "--steps", "1", *TRAIN]
    with pytest.raises(ValueError, match=r"config.json: model_type 'mamba' is not a decoder "
                       r"tfgpt reads; it reads gpt2, .*llama") as raised:
        _train([*common, "--data", tiny_data, "--init", unknown, "--out", tmp_path / "a"])
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=f"--data {tiny_data} was prepared with another "
                       f"tokenizer than the model of --init {hf_llama}: prepare it with "
                       f"--tokenizer {hf_llama}$"):
        _train([*common, "--data", tiny_data, "--init", hf_llama, "--out", tmp_path / "b"])


def test_a_sentencepiece_directory_gives_its_tokenizer_model_to_prepare_and_init(
        tmp_path, hf_llama, tiny_data):
    """Llama 2 and Mistral ship `tokenizer.model` beside a `tokenizer.json` that is not
    byte-level: preparation encodes with the former, and `--init` checks the data by it."""
    from pipelines.tokenizer import Tokenizer
    from tfgpt.training.trainer import read_init

    directory = tmp_path / "sentencepiece"
    shutil.copytree(hf_llama, directory)
    shutil.copy(tiny_data / "tokenizer.model", directory)
    content = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps({**content, "decoder": {
        "type": "Metaspace", "replacement": "\u2581"}}))
    tokenizer = Tokenizer.load(str(directory))
    assert isinstance(tokenizer, Tokenizer) and not tokenizer.add_bos
    assert tokenizer.model_proto == (tiny_data / "tokenizer.model").read_bytes()
    train_config = types.SimpleNamespace(init=str(directory), data=str(tiny_data),
                                         preset="gpt-demo")
    model = read_init(train_config, "gpt", load_manifest(str(tiny_data)))  # the same file
    assert model["vocabulary_size"] == json.loads(
        (hf_llama / "config.json").read_text())["vocab_size"]
