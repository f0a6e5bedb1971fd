"""The decoder families' folders (`tfgpt.models.decoder_families`): one registry that the
presets, the model types and the conversion read, and GPT-2 through the same
conversion as the other families, against transformers (tiny random models saved to
disk in the test; nothing downloaded)."""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file

from tests.model_contract import shapes_only
from tfgpt.config import FAMILIES, GPT_PRESETS, GPTConfig
from tfgpt.convert import save_gpt2_adapter
from tfgpt.convert_decoders import (
    ARCHITECTURES,
    hf_config_of,
    hf_decoder_config,
    load_hf_decoder,
    save_hf_adapter,
    save_hf_decoder,
)
from tfgpt.models.adapters import add_adapters
from tfgpt.models.decoder_families import DECODER_FAMILIES, MODEL_TYPES
from tfgpt.models.gpt import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_every_preset_and_model_type_is_one_familys():
    owners = {}
    for family in DECODER_FAMILIES.values():
        for name in family.presets:
            assert name not in owners, (name, owners.get(name), family.name)
            owners[name] = family.name
        converter = family.converter()
        for function in ("config_from_hf", "hf_config", "weight_map"):
            assert callable(getattr(converter, function)), (family.name, function)
    # The trainers' --preset choices are the families' presets, in the registry's order.
    assert list(FAMILIES["gpt"].presets) == list(owners)
    assert list(GPT_PRESETS) == list(DECODER_FAMILIES["gpt2"].presets)
    assert list(ARCHITECTURES) == list(MODEL_TYPES)
    assert {MODEL_TYPES[t].name for t in ("gpt2", "llama", "mistral", "qwen2", "gptj",
                                          "gpt_neo", "gpt_neox")} == set(DECODER_FAMILIES)


@pytest.mark.parametrize("preset", sorted(GPT_PRESETS))
def test_gpt2_presets_count_what_transformers_counts_and_convert_both_ways(preset):
    config = GPTConfig.from_preset(preset)
    with shapes_only():
        count = GPT(**dataclasses.asdict(config)).count_params()
    fields = hf_config_of(config, "gpt2")
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert count == reference.num_parameters(), preset
    assert hf_decoder_config(hf_config.to_dict()) == config


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gpt2_reads_and_writes_through_the_generic_conversion(tie, tmp_path):
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=24, n_inner=40, n_layer=3, n_head=4,
        tie_word_embeddings=tie)).eval()
    with torch.no_grad():  # norms and biases away from their defaults
        for parameter in reference.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape))
    reference.save_pretrained(tmp_path / "hf")
    model = load_hf_decoder(str(tmp_path / "hf"))
    assert model.tie_embeddings == tie
    assert model.count_params() == reference.num_parameters()
    ids = np.random.default_rng(1).integers(0, 97, (2, 11))
    np.testing.assert_allclose(model(tf.constant(ids)).numpy(), _torch_logits(reference, ids),
                               rtol=0, atol=1e-5)
    save_hf_decoder(model, str(tmp_path / "out"), "gpt2")
    reread = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(_torch_logits(reread, ids), model(tf.constant(ids)).numpy(),
                               rtol=0, atol=1e-5)


def test_gpt2_refuses_a_switch_it_lacks_and_writes_its_own_adapters(tmp_path):
    llama = GPTConfig.from_preset("llama-demo")
    with pytest.raises(ValueError, match="A gpt2 checkpoint has norm='layer'; this model has "
                                         "norm='rms'"):
        hf_config_of(llama, "gpt2")
    with pytest.raises(ValueError, match=r"`model_type` must be one of \('gpt2', 'llama'"):
        hf_config_of(llama, "falcon")
    model = GPT(vocabulary_size=31, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    add_adapters(model, rank=2, alpha=4.0)
    for layer in model.sublayers():
        if getattr(layer, "adapter_rank", 0):
            layer.adapter_b.assign(np.random.default_rng(0).normal(size=layer.adapter_b.shape))
    save_hf_adapter(model, str(tmp_path / "generic"), "gpt2")
    save_gpt2_adapter(model, str(tmp_path / "own"))
    generic = load_file(tmp_path / "generic" / "adapter_model.safetensors")
    own = load_file(tmp_path / "own" / "adapter_model.safetensors")
    assert sorted(generic) == sorted(own) and len(own) == 2 * 2 * 2  # A, B of 2 layers x 2
    for name in own:
        np.testing.assert_array_equal(generic[name], own[name])
    config = json.loads((tmp_path / "generic" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
