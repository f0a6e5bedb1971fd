"""The fused causal attention kernel against NumPy, TensorFlow's autodiff of
the attention layer's own ops, and inside the layer and GPT.

Oracles: a float64 NumPy causal attention for the output and for the packed
weights, TensorFlow's autodiff of the composite path (transpose, batched
matmuls, masked softmax) for the gradient, and the layer traced with
`kernels.disabled()`; with packed examples' segment ids the same, masked
block-diagonally, and a row of one segment equal to the unsegmented kernel
bit for bit.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.kernel_checks import (
    assert_same_loss_and_gradients,
    dtype_policy,
    fused_and_composite,
    gpt_loss_and_gradients,
    loss_and_gradients,
    random_inputs_and_targets,
    traced_op_types,
)
from tfgpt import kernels
from tfgpt.kernels.causal_attention_kernel import (
    BLOCK_SIZE,
    causal_attention,
    causal_attention_available,
)

FUSED_OPS = {"TfgptCausalAttention", "TfgptCausalAttentionGrad"}


def _split_heads(qkv, heads):
    batch, length, width = qkv.shape
    channels = width // 3
    x = np.asarray(qkv, np.float64).reshape(batch, length, 3, heads, channels // heads)
    return x.transpose(2, 0, 3, 1, 4)  # (3, B, H, T, D)


def _visible(length, segment_ids=None):
    """(T, T) or with `segment_ids` (B, T) the (B, 1, T, T) causal mask,
    block-diagonal by segment."""
    visible = np.tril(np.ones((length, length), bool))
    if segment_ids is None:
        return visible
    segment_ids = np.asarray(segment_ids)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    return (visible & same)[:, None]  # (B, 1, T, T)


def _numpy_attention(qkv, heads, segment_ids=None):
    """(output (B, T, C), weights (B, H, T, T)) in float64."""
    query, key, value = _split_heads(qkv, heads)
    batch, _, length, depth = query.shape
    scores = query @ key.transpose(0, 1, 3, 2) / math.sqrt(depth)
    visible = _visible(length, segment_ids)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    output = (weights @ value).transpose(0, 2, 1, 3).reshape(batch, length, heads * depth)
    return output, weights


def _unpack(packed, length, block):
    """The packed block-lower weights (B, H, L) as (B, H, T, T)."""
    batch, heads, _ = packed.shape
    full = np.zeros((batch, heads, length, length), packed.dtype)
    offset = 0
    for start in range(0, length, block):
        end = min(length, start + block)
        size = (end - start) * end
        full[:, :, start:end, :end] = packed[:, :, offset:offset + size].reshape(
            batch, heads, end - start, end)
        offset += size
    assert offset == packed.shape[-1]
    return full


def _composite(qkv, heads, segment_ids=None):
    """The attention layer's TensorFlow path, as autodiff sees it."""
    batch, length, width = qkv.shape
    depth = width // 3 // heads
    x = tf.transpose(tf.reshape(qkv, [batch, length, 3, heads, depth]), [2, 0, 3, 1, 4])
    query, key, value = tf.unstack(x, 3)
    scores = tf.matmul(query, key, transpose_b=True) / math.sqrt(depth)
    mask = tf.constant(np.where(_visible(length, segment_ids), 0.0, -1e9), "float32")
    weights = tf.nn.softmax(scores + mask, axis=-1)
    output = tf.transpose(tf.matmul(weights, value), [0, 2, 1, 3])
    return tf.reshape(output, [batch, length, width // 3])


def _qkv(shape, seed=0, scale=1.0):
    return tf.constant(np.random.default_rng(seed).normal(0, scale, shape).astype("float32"))


@pytest.mark.parametrize(
    "batch, length, heads, depth, block",
    [(2, 1, 1, 4, 64), (2, 5, 3, 4, 64), (1, 64, 2, 8, 64), (2, 65, 2, 8, 64),
     (1, 130, 2, 16, 64), (2, 33, 3, 5, 7), (1, 9, 2, 4, 1), (1, 40, 2, 8, 256)],
)
def test_forward_and_packed_weights_match_numpy(batch, length, heads, depth, block):
    qkv = _qkv((batch, length, 3 * heads * depth), seed=length, scale=2.0)
    output, packed = kernels.library().tfgpt_causal_attention(
        qkv, [], num_heads=heads, block_size=block)
    expected_output, expected_weights = _numpy_attention(qkv.numpy(), heads)
    assert output.shape == (batch, length, heads * depth)
    np.testing.assert_allclose(output, expected_output, rtol=1e-5, atol=1e-5)
    weights = _unpack(packed.numpy(), length, block)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-7)
    # Masked weights are exactly zero, also inside a block.
    assert np.all(weights[..., ~np.tril(np.ones((length, length), bool))] == 0.0)


@pytest.mark.parametrize(
    "batch, length, heads, depth, block",
    [(2, 5, 3, 4, 64), (2, 65, 2, 8, 64), (1, 130, 2, 16, 64), (2, 33, 3, 5, 7),
     (1, 9, 2, 4, 1), (1, 40, 2, 8, 256)],
)
def test_gradient_matches_autodiff_of_the_composite_path(batch, length, heads, depth, block):
    qkv = _qkv((batch, length, 3 * heads * depth), seed=length + 1)
    upstream = _qkv((batch, length, heads * depth), seed=length + 2)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(qkv)
        fused, _ = kernels.library().tfgpt_causal_attention(
            qkv, [], num_heads=heads, block_size=block)
        composite = _composite(qkv, heads)
    assert not FUSED_OPS & traced_op_types(_composite, qkv, heads)
    np.testing.assert_allclose(fused, composite, rtol=1e-5, atol=1e-5)
    fused_gradient = tape.gradient(fused, qkv, upstream)
    composite_gradient = tape.gradient(composite, qkv, upstream)
    np.testing.assert_allclose(fused_gradient, composite_gradient, rtol=1e-4, atol=1e-5)


def test_block_size_does_not_change_the_result_and_runs_are_identical():
    qkv = _qkv((2, 150, 3 * 2 * 8), seed=7)
    upstream = _qkv((2, 150, 16), seed=8)
    library = kernels.library()

    def run(block):
        with tf.GradientTape() as tape:
            tape.watch(qkv)
            output, _ = library.tfgpt_causal_attention(qkv, [], num_heads=2, block_size=block)
        return output.numpy(), tape.gradient(output, qkv, upstream).numpy()

    reference = run(BLOCK_SIZE)
    for block in (1, 16, 100, 150, 512):
        for got, want in zip(run(block), reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # One (batch, head) per unit in a fixed order: bit-for-bit repeatable.
    for got, want in zip(run(BLOCK_SIZE), reference):
        np.testing.assert_array_equal(got, want)


def test_large_scores_do_not_overflow():
    qkv = _qkv((1, 70, 3 * 8), seed=9, scale=30.0)  # scores up to ~1e4
    output, packed = kernels.library().tfgpt_causal_attention(qkv, [], num_heads=1)
    expected, weights = _numpy_attention(qkv.numpy(), 1)
    assert np.all(np.isfinite(output))
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(_unpack(packed.numpy(), 70, 64), weights, atol=1e-5)


def test_bad_input_is_rejected_with_a_reason():
    library = kernels.library()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="divisible|rank"):
        library.tfgpt_causal_attention(tf.ones([1, 4, 20]), [], num_heads=3)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank"):
        library.tfgpt_causal_attention(tf.ones([4, 12]), [], num_heads=2)
    output, packed = library.tfgpt_causal_attention(tf.ones([1, 4, 12]), [], num_heads=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must be"):
        library.tfgpt_causal_attention_grad(output, tf.ones([1, 4, 12]), packed, [],
                                            num_heads=2, block_size=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="doutput must be"):
        library.tfgpt_causal_attention_grad(tf.ones([1, 4, 6]), tf.ones([1, 4, 12]), packed,
                                            [], num_heads=2)
    empty, _ = library.tfgpt_causal_attention(tf.ones([0, 5, 12]), [], num_heads=2)
    assert empty.shape == (0, 5, 4)
    with pytest.raises(RuntimeError, match="float32 only"):
        causal_attention(tf.ones([1, 4, 12], "bfloat16"), num_heads=2)
    with kernels.disabled():
        assert not causal_attention_available("float32")
        with pytest.raises(RuntimeError, match="cannot run"):
            causal_attention(tf.ones([1, 4, 12]), num_heads=2)


# ---- Packed examples: segment ids --------------------------------------------


def _segments(*rows):
    """(B, T) int32 segment ids from each row's segment lengths: [3, 1, 2]
    -> [1, 1, 1, 2, 3, 3]; a length given as (id, n) takes that id."""
    ids = []
    for lengths in rows:
        row = []
        for number, length in enumerate(lengths, 1):
            segment, length = length if isinstance(length, tuple) else (number, length)
            row += [segment] * length
        ids.append(row)
    return tf.constant(ids, "int32")


# (segment lengths per row, heads, depth, block): several segments per row, a
# segment of length 1 (first, inside, last), padding's segment 0 at the end,
# segments crossing query blocks, one row of a single segment beside packed
# ones, and an id that comes back after another's (masked key by key).
SEGMENTED = {
    "several, one of length 1": ([[3, 1, 4, 1, 1, (0, 2)], [12]], 3, 4, 64),
    "crossing blocks": ([[5, 9, 1, 14, 4], [1, 32], [20, 13]], 2, 5, 7),
    "two blocks of 64": ([[40, 50, 1, 39], [130]], 2, 8, 64),
    "one key per block": ([[2, 3, 1, 3]], 2, 4, 1),
    "an id that comes back": ([[2, (2, 3), (1, 4), (2, 1), (0, 2)]], 2, 4, 4),
}


@pytest.mark.parametrize("rows, heads, depth, block", SEGMENTED.values(), ids=SEGMENTED.keys())
def test_segmented_forward_and_gradient_match_numpy_and_the_masked_composite_path(
        rows, heads, depth, block):
    segment_ids = _segments(*rows)
    batch, length = segment_ids.shape
    qkv = _qkv((batch, length, 3 * heads * depth), seed=length, scale=2.0)
    upstream = _qkv((batch, length, heads * depth), seed=length + 1)
    library = kernels.library()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(qkv)
        fused, packed = library.tfgpt_causal_attention(
            qkv, [segment_ids], num_heads=heads, block_size=block)
        composite = _composite(qkv, heads, segment_ids.numpy())
    expected_output, expected_weights = _numpy_attention(qkv.numpy(), heads, segment_ids.numpy())
    np.testing.assert_allclose(fused, expected_output, rtol=1e-5, atol=1e-5)
    weights = _unpack(packed.numpy(), length, block)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-7)
    # Masked weights are exactly zero: other segments' keys and later keys.
    hidden = ~np.broadcast_to(_visible(length, segment_ids.numpy()), weights.shape)
    assert np.all(weights[hidden] == 0.0)
    np.testing.assert_allclose(fused, composite, rtol=1e-5, atol=1e-5)
    fused_gradient = tape.gradient(fused, qkv, upstream)
    composite_gradient = tape.gradient(composite, qkv, upstream)
    np.testing.assert_allclose(fused_gradient, composite_gradient, rtol=1e-4, atol=1e-5)
    # Through the Python entry point (BLOCK_SIZE) and its registered gradient as well.
    with tf.GradientTape() as tape:
        tape.watch(qkv)
        output = causal_attention(qkv, heads, segment_ids)
    np.testing.assert_allclose(output, composite, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tape.gradient(output, qkv, upstream), composite_gradient,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [BLOCK_SIZE, 7])
def test_rows_of_one_segment_equal_the_unsegmented_kernel_bit_for_bit(block):
    qkv = _qkv((3, 70, 3 * 2 * 8), seed=11)
    upstream = _qkv((3, 70, 16), seed=12)
    library = kernels.library()

    def run(segments):
        with tf.GradientTape() as tape:
            tape.watch(qkv)
            output, packed = library.tfgpt_causal_attention(
                qkv, segments, num_heads=2, block_size=block)
        return output.numpy(), packed.numpy(), tape.gradient(output, qkv, upstream).numpy()

    one_segment = tf.constant([[1] * 70, [0] * 70, [7] * 70], "int32")
    for got, want in zip(run([one_segment]), run([])):
        np.testing.assert_array_equal(got, want)


def test_bad_segment_ids_are_rejected_with_a_reason():
    library = kernels.library()
    qkv = tf.ones([2, 4, 12])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="segment_ids|Dimension"):
        library.tfgpt_causal_attention(qkv, [tf.ones([2, 5], "int32")], num_heads=2)
    output, packed = library.tfgpt_causal_attention(qkv, [], num_heads=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_ids must be"):
        tf.function(lambda ids: library.tfgpt_causal_attention_grad(
            output, qkv, packed, [ids], num_heads=2))(tf.ones([1, 4], "int32"))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="at most one"):
        library.tfgpt_causal_attention(qkv, [tf.ones([2, 4], "int32")] * 2, num_heads=2)


# ---- Inside the layer and GPT -----------------------------------------------


def test_layer_takes_the_kernel_only_where_it_applies():
    from tfgpt.layers.causal_self_attention import CausalSelfAttention

    inputs = tf.ones([2, 6, 16])
    layer = CausalSelfAttention(hidden_dim=16, num_heads=2, dropout=0.1)
    assert "TfgptCausalAttention" in traced_op_types(layer, inputs)  # inference
    assert "TfgptCausalAttention" not in traced_op_types(layer, inputs, training=True)  # dropout
    assert "TfgptCausalAttention" not in traced_op_types(
        layer, inputs, padding_mask=tf.ones([2, 6], "int32"))
    segment_ids = tf.constant([[1, 1, 2, 2, 2, 0], [1] * 6])  # packed examples
    assert "TfgptCausalAttention" in traced_op_types(layer, inputs, segment_ids=segment_ids)
    cache = tf.zeros([2, 2, 2, 6, 8])  # decoding a packed row: the plain ops
    assert "TfgptCausalAttention" not in traced_op_types(
        layer, inputs[:, :1], cache=cache, segment_ids=segment_ids)
    assert "TfgptCausalAttention" not in traced_op_types(layer, inputs, jit_compile=True)
    with kernels.disabled():
        assert "TfgptCausalAttention" not in traced_op_types(layer, inputs)
    with dtype_policy("mixed_bfloat16"):
        bfloat16 = CausalSelfAttention(hidden_dim=16, num_heads=2)
        assert "TfgptCausalAttention" not in traced_op_types(bfloat16, inputs, training=True)


def test_gpt_loss_gradients_and_generation_equal_the_composite_path():
    from tfgpt import GPT

    keras.utils.set_random_seed(4)
    # 70 positions: two query blocks, the second one partial.
    model = GPT(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=40, max_sequence_length=80)
    rng = np.random.default_rng(5)
    inputs, targets = random_inputs_and_targets(rng, 50, (2, 70))

    fused, composite = fused_and_composite(model, gpt_loss_and_gradients(model, inputs, targets))
    assert FUSED_OPS <= fused[2]
    assert not FUSED_OPS & composite[2]
    assert_same_loss_and_gradients(model, fused, composite, dict(rtol=1e-5),
                                   dict(rtol=1e-4, atol=1e-6))
    # Generation: the prompt pass is fused, the cached steps are not.
    for weight in model.weights:  # spread the logits so greedy tokens vary
        if len(weight.shape) == 2:
            weight.assign(rng.normal(0, 0.5, weight.shape))
    prompts = [[1, 2, 3], [4, 5]]
    fused_tokens = model.generate(prompts, 6)
    with kernels.disabled():
        assert model.generate(prompts, 6) == fused_tokens


def test_gpt_on_packed_rows_equals_the_composite_path():
    from tfgpt import GPT
    from tfgpt.training.train_step import cross_entropy

    keras.utils.set_random_seed(6)
    model = GPT(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=40, max_sequence_length=80)
    inputs, targets = random_inputs_and_targets(np.random.default_rng(7), 50, (2, 70))
    # Row 0: examples crossing the query blocks, one of a single token, then
    # padding; row 1: one example.
    segment_ids = _segments([30, 1, 36, (0, 3)], [70])

    def loss():
        return cross_entropy(targets, model(inputs, segment_ids=segment_ids, training=True))

    fused, composite = fused_and_composite(model, loss_and_gradients(model, loss))
    assert FUSED_OPS <= fused[2]
    assert not FUSED_OPS & composite[2]
    assert_same_loss_and_gradients(model, fused, composite, dict(rtol=1e-5),
                                   dict(rtol=1e-4, atol=1e-6))
