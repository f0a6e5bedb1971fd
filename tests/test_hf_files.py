"""Reading transformers checkpoint directories (`tfgpt.hf_files`): every weight
file layout save_pretrained writes, read lazily.

The oracle is transformers' own forward pass on the same tiny random model,
saved as `model.safetensors`, sharded safetensors, `pytorch_model.bin` and
sharded `pytorch_model.bin`; and the total bytes of the checkpoint, which a
lazy read must stay far below.
"""

import json
import os
import tracemalloc

import numpy as np
import pytest

from tfgpt.convert_decoders import load_hf_decoder, load_hf_weights
from tfgpt.convert_encoders import load_hf_encoder
from tfgpt.hf_files import read_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             tie_word_embeddings=False)
FILES = {"safetensors": "model.safetensors", "safetensors-shards": "model.safetensors.index.json",
         "bin": "pytorch_model.bin", "bin-shards": "pytorch_model.bin.index.json"}


def _save_bin(model, directory, shards):
    """`pytorch_model.bin`, or `shards` files and their index, as older
    transformers wrote them (transformers 5 writes safetensors only)."""
    state = model.state_dict()
    if shards == 1:
        torch.save(state, os.path.join(directory, "pytorch_model.bin"))
        return
    names = sorted(state)
    weight_map = {}
    for index in range(shards):
        file = f"pytorch_model-{index + 1:05d}-of-{shards:05d}.bin"
        part = names[index::shards]
        torch.save({name: state[name] for name in part}, os.path.join(directory, file))
        weight_map.update({name: file for name in part})
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as file:
        json.dump({"metadata": {}, "weight_map": weight_map}, file)


def _llama(directory, layout, dtype=None, **fields):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dict(LLAMA, **fields), attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    if layout.startswith("bin"):
        config.save_pretrained(directory)
        _save_bin(model, directory, shards=3 if "shards" in layout else 1)
    else:
        model.save_pretrained(directory, **({"max_shard_size": "100KB"} if "shards" in layout
                                            else {}))
    return model


@pytest.mark.parametrize("layout", [*sorted(FILES), "bin-bfloat16"])
def test_each_weight_layout_loads_with_transformers_logits(layout, tmp_path):
    dtype = torch.bfloat16 if layout.endswith("bfloat16") else None
    layout = layout.removesuffix("-bfloat16")
    reference = _llama(tmp_path, layout, dtype=dtype).float()
    assert os.path.exists(tmp_path / FILES[layout]), sorted(os.listdir(tmp_path))
    if "shards" in layout:  # the index lists several files
        with open(tmp_path / FILES[layout]) as file:
            assert len(set(json.load(file)["weight_map"].values())) > 1
    model = load_hf_decoder(str(tmp_path))
    ids = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], (2, 9))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(ids).numpy(), expected, atol=1e-5, rtol=0)


def test_an_encoder_loads_from_pytorch_model_bin(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=24)
    reference = transformers.BertModel(config).eval()
    config.save_pretrained(tmp_path)
    _save_bin(reference, tmp_path, shards=1)
    model = load_hf_encoder(str(tmp_path), head=None)
    ids = np.random.default_rng(1).integers(0, 50, (2, 7))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).last_hidden_state.numpy()
    outputs = model({"token_ids": ids, "padding_mask": np.ones_like(ids),
                     "segment_ids": np.zeros_like(ids)})
    np.testing.assert_allclose(outputs["sequence_output"].numpy(), expected, atol=1e-5, rtol=0)


def test_a_bfloat16_checkpoint_is_widened_one_tensor_at_a_time(tmp_path):
    """Loading holds the tensor being assigned, not a float32 copy of them all.

    A model large enough (10 MB in float32) that Python's own allocations
    are small beside it. TensorFlow may keep an assigned NumPy buffer as
    the variable's storage, so what stays allocated after loading is the
    model's one copy; the peak above it is what loading held besides: a
    float32 copy of every tensor read at once would put it near the whole.
    """
    reference = _llama(tmp_path, "safetensors", dtype=torch.bfloat16, vocab_size=256,
                       hidden_size=256, intermediate_size=512)
    model = load_hf_decoder(str(tmp_path))  # built, then loaded again below, traced
    whole = sum(p.numel() for p in reference.parameters()) * 4  # float32 bytes
    largest = max(p.numel() for p in reference.parameters()) * 4
    tracemalloc.start()
    try:
        tensors = read_weights(str(tmp_path))
        read, _ = tracemalloc.get_traced_memory()
        load_hf_weights(model, tensors, str(tmp_path), "llama")
        del tensors
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read < largest, (read, largest)  # nothing read until asked for
    assert peak - held < whole / 4, (peak, held, whole, largest)
    # Widened right: transformers' logits of the same weights in float32 (at
    # this width the two sum in different orders: 2e-5 apart).
    ids = np.random.default_rng(2).integers(0, 256, (1, 6))
    with torch.no_grad():
        expected = reference.float()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(ids).numpy(), expected, atol=5e-5, rtol=0)


def test_missing_weights_and_shards_are_named(tmp_path):
    _llama(tmp_path, "safetensors-shards")
    with open(tmp_path / "model.safetensors.index.json") as file:
        first = sorted(set(json.load(file)["weight_map"].values()))[0]
    os.remove(tmp_path / first)
    with pytest.raises(FileNotFoundError, match=f"lists {first}, which is missing"):
        load_hf_decoder(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="No weights in .*expected one of "
                       "model.safetensors, .*pytorch_model.bin"):
        load_hf_decoder(str(empty))
