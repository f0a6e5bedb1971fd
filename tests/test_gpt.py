"""GPT model: NumPy oracles, causality, parameter counts, saving, errors."""

import math

import numpy as np
import pytest

from tests import model_contract as contract
from tfgpt import GPT, GPTConfig
from tfgpt.config import FAMILIES
from tfgpt.layers import CausalSelfAttention, TransformerBlock

# Distinct sizes so that no two dimensions can be confused for each other.
BATCH, LENGTH = 2, 5
VOCAB, LAYERS, HEADS = contract.VOCAB, contract.LAYERS, contract.HEADS
HIDDEN, INTERMEDIATE = contract.HIDDEN, contract.INTERMEDIATE
tiny_config = contract.tiny_fields


def tiny_model(**overrides):
    return GPT(**tiny_config(**overrides))


def random_ids(seed=0, batch=BATCH, length=LENGTH):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype("int32")


# ---- NumPy reference implementation ------------------------------------


def np_layer_norm(x, gamma, beta, epsilon=1e-5):
    mean = x.mean(-1, keepdims=True)
    variance = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * gamma + beta


def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_attention(x, layer):
    """Causal multi-head attention written from the paper, head by head."""
    qkv_kernel, qkv_bias = (w.numpy() for w in layer.query_key_value.weights)
    out_kernel, out_bias = (w.numpy() for w in layer.output_projection.weights)
    hidden = x.shape[-1]
    head_dim = hidden // layer.num_heads
    qkv = x @ qkv_kernel + qkv_bias
    q, k, v = qkv[..., :hidden], qkv[..., hidden : 2 * hidden], qkv[..., 2 * hidden :]
    length = x.shape[1]
    future = np.triu(np.ones((length, length), bool), k=1)
    heads = []
    for h in range(layer.num_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        scores = q[..., cols] @ np.swapaxes(k[..., cols], -1, -2) / np.sqrt(head_dim)
        scores = np.where(future, -np.inf, scores)
        heads.append(np_softmax(scores) @ v[..., cols])
    return np.concatenate(heads, -1) @ out_kernel + out_bias


def np_block(x, block):
    def norm(layer, y):
        gamma, beta = (w.numpy() for w in layer.weights)
        return np_layer_norm(y, gamma, beta)

    def feedforward(y):
        k1, b1 = (w.numpy() for w in block.feedforward_intermediate.weights)
        k2, b2 = (w.numpy() for w in block.feedforward_output.weights)
        return np_gelu_tanh(y @ k1 + b1) @ k2 + b2

    if block.norm_first:
        x = x + np_attention(norm(block.attention_norm, x), block.attention)
        return x + feedforward(norm(block.feedforward_norm, x))
    x = norm(block.attention_norm, x + np_attention(x, block.attention))
    return norm(block.feedforward_norm, x + feedforward(x))


def np_gpt(ids, model):
    token_table = model.embeddings.token_embedding.embeddings.numpy()
    position_table = model.embeddings.position_embedding.embeddings.numpy()
    x = token_table[ids] + position_table[: ids.shape[1]]
    for block in model.blocks:
        x = np_block(x, block)
    if model.norm_first:
        gamma, beta = (w.numpy() for w in model.final_norm.weights)
        x = np_layer_norm(x, gamma, beta)
    output_table = token_table.T if model.tie_embeddings else model.lm_head.kernel.numpy()
    return x @ output_table


# ---- Oracles ------------------------------------------------------------


def test_attention_matches_numpy_reference():
    layer = CausalSelfAttention(hidden_dim=HIDDEN, num_heads=HEADS)
    x = np.random.default_rng(1).normal(size=(BATCH, LENGTH, HIDDEN)).astype("float32")
    layer(x)
    # Non-zero biases so that a dropped bias would show.
    for weight in layer.weights:
        weight.assign(np.random.default_rng(2).normal(0, 0.3, weight.shape))
    np.testing.assert_allclose(layer(x).numpy(), np_attention(x, layer), atol=1e-5)


@pytest.mark.parametrize("norm_first", [True, False])
def test_block_matches_numpy_reference(norm_first):
    block = TransformerBlock(HIDDEN, HEADS, INTERMEDIATE, norm_first=norm_first)
    x = np.random.default_rng(3).normal(size=(BATCH, LENGTH, HIDDEN)).astype("float32")
    block(x)
    for index, weight in enumerate(block.weights):
        weight.assign(np.random.default_rng(index).normal(0.1, 0.3, weight.shape))
    np.testing.assert_allclose(block(x).numpy(), np_block(x, block), atol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_first": False}, {"tie_embeddings": False}],
    ids=["pre-ln-tied", "post-ln", "untied"],
)
def test_gpt_matches_numpy_reference(overrides):
    model = tiny_model(**overrides)
    ids = random_ids()
    np.testing.assert_allclose(model(ids).numpy(), np_gpt(ids, model), atol=1e-4)


@pytest.mark.parametrize("norm_first", [True, False])
def test_future_tokens_do_not_change_earlier_logits(norm_first):
    model = tiny_model(norm_first=norm_first)
    ids = random_ids()
    changed = ids.copy()
    changed[:, 3:] = (changed[:, 3:] + 1) % VOCAB
    before, after = model(ids).numpy(), model(changed).numpy()
    np.testing.assert_array_equal(before[:, :3], after[:, :3])
    # And the change is visible where it should be.
    assert np.abs(before[:, 3:] - after[:, 3:]).max() > 1e-4


def test_key_dim_is_hidden_over_heads():
    model = tiny_model()
    qkv = model.blocks[0].attention.query_key_value.kernel
    assert tuple(qkv.shape) == (HIDDEN, 3 * HIDDEN)
    assert model.blocks[0].attention.head_dim == HIDDEN // HEADS


def test_cached_decoding_matches_full_forward():
    model = tiny_model()
    ids = random_ids(length=7)
    full = model(ids).numpy()
    cache = model.empty_cache(BATCH, cache_length=16)
    # A prompt of 3 tokens, then one token at a time.
    logits, cache = model(ids[:, :3], cache=cache, cache_index=0)
    steps = [logits.numpy()]
    for index in range(3, 7):
        logits, cache = model(ids[:, index : index + 1], cache=cache, cache_index=index)
        steps.append(logits.numpy())
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


# ---- Published parameter counts -----------------------------------------

GPT2_PARAMETERS = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize(
    "preset", contract.fast_then_slow(["gpt2-small", "gpt2-medium"], ["gpt2-large", "gpt2-xl"])
)
def test_gpt2_parameter_counts(preset):
    with contract.shapes_only():
        model = GPT.from_preset(preset)
    assert model.count_params() == GPT2_PARAMETERS[preset]


# ---- The model contract --------------------------------------------------


def gpt_parameter_count(config):
    """GPT's parameters from its architecture (Radford et al. 2019).

    Embeddings (V + P) * C; per block the fused query/key/value projection
    3(C^2 + C), the output projection C^2 + C, two layer norms 4C and the
    feed-forward C*I + I + I*C + C; the final layer norm 2C (pre-LN) and
    the output projection C*V unless tied.
    """
    V, C, I = config.vocabulary_size, config.hidden_dim, config.intermediate_dim
    P, L = config.max_sequence_length, config.num_layers
    block = 3 * (C * C + C) + (C * C + C) + 4 * C + (C * I + I) + (I * C + C)
    final_norm = 2 * C if config.norm_first else 0
    output = 0 if config.tie_embeddings else C * V
    return (V + P) * C + L * block + final_norm + output


def test_parameter_formula_gives_the_published_counts():
    for preset, count in GPT2_PARAMETERS.items():
        assert gpt_parameter_count(GPTConfig.from_preset(preset)) == count


@pytest.mark.parametrize(
    "overrides",
    [{}, {"dropout": 0.1, "activation": "relu", "norm_first": False, "tie_embeddings": False}],
    ids=["defaults", "every-field-changed"],
)
def test_model_contract(tmp_path, overrides):
    config = GPTConfig(**tiny_config(layer_norm_epsilon=1e-6, **overrides))
    contract.run_model_contract(
        GPT,
        config,
        random_ids(),
        expected_shapes=(BATCH, LENGTH, VOCAB),
        tmp_path=tmp_path,
        float32_outputs=("",),
        parameter_count=gpt_parameter_count(config),
    )


def test_presets():
    contract.check_presets(FAMILIES["gpt"], unknown_field="embedding_dim")


# ---- Bad input ----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    contract.BAD_COMMON_FIELDS + [({"tie_embeddings": 1}, r"tie_embeddings=1")],
)
def test_bad_config_raises(overrides, message):
    contract.check_bad_config(GPT, tiny_config(), overrides, message)


def test_sequence_longer_than_position_table_raises():
    model = tiny_model(max_sequence_length=6)
    with pytest.raises(ValueError, match=r"sequence_length=7.*max_sequence_length=6"):
        model(random_ids(length=7))


def test_unknown_argument_raises():
    with pytest.raises(ValueError, match=r"hidden_size"):
        tiny_model(hidden_size=12)


def test_block_takes_a_known_attention():
    with pytest.raises(ValueError, match=r"`attention` must be one of.*attention='sparse'"):
        TransformerBlock(HIDDEN, HEADS, INTERMEDIATE, attention="sparse")
    with pytest.raises(ValueError, match=r"divisible.*hidden_dim=10, num_heads=4"):
        CausalSelfAttention(hidden_dim=10, num_heads=4)
