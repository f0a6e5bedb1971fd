"""GPT-J, GPT-Neo, GPT-NeoX, Llama, Mistral and Qwen2 against transformers: tiny random models
saved to disk in the test (nothing downloaded), imported into tfgpt's GPT and
exported back.

The oracle is transformers' own forward pass (float32, eager attention):
logits within 1e-5 (max abs) at lengths below and past Mistral's sliding
window, the parameter count, cached generation against the full forward
pass on a left-padded batch, and transformers reading what tfgpt writes.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from tfgpt.convert_decoders import hf_decoder_config, load_hf_decoder, save_hf_decoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)
TINY_GPTJ = dict(vocab_size=97, n_embd=32, n_inner=40, n_layer=2, n_head=4, n_positions=64,
                 rotary_dim=4)
TINY_NEOX = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
# Each a different set of switches; lengths 5 and 11 (past the window of 4).
CASES = {
    "gptj-partial-interleaved": ("GPTJConfig", dict(TINY_GPTJ)),
    "neo-local-every-second": ("GPTNeoConfig", dict(
        vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=40,
        max_position_embeddings=64, window_size=4, attention_types=[[["global", "local"], 1]])),
    "neox-parallel": ("GPTNeoXConfig", dict(TINY_NEOX, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    "neox-sequential-full-rotary": ("GPTNeoXConfig", dict(
        TINY_NEOX, use_parallel_residual=False, hidden_act="gelu_new", rope_parameters={
            "rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0})),
    "llama-gqa": ("LlamaConfig", dict(TINY, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3-scaled-tied-biased": ("LlamaConfig", dict(
        TINY, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16})),
    "mistral-window": ("MistralConfig", dict(TINY, num_key_value_heads=2, sliding_window=4,
                                             tie_word_embeddings=False)),
    "qwen2-biases": ("Qwen2Config", dict(TINY, num_key_value_heads=1, tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "linear",
                                                          "rope_theta": 1000.0,
                                                          "factor": 2.0})),
}


def _reference(case, directory):
    """A random transformers model of `case`, saved to `directory`."""
    config_class, fields = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**fields, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced weight shows
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:  # norms' weights and biases, all at their defaults
                parameter.normal_(1.0 if "norm" in name or "ln_" in name else 0.0, 0.3)
    model.save_pretrained(directory)
    return model


def _torch_logits(model, ids, mask=None):
    with torch.no_grad():
        kwargs = {} if mask is None else {
            "attention_mask": torch.tensor(mask),
            "position_ids": torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))}
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_logits_parameters_and_export_match_transformers(case, tmp_path):
    reference = _reference(case, tmp_path / "hf")
    model = load_hf_decoder(str(tmp_path / "hf"))
    assert model.count_params() == reference.num_parameters()
    rng = np.random.default_rng(1)
    for length in (5, 11):
        ids = rng.integers(0, 97, size=(2, length))
        got = model(tf.constant(ids)).numpy()
        np.testing.assert_allclose(got, _torch_logits(reference, ids), rtol=0, atol=1e-5,
                                   err_msg=f"{case}, length {length}")
    # Back out: transformers reads what tfgpt writes and computes its logits.
    model_type = json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    save_hf_decoder(model, str(tmp_path / "out"), model_type)
    reread = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    ids = rng.integers(0, 97, size=(1, 11))
    np.testing.assert_allclose(_torch_logits(reread, ids), model(tf.constant(ids)).numpy(),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "gptj-partial-interleaved",
                                  "neo-local-every-second"])
def test_cached_generation_on_a_left_padded_batch_equals_the_reference(case, tmp_path):
    reference = _reference(case, tmp_path / "hf")
    model = load_hf_decoder(str(tmp_path / "hf"))
    prompts = [[5, 17, 3, 44, 9, 2], [8, 61]]
    new = model.generate(prompts, max_new_tokens=5, use_cache=True)
    assert new == model.generate(prompts, max_new_tokens=5, use_cache=False)
    # Each row alone, greedy in transformers: the same continuation.
    for prompt, continuation in zip(prompts, new):
        ids = list(prompt)
        for _ in range(5):
            ids.append(int(_torch_logits(reference, [ids])[0, -1].argmax()))
        assert ids[len(prompt):] == continuation, (prompt, ids, continuation)
    # The padded batch's logits: the left-padded row as transformers sees it.
    mask = [[1] * 6, [0] * 4 + [1] * 2]
    ids = [prompts[0], [0] * 4 + prompts[1]]
    expected = _torch_logits(reference, ids, mask)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    got = model(tf.constant(ids), padding_mask=tf.constant(mask),
                positions=tf.constant(positions)).numpy()
    np.testing.assert_allclose(got[1, 4:], expected[1, 4:], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[0], expected[0], rtol=0, atol=1e-5)


def test_both_rope_key_layouts_read_alike_and_bad_configs_are_one_line(tmp_path):
    old = {**TINY, "model_type": "llama", "rope_theta": 500000.0,
           "rope_scaling": {"type": "linear", "factor": 4.0}}
    new = {**TINY, "model_type": "llama",
           "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}
    assert hf_decoder_config(old) == hf_decoder_config(new)
    assert (hf_decoder_config(new).rope_scaling, hf_decoder_config(new).rope_factor) == (
        "linear", 4.0)
    neox_old = {**TINY_NEOX, "model_type": "gpt_neox", "rotary_pct": 0.5,
                "rotary_emb_base": 500.0}
    neox_new = {**TINY_NEOX, "model_type": "gpt_neox", "rope_parameters": {
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}
    assert hf_decoder_config(neox_old) == hf_decoder_config(neox_new)
    assert hf_decoder_config(neox_new).rotary_dim == 4
    for config, message in (
        ({**TINY, "model_type": "falcon"}, "model_type 'falcon' is not a decoder tfgpt reads"),
        ({**new, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
         "the rope scaling type 'yarn' is not one tfgpt computes"),
        ({**new, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
          "layer_types": ["full_attention", "sliding_attention"]},
         "layer_types mixes sliding and full attention"),
    ):
        with pytest.raises(ValueError, match=message):
            hf_decoder_config(config)
    # A checkpoint whose tensors disagree with its config.json.
    _reference("llama-gqa", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"disagrees with its config.json: "
                                         r"`model.layers.0.mlp.gate_proj.weight` gives \(32, 40\)"):
        load_hf_decoder(str(tmp_path / "hf"))


# The presets' transformers model types.
PRESET_TYPES = {"llama3.2-1b": "llama", "llama3.2-3b": "llama", "llama3.1-8b": "llama",
                "mistral-7b": "mistral", "qwen2-0.5b": "qwen2", "qwen2-1.5b": "qwen2",
                "qwen2-7b": "qwen2", "gptj-6b": "gptj", "gpt-neo-125m": "gpt_neo",
                "gpt-neo-1.3b": "gpt_neo", "gpt-neo-2.7b": "gpt_neo",
                **{f"pythia-{size}": "gpt_neox"
                   for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")},
                # The demo sizes, one per family, for pretraining from scratch.
                "llama-demo": "llama", "mistral-demo": "mistral", "qwen2-demo": "qwen2",
                "gptj-demo": "gptj", "gpt-neo-demo": "gpt_neo", "pythia-demo": "gpt_neox"}


@pytest.mark.parametrize("preset", sorted(PRESET_TYPES))
def test_each_preset_counts_the_parameters_transformers_counts(preset):
    import dataclasses

    from tests.model_contract import shapes_only
    from tfgpt.config import GPTConfig
    from tfgpt.convert_decoders import hf_config_of
    from tfgpt.models.gpt import GPT

    config = GPTConfig.from_preset(preset)
    with shapes_only():
        count = GPT(**dataclasses.asdict(config)).count_params()
    fields = hf_config_of(config, PRESET_TYPES[preset])
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert count == reference.num_parameters(), preset
    assert hf_decoder_config(hf_config.to_dict()) == config
