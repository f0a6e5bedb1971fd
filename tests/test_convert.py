"""GPT-2 interop: tokenizer and logits against Hugging Face `transformers`.

The oracles are randomly initialised `transformers` GPT-2 models (PyTorch,
CPU) and a byte-level BPE vocabulary trained here with `tokenizers`; nothing
is downloaded. torch and transformers are test dependencies
(requirements-test.txt): a missing install fails these tests, it does not
skip them.
"""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tokenizers
import torch
import transformers

from tfgpt import GPT
from tfgpt.convert import (
    gpt2_config_from_model,
    load_gpt2_checkpoint,
    main,
    save_gpt2_checkpoint,
)
from tfgpt.loading import load_model, save_model
from tfgpt.tokenizers import BytePairTokenizer

# Logits of float32 PyTorch and TensorFlow agree to rounding; the largest
# difference seen is ~2e-7 on logits of magnitude ~1.
ATOL = 1e-5

TEXTS = [
    "Hello world! It's a test, isn't it? I'll say we'd they're you've I'm DON'T.",
    "The quick brown fox   jumps\n\n  over\t\tthe lazy dog.\r\n",
    "héllo wörld — naïve café 日本語 😀 emoji😀😀 ß ü ½ ²",
    "  leading spaces, trailing spaces   ",
    "'s 's 'sup 'S 'll've",
    "numbers 3.14159 1,000,000 2024-01-31 0x1F 123456789",
    "ideographic\u3000\u3000space, no-break\u00a0\u00a0space, \x0b\x0b vertical tab",
    "!!!??? ... --- ((())) [x] {y} <z> @#$%^&*_+=|\\/~`",
    "x <|endoftext|> y<|endoftext|>z  <|endoftext|>",
    "",
    " ",
    "\n\n\n",
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """A real byte-level BPE vocabulary (256 bytes + merges + <|endoftext|>)."""
    directory = tmp_path_factory.mktemp("bpe")
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        TEXTS[:6] * 4,
        vocab_size=300,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    trainer.save_model(str(directory))
    return directory


@pytest.fixture(scope="module")
def tokenizer(bpe_files):
    return BytePairTokenizer.from_directory(str(bpe_files))


def reference_tokenizer(directory):
    return transformers.GPT2Tokenizer(
        os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    )


def random_gpt2(tie=True, seed=0, **shape):
    """A transformers GPT-2 whose every parameter (norms, biases) is random."""
    config = dict(vocab_size=97, n_positions=16, n_embd=24, n_layer=3, n_head=4)
    config.update(shape)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            **config, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0
        )
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            mean = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
            parameter.copy_(mean + 0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def save_reference(model, directory, bpe_files=None):
    model.save_pretrained(str(directory))
    if bpe_files is not None:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(bpe_files / name, directory / name)
    return directory


# ---- Tokenizer ------------------------------------------------------------


def test_tokenizer_ids_equal_reference(bpe_files, tokenizer):
    reference = reference_tokenizer(bpe_files)
    ids = tokenizer.tokenize(tf.constant(TEXTS)).to_list()
    for text, got in zip(TEXTS, ids):
        assert got == reference.encode(text), repr(text)
        assert tokenizer.encode(text) == got


def test_tokenizer_decodes_to_the_original_text(tokenizer):
    ids = tokenizer.tokenize(tf.constant(TEXTS))
    assert [t.decode("utf-8") for t in tokenizer.detokenize(ids).numpy()] == TEXTS
    assert tokenizer.decode(tokenizer.encode(TEXTS[2])) == TEXTS[2]


def test_tokenizer_matches_reference_on_random_text(bpe_files, tokenizer):
    # Random mixes of the characters the pre-tokenizer treats specially.
    alphabet = list("aeiouxyzAZ0189'.,!?-_(\"sltrevmd") + [" "] * 10 + list(
        "\n\t\r\u3000\u00a0\x0b\x1céü日😀"
    )
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(alphabet, rng.integers(0, 30))) for _ in range(300)]
    reference = reference_tokenizer(bpe_files)
    got = tokenizer.tokenize(tf.constant(texts)).to_list()
    mismatches = [t for t, g in zip(texts, got) if g != reference.encode(t)]
    assert not mismatches, mismatches[:3]


def test_tokenizer_special_token_and_save_round_trip(tmp_path, tokenizer):
    assert tokenizer.eos_id == tokenizer.vocabulary["<|endoftext|>"]
    assert tokenizer.encode("<|endoftext|>") == [tokenizer.eos_id]
    tokenizer.save(str(tmp_path))
    again = BytePairTokenizer.from_directory(str(tmp_path))
    assert again.encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])


def test_tokenizer_bad_files(tmp_path, bpe_files):
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        BytePairTokenizer.from_files(str(bpe_files / "vocab.json"), str(tmp_path / "merges.txt"))
    with pytest.raises(ValueError, match="lacks 256 of the 256 byte symbols"):
        BytePairTokenizer({"hello": 0}, [])
    vocabulary = json.loads((bpe_files / "vocab.json").read_text())
    with pytest.raises(ValueError, match=r"merges\[0\]='abc'"):
        BytePairTokenizer(vocabulary, ["abc"])


# ---- Logits oracle ----------------------------------------------------------


@pytest.mark.parametrize(
    "shape, lengths",
    [
        (dict(), [1, 7, 16]),
        (dict(n_layer=2, n_head=2, n_embd=16, n_inner=40, n_positions=12), [5, 12]),
        (dict(n_layer=2, n_head=4, n_embd=32, activation_function="gelu"), [9]),
    ],
    ids=["3-layers", "n_inner", "exact-gelu"],
)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_converted_logits_match_transformers(tmp_path, shape, lengths, tie):
    reference = random_gpt2(tie=tie, **shape)
    save_reference(reference, tmp_path)
    model, tokenizer = load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)
    assert tokenizer is None
    assert model.tie_embeddings == tie
    # parameters() counts a tied matrix once, as count_params() does.
    assert model.count_params() == sum(p.numel() for p in reference.parameters())
    rng = np.random.default_rng(1)
    for length in lengths:
        ids = rng.integers(0, model.vocabulary_size, (2, length))
        expected = torch_logits(reference, ids)
        difference = np.abs(model(ids).numpy() - expected).max()
        assert difference < ATOL, (length, difference)


def test_pytorch_bin_checkpoint_loads(tmp_path):
    reference = random_gpt2(tie=False, seed=3)
    reference.config.save_pretrained(str(tmp_path))
    # The layout of the original GPT-2 release: no `transformer.` prefix, the
    # causal-mask buffers included.
    state = {
        name.removeprefix("transformer."): tensor
        for name, tensor in reference.state_dict().items()
    }
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
    torch.save(state, tmp_path / "pytorch_model.bin")
    model, _ = load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)
    ids = np.arange(10).reshape(2, 5)
    assert np.abs(model(ids).numpy() - torch_logits(reference, ids)).max() < ATOL


def test_full_directory_with_tokenizer(tmp_path, bpe_files):
    reference = random_gpt2(vocab_size=300, seed=4)
    save_reference(reference, tmp_path, bpe_files)
    model, tokenizer = load_gpt2_checkpoint(str(tmp_path))
    ids = [tokenizer.encode("Hello world! It's a test")]
    assert ids == [reference_tokenizer(tmp_path).encode("Hello world! It's a test")]
    assert np.abs(model(np.array(ids)).numpy() - torch_logits(reference, ids)).max() < ATOL


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_saved_gpt2_checkpoint_loads_in_transformers(tmp_path, tie):
    model = GPT(
        vocabulary_size=61,
        num_layers=3,
        num_heads=2,
        hidden_dim=20,
        intermediate_dim=44,
        max_sequence_length=14,
        tie_embeddings=tie,
    )
    for index, weight in enumerate(model.weights):
        weight.assign(np.random.default_rng(index).normal(0.0, 0.3, weight.shape))
    save_gpt2_checkpoint(model, str(tmp_path))
    reference = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ids = np.random.default_rng(2).integers(0, 61, (3, 14))
    assert np.abs(model(ids).numpy() - torch_logits(reference, ids)).max() < ATOL
    again, _ = load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)
    np.testing.assert_array_equal(again(ids).numpy(), model(ids).numpy())


def test_cli_round_trip_through_a_tfgpt_directory(tmp_path, bpe_files, capsys):
    reference = random_gpt2(vocab_size=300, seed=5)
    source = save_reference(reference, tmp_path / "gpt2", bpe_files)
    main(["to-tfgpt", str(source), str(tmp_path / "tfgpt")])
    assert "wrote" in capsys.readouterr().out
    model, tokenizer = load_model(str(tmp_path / "tfgpt"))
    assert isinstance(tokenizer, BytePairTokenizer)
    ids = np.arange(12).reshape(2, 6)
    assert np.abs(model(ids).numpy() - torch_logits(reference, ids)).max() < ATOL
    main(["to-gpt2", str(tmp_path / "tfgpt"), str(tmp_path / "back")])
    assert (tmp_path / "back" / "merges.txt").exists()
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    assert np.abs(torch_logits(back, ids) - torch_logits(reference, ids)).max() < ATOL
    # GPT-2's own convention: <|endoftext|> begins and ends a text.
    end_of_text = reference_tokenizer(source).convert_tokens_to_ids("<|endoftext|>")
    assert back.config.bos_token_id == back.config.eos_token_id == end_of_text


# ---- tfgpt run directories ----------------------------------------------------


def test_load_model_reads_a_trainer_run_directory(tmp_path):
    from pipelines.tokenizer import train_tokenizer
    from tfgpt.checkpoint import save_weights, write_run_files

    documents = [f"document {i}: the quick brown fox, {i * 7} jumps." for i in range(50)]
    tokenizer_path = str(tmp_path / "data.model")
    sentencepiece = train_tokenizer(documents, 320, tokenizer_path, num_threads=1)
    config = dict(
        # Two more rows than the tokenizer has ids, as --vocabulary-size allows.
        vocabulary_size=322, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=36, max_sequence_length=12,
    )
    model = GPT(**config)
    write_run_files(str(tmp_path / "run"), {"model": config, "train": {"steps": 3}},
                    tokenizer_path)
    save_weights(str(tmp_path / "run"), model, step=3)
    restored, tokenizer = load_model(str(tmp_path / "run"))
    ids = np.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(restored(ids).numpy(), model(ids).numpy())
    assert tokenizer.encode("the quick fox") == sentencepiece.encode("the quick fox")

    config_path = tmp_path / "run" / "config.json"
    config_path.write_text(json.dumps({"model": {**config, "intermediate_dim": 40}}))
    with pytest.raises(ValueError, match=r"holds 'block_0/feedforward_intermediate/kernel' with "
                                         r"shape \(16, 36\); this model's is \(16, 40\)"):
        load_model(str(tmp_path / "run"))
    config_path.write_text(json.dumps({"model": {**config, "num_layers": 3}}))
    with pytest.raises(ValueError, match=r"holds no 'block_2/"):
        load_model(str(tmp_path / "run"))
    config_path.write_text(json.dumps({"model": {**config, "vocabulary_size": 300}}))
    with pytest.raises(ValueError, match=r"tokenizer vocabulary size=320.*vocabulary_size=300"):
        load_model(str(tmp_path / "run"))


def sentencepiece_run(directory, vocabulary_size):
    """A trainer-style run directory: config.json, ckpt-1, tokenizer.model."""
    from pipelines.tokenizer import train_tokenizer
    from tfgpt.checkpoint import save_weights, write_run_files

    documents = [f"document {i}: the quick brown fox, {i * 7} jumps." for i in range(50)]
    tokenizer_path = str(directory / "data.model")
    sentencepiece = train_tokenizer(documents, vocabulary_size, tokenizer_path, num_threads=1)
    config = dict(
        vocabulary_size=vocabulary_size, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=36, max_sequence_length=12,
    )
    model = GPT(**config)
    for index, weight in enumerate(model.weights):
        weight.assign(np.random.default_rng(index).normal(0.0, 0.3, weight.shape))
    write_run_files(str(directory / "run"), {"model": config, "train": {"steps": 1}},
                    tokenizer_path)
    save_weights(str(directory / "run"), model, step=1)
    return directory / "run", model, sentencepiece


def test_exported_sentencepiece_run_carries_its_own_token_ids(tmp_path, capfd):
    run_dir, model, sentencepiece = sentencepiece_run(tmp_path, vocabulary_size=320)
    main(["to-gpt2", str(run_dir), str(tmp_path / "gpt2")])
    capfd.readouterr()
    written = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    reference = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "gpt2")).eval()
    load_messages = capfd.readouterr().err
    # The run's tokenizer ends documents with eos 2 and has no bos (-1).
    assert sentencepiece.eos_id == 2 and sentencepiece.bos_id == -1
    assert written["eos_token_id"] == reference.config.eos_token_id == sentencepiece.eos_id
    assert written["bos_token_id"] is None and reference.config.bos_token_id is None
    assert 0 <= reference.config.eos_token_id < reference.config.vocab_size == 320
    assert "token_id" not in load_messages, load_messages
    ids = np.random.default_rng(3).integers(0, 320, (2, 12))
    assert np.abs(model(ids).numpy() - torch_logits(reference, ids)).max() < ATOL


def test_token_id_outside_the_vocabulary_is_rejected():
    model = GPT(
        vocabulary_size=31, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=8,
    )
    with pytest.raises(ValueError, match="eos_id=50256"):
        gpt2_config_from_model(model, eos_id=50256)


# ---- Bad input ------------------------------------------------------------------


def test_mismatched_checkpoint_shape_names_the_weight(tmp_path):
    save_reference(random_gpt2(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_inner"] = 50
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"shape for `h.0.mlp.c_fc.weight`.*\(24, 96\).*\(24, 50\)"
    ):
        load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)


def test_extra_and_missing_weights_are_named(tmp_path):
    save_reference(random_gpt2(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 2}))
    with pytest.raises(ValueError, match=r"no place for.*h\.2\.attn\.c_attn\.bias"):
        load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 4}))
    with pytest.raises(ValueError, match=r"missing the weight `h\.3\.ln_1\.weight`"):
        load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)


def test_missing_files_are_named(tmp_path, bpe_files):
    with pytest.raises(FileNotFoundError, match="not found: .*nowhere"):
        load_gpt2_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="No config.json"):
        load_gpt2_checkpoint(str(tmp_path))
    random_gpt2().config.save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="No weights in .*model.safetensors"):
        load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        load_gpt2_checkpoint(str(tmp_path))


def test_vocabulary_larger_than_model_is_rejected(tmp_path, bpe_files):
    save_reference(random_gpt2(vocab_size=97), tmp_path, bpe_files)
    with pytest.raises(ValueError, match=r"tokenizer vocabulary size=300.*vocabulary_size=97"):
        load_gpt2_checkpoint(str(tmp_path))


def test_unsupported_gpt2_options_are_named(tmp_path):
    reference = random_gpt2()
    save_reference(reference, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, message in [
        ("activation_function", "silu", r"activation_function='silu'"),
        ("scale_attn_by_inverse_layer_idx", True, r"scale_attn_by_inverse_layer_idx=True"),
        ("model_type", "llama", r"model_type='llama'"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            load_gpt2_checkpoint(str(tmp_path), load_tokenizer=False)


def test_post_layer_norm_model_cannot_be_saved_as_gpt2(tmp_path):
    model = GPT(
        vocabulary_size=31, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=8, norm_first=False,
    )
    with pytest.raises(ValueError, match="norm_first=False"):
        save_gpt2_checkpoint(model, str(tmp_path))


def test_save_model_round_trip(tmp_path, tokenizer):
    model = GPT(
        vocabulary_size=300, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=8,
    )
    save_model(str(tmp_path), model, tokenizer)
    restored, restored_tokenizer = load_model(str(tmp_path))
    ids = np.arange(6).reshape(1, 6)
    np.testing.assert_array_equal(restored(ids).numpy(), model(ids).numpy())
    assert restored_tokenizer.encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])
