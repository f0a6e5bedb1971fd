"""Hugging Face tokenizers in TensorFlow ops: byte-level BPE from `tokenizer.json`
and SentencePiece from `tokenizer.model`.

The oracles are the `tokenizers` library (`Tokenizer.from_file(...).encode`),
`sentencepiece` and transformers' `LlamaTokenizer`, on tokenizers trained here
on a few hundred lines; nothing is downloaded.
"""

import io
import json
import shutil

import numpy as np
import pytest
import sentencepiece
import tensorflow as tf
import transformers
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pipelines.tokenizer import Tokenizer as SentencePieceTokenizer
from tfgpt.loading import load_hf_tokenizer
from tfgpt.tokenizers import BytePairTokenizer
from tfgpt.tokenizers.tokenizer_json import (
    GPT2_SPLIT_PATTERN,
    LLAMA3_SPLIT_PATTERN,
    QWEN2_SPLIT_PATTERN,
)

TEXTS = [
    "Hello world! It's a test, isn't it? I'll say we'd they're you've I'm DON'T.",
    "I'M SURE THEY'LL GO, they'll go, She'S HERE, we'Ve 'd 'LL",
    "def tokenize(self, text):\n    if not text:\n\treturn []\n        return [x for x in text]\n",
    "numbers 3.14159 1,000,000 2024-01-31 0x1F 123456789012345 42 7",
    "héllo wörld — naïve café, cafe\u0301 (decomposed) 日本語のテキスト 中文 한국어 ß ü ½ ²",
    "emoji 😀 😀😀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "runs   of    spaces\n\n\n  and\n \n\t\tnewlines \n",
    "windows\r\nline\r\n\r\nendings\r\n",
    "   leading and trailing whitespace   ",
    "\n\nstarts with newlines",
    "ideographic\u3000\u3000space, no-break\u00a0\u00a0space, \x0b\x0b vertical tab",
    "!!!??? ... --- ((())) [x] {y} <z> @#$%^&*_+=|\\/~` (hello) ..word",
    "special <|endoftext|> tokens<|endoftext|>inside  <|endoftext|>",
    "",
    " ",
    "\n",
    "x",
]
SPECIAL = "<|endoftext|>"


def corpus():
    """A few hundred varied lines to train the tiny tokenizers on."""
    rng = np.random.default_rng(0)
    words = ("the quick brown fox jumps over lazy dog It's they'll I'M DON'T return def "
             "class import self value 12 345 6789 café naïve 日本 语 😀 data model").split()
    lines = [text for text in TEXTS if text.strip()] * 3
    for _ in range(300):
        line = " ".join(rng.choice(words, rng.integers(3, 12)))
        indent = rng.choice(["", "    ", "\t", "  "])
        lines.append(indent + line + rng.choice([".", ",", "!", "\n", ":\n    pass", " 2024"]))
    return lines


def train_byte_level(pattern, directory, special_tokens, template=None, normalizer=None,
                     ignore_merges=False):
    """A byte-level BPE `tokenizer.json` with about 300 merges; returns its path."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if pattern is None:  # ByteLevel's own GPT-2 pattern, as GPT-2 and GPT-NeoX ship it.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # Llama 3, Qwen2.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(special_tokens) + 300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    if template is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{template} $A", special_tokens=[(template, tokenizer.token_to_id(template))]
        )
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def byte_level_files(tmp_path_factory):
    """name -> tokenizer.json path, for each supported pre-tokenizer pattern."""
    root = tmp_path_factory.mktemp("byte_level")
    files = {}
    directory = root / "gpt2"
    directory.mkdir()
    files["gpt2"] = train_byte_level(None, directory, [SPECIAL])
    # The older file layout: merges as "a b" strings, GPT-2 and Pythia ship it.
    content = json.loads(files["gpt2"].read_text())
    content["model"]["merges"] = [" ".join(pair) for pair in content["model"]["merges"]]
    files["gpt2"].write_text(json.dumps(content, ensure_ascii=False))
    directory = root / "llama3"
    directory.mkdir()
    files["llama3"] = train_byte_level(
        LLAMA3_SPLIT_PATTERN, directory, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        template="<|begin_of_text|>", ignore_merges=True,
    )
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    directory = root / "qwen2"
    directory.mkdir()
    files["qwen2"] = train_byte_level(
        QWEN2_SPLIT_PATTERN, directory, [SPECIAL, "<|im_start|>", "<|im_end|>"],
        normalizer=normalizers.NFC(),
    )
    return files


def with_specials(texts, special_tokens):
    """`texts` with GPT-2's `<|endoftext|>` also spelled as this tokenizer's specials."""
    extra = [text.replace(SPECIAL, token) for token in special_tokens for text in texts
             if SPECIAL in text]
    return texts + extra


def random_texts(count, seed):
    """Random mixes of the characters the pre-tokenizers treat specially."""
    alphabet = list("aeiouxyzAZSLT0189'.,!?-_(\"sltrevmd") + [" "] * 10 + list(
        "\n\n\t\r\r\u3000\u00a0\x0b\x1c\x85\u2028\u0301\u017féü日😀"
    ) + [SPECIAL]
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(alphabet, rng.integers(0, 40))) for _ in range(count)]


# ---- Byte-level BPE from tokenizer.json --------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen2"])
def test_byte_level_ids_equal_the_tokenizers_library(byte_level_files, name):
    path = byte_level_files[name]
    reference = Tokenizer.from_file(str(path))
    tokenizer = BytePairTokenizer.from_tokenizer_json(str(path))
    texts = with_specials(TEXTS, tokenizer.special_tokens) + random_texts(300, seed=len(name))
    got = tokenizer.tokenize(tf.constant(texts)).to_list()
    mismatches = [(text, ids, reference.encode(text).ids)
                  for text, ids in zip(texts, got) if ids != reference.encode(text).ids]
    assert not mismatches, mismatches[:3]
    assert tokenizer.encode(TEXTS[1]) == reference.encode(TEXTS[1]).ids
    # Decoding writes special tokens as their text, as the reference does when
    # asked not to skip them; NFC aside, that is the text again.
    decoded = [t.decode("utf-8") for t in tokenizer.detokenize(tf.ragged.constant(got)).numpy()]
    for text, ids, back in zip(texts, got, decoded):
        assert back == reference.decode(ids, skip_special_tokens=False), repr(text)
    prefix = "<|begin_of_text|>" if name == "llama3" else ""
    expected = [prefix + (t.replace("e\u0301", "é") if name == "qwen2" else t) for t in TEXTS]
    assert decoded[: len(TEXTS)] == expected


def test_byte_level_settings_read_from_the_file(byte_level_files):
    llama = BytePairTokenizer.from_tokenizer_json(str(byte_level_files["llama3"]))
    assert llama.split_pattern == LLAMA3_SPLIT_PATTERN
    assert llama.ignore_merges and llama.normalization is None
    assert llama.prefix_ids == [llama.special_tokens["<|begin_of_text|>"]] == [llama.bos_id]
    assert llama.eos_id == llama.special_tokens["<|end_of_text|>"]  # tokenizer_config.json
    assert llama.encode("") == llama.prefix_ids
    qwen = BytePairTokenizer.from_tokenizer_json(str(byte_level_files["qwen2"]))
    assert (qwen.split_pattern, qwen.normalization) == (QWEN2_SPLIT_PATTERN, "NFC")
    assert qwen.eos_id == qwen.special_tokens[SPECIAL] and qwen.prefix_ids == []
    gpt2 = BytePairTokenizer.from_tokenizer_json(str(byte_level_files["gpt2"]))
    assert gpt2.split_pattern == GPT2_SPLIT_PATTERN


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_byte_level_runs_in_a_saved_model(tmp_path, byte_level_files, name):
    directory = byte_level_files[name].parent
    tokenizer = load_hf_tokenizer(str(directory))
    module = tf.Module()
    module.tokenizer = tokenizer.tf_tokenizer()
    module.encode = tf.function(
        lambda texts: module.tokenizer.tokenize(texts).to_tensor(-1),
        input_signature=[tf.TensorSpec([None], tf.string)],
    )
    tf.saved_model.save(module, str(tmp_path / "saved"))
    restored = tf.saved_model.load(str(tmp_path / "saved"))
    texts = TEXTS[:4]
    ids = restored.encode(tf.constant(texts)).numpy()
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for row, text in zip(ids, texts):
        assert [i for i in row if i >= 0] == reference.encode(text).ids


def test_byte_level_save_round_trip(tmp_path, byte_level_files):
    tokenizer = BytePairTokenizer.from_tokenizer_json(str(byte_level_files["llama3"]))
    tokenizer.save(str(tmp_path))
    again = BytePairTokenizer.from_directory(str(tmp_path))
    assert again.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert again.split_pattern == LLAMA3_SPLIT_PATTERN


def edited(source, directory, edit):
    """A copy of the tokenizer.json at `source` in `directory`, changed by `edit`."""
    content = json.loads(source.read_text())
    edit(content)
    directory.mkdir(exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(content))
    return path


def test_byte_level_refuses_what_it_does_not_run(tmp_path, byte_level_files):
    source = byte_level_files["llama3"]

    def wordpiece(content):
        content["model"] = {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]"}

    def unigram(content):
        content["model"] = {"type": "Unigram", "vocab": [["a", 0.0]]}

    def other_pattern(content):
        content["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+(?=\s)|\s+"

    cases = [
        (wordpiece, r"tokenizer.json: .*not BPE. Received: model type='WordPiece'"),
        (unigram, r"not BPE. Received: model type='Unigram'"),
        (other_pattern, r"tokenizer.json: .*Received: pattern=\{'Regex': '\\\\w\+\(\?=\\\\s\)"),
    ]
    for index, (edit, message) in enumerate(cases):
        path = edited(source, tmp_path / str(index), edit)
        with pytest.raises(ValueError, match=message):
            BytePairTokenizer.from_tokenizer_json(str(path))
    with pytest.raises(ValueError, match=r"`split_pattern` .* Received: split_pattern='\\\\w\+'"):
        BytePairTokenizer(BytePairTokenizer.from_tokenizer_json(str(source)).vocabulary, [],
                          split_pattern=r"\w+")


# ---- SentencePiece from tokenizer.model -------------------------------------


@pytest.fixture(scope="module")
def llama2_directory(tmp_path_factory):
    """A Llama-2-style directory: tokenizer.model (BPE, byte fallback, dummy
    prefix, unk 0, bos 1, eos 2) and tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("llama2")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="bpe",
        vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>",
    }))
    return directory


def test_sentencepiece_ids_equal_sentencepiece_with_bos(llama2_directory):
    reference = sentencepiece.SentencePieceProcessor(
        model_file=str(llama2_directory / "tokenizer.model"))
    tokenizer = load_hf_tokenizer(str(llama2_directory))
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    texts = TEXTS + random_texts(100, seed=3)
    expected = [[1] + reference.encode(text) for text in texts]
    assert [tokenizer.encode(text) for text in texts] == expected
    assert tokenizer.encode_batch(texts, num_threads=1) == expected
    ids = tokenizer.tf_tokenizer().tokenize(tf.constant(texts))
    assert ids.to_list() == expected
    decoded = tokenizer.tf_tokenizer().detokenize(ids).numpy()
    assert [t.decode("utf-8") for t in decoded[: len(TEXTS)]] == TEXTS
    assert tokenizer.decode(expected[0]) == TEXTS[0]


def test_sentencepiece_ids_equal_transformers(llama2_directory):
    reference = transformers.AutoTokenizer.from_pretrained(str(llama2_directory))
    tokenizer = load_hf_tokenizer(str(llama2_directory))
    # transformers also reads `<s>` in the text as the bos id, and converts the
    # model to its own BPE, which cuts some runs of spaces at the start of a
    # text differently; prose and code without those agree.
    texts = [t for t in TEXTS if "<" not in t and not t.startswith((" ", "\n"))]
    assert [tokenizer.encode(t) for t in texts] == [reference.encode(t) for t in texts]


def test_sentencepiece_runs_in_a_tf_function(llama2_directory):
    tokenizer = load_hf_tokenizer(str(llama2_directory)).tf_tokenizer()
    encode = tf.function(lambda texts: tokenizer.tokenize(texts).to_tensor(-1),
                         input_signature=[tf.TensorSpec([None], tf.string)])
    ids = encode(tf.constant(TEXTS[:3])).numpy()
    reference = sentencepiece.SentencePieceProcessor(
        model_file=str(llama2_directory / "tokenizer.model"))
    for row, text in zip(ids, TEXTS[:3]):
        assert [i for i in row if i >= 0] == [1] + reference.encode(text)


# ---- Picking the file ---------------------------------------------------------


def test_directory_picks_tokenizer_json_then_model_then_vocab(
        tmp_path, byte_level_files, llama2_directory):
    both = tmp_path / "both"
    shutil.copytree(byte_level_files["llama3"].parent, both)
    shutil.copy(llama2_directory / "tokenizer.model", both)
    assert isinstance(load_hf_tokenizer(str(both)), BytePairTokenizer)
    # A tokenizer.json that is not byte-level (Llama 2's is SentencePiece-like)
    # leaves tokenizer.model to be read.
    edited(byte_level_files["llama3"], both, lambda c: c.update(decoder={"type": "Metaspace"}))
    assert isinstance(load_hf_tokenizer(str(both)), SentencePieceTokenizer)
    files = tmp_path / "files"
    BytePairTokenizer.from_tokenizer_json(str(byte_level_files["gpt2"])).save(str(files))
    (files / "tokenizer.json").unlink()
    tokenizer = load_hf_tokenizer(str(files))
    assert tokenizer.encode(TEXTS[0]) == Tokenizer.from_file(
        str(byte_level_files["gpt2"])).encode(TEXTS[0]).ids


def test_directory_without_tokenizer_files_is_named(tmp_path, byte_level_files):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"No tokenizer in .*empty: expected tokenizer.json, "
                                         r"tokenizer.model, or vocab.json and merges.txt"):
        load_hf_tokenizer(str(tmp_path / "empty"))
    path = edited(byte_level_files["gpt2"], tmp_path / "wordpiece",
                  lambda c: c.update(model={"type": "WordPiece", "vocab": {}}))
    with pytest.raises(ValueError, match=r"wordpiece/tokenizer.json: .*model type='WordPiece'"):
        load_hf_tokenizer(str(path.parent))


# ---- A Hugging Face decoder directory, loaded and exported ----------------------


@pytest.mark.parametrize("source", ["tokenizer.json", "tokenizer.model"])
def test_llama_directory_loads_with_its_tokenizer_and_generates_from_text(
        tmp_path, byte_level_files, llama2_directory, source):
    torch = pytest.importorskip("torch")
    from tfgpt.export import GenerationModule
    from tfgpt.loading import load_model

    tokenizer_directory = (byte_level_files["llama3"].parent if source == "tokenizer.json"
                           else llama2_directory)
    directory = tmp_path / "llama"
    shutil.copytree(tokenizer_directory, directory)
    vocabulary_size = load_hf_tokenizer(str(directory)).vocabulary_size
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocabulary_size, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32)).save_pretrained(directory)
    model, tokenizer = load_model(str(directory))
    bos = "<|begin_of_text|>" if source == "tokenizer.json" else ""
    assert tokenizer.encode("Hello world")[0] == (
        tokenizer.special_tokens[bos] if bos else tokenizer.bos_id)
    module = GenerationModule(model, tokenizer, 3, stop_at_eos=False)  # What export saves.
    outputs = module.generate(tf.constant(["Hello world", ""]))
    texts = [t.decode("utf-8", "replace") for t in outputs["texts"].numpy()]
    assert texts[0].startswith(bos + "Hello world")
    assert outputs["lengths"].numpy().tolist() == [3, 3]
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (directory / name).exists():
            (directory / name).unlink()
    with pytest.raises(ValueError, match=r"No tokenizer in .*llama: expected tokenizer.json"):
        load_model(str(directory))
