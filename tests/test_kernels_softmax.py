"""The fused causal softmax against NumPy, TensorFlow's autodiff and the
composite path, alone and inside GPT.

Oracles: a float64 NumPy masked softmax for the forward values, TensorFlow's
autodiff of the composite ops (cast, bias, `tf.nn.softmax`, cast) for the
gradients, and a GPT traced with `kernels.disabled()` for the model level;
with packed examples' segment ids the same, masked block-diagonally, and a
row of one segment equal to the unsegmented kernel bit for bit.
"""

import contextlib

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
from tfgpt.kernels.causal_softmax_kernel import causal_bias, causal_softmax

FUSED_OPS = {"TfgptCausalSoftmax", "TfgptCausalSoftmaxGrad"}


def _numpy_causal_softmax(scores, segment_ids=None):
    scores = np.asarray(scores, dtype=np.float64)
    queries, keys = scores.shape[-2:]
    visible = np.arange(keys)[None, :] <= np.arange(queries)[:, None] + (keys - queries)
    if segment_ids is not None:  # (B, S): block-diagonal, broadcast over (B, ..., T, S)
        segment_ids = np.asarray(segment_ids)
        same = segment_ids[:, keys - queries:, None] == segment_ids[:, None, :]  # (B, T, S)
        visible = (visible & same).reshape(
            (len(segment_ids),) + (1,) * (scores.ndim - 3) + (queries, keys))
    shifted = np.where(visible, scores, -np.inf)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    exponentials = np.where(visible, np.exp(shifted), 0.0)
    return exponentials / exponentials.sum(axis=-1, keepdims=True), visible


def _composite(scores, segment_ids=None):
    with kernels.disabled():
        return causal_softmax(scores, segment_ids)


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (7, 7), (3, 33, 33), (2, 256, 256), (2, 3, 5, 9), (1, 7, 40), (33, 34)],
)
def test_forward_matches_numpy_and_masks_exactly(shape):
    scores = np.random.default_rng(0).normal(0, 3, shape).astype("float32")
    expected, visible = _numpy_causal_softmax(scores)
    probabilities = kernels.library().tfgpt_causal_softmax(scores, []).numpy()
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-7)
    assert np.all(probabilities[..., ~visible] == 0.0)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, rtol=1e-6)


def test_large_scores_do_not_overflow():
    scores = np.array([[1e4, -1e4, 3e4], [-3e4, 5e4, 7.0], [0.0, 8e4, 8e4]], "float32")
    probabilities = kernels.library().tfgpt_causal_softmax(scores, []).numpy()
    np.testing.assert_array_equal(probabilities, [[1, 0, 0], [0, 1, 0], [0, 0.5, 0.5]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_rounds_the_float32_result_once(dtype):
    rng = np.random.default_rng(1)
    scores = tf.cast(rng.normal(0, 3, (2, 3, 33, 41)).astype("float32"), dtype)
    probabilities = kernels.library().tfgpt_causal_softmax(scores, [])
    assert probabilities.dtype == dtype
    expected, visible = _numpy_causal_softmax(tf.cast(scores, "float32").numpy())
    expected = tf.cast(tf.constant(expected, "float32"), dtype)
    # Float32 math on the rounded scores, then one rounding: at most one ulp.
    np.testing.assert_allclose(tf.cast(probabilities, "float32"), tf.cast(expected, "float32"),
                               rtol=8e-3 if dtype == "bfloat16" else 1e-3, atol=1e-6)
    assert np.all(tf.cast(probabilities, "float32").numpy()[..., ~visible] == 0.0)
    # The composite path rounds the same float32 softmax once as well.
    np.testing.assert_allclose(tf.cast(probabilities, "float32"),
                               tf.cast(_composite(scores), "float32"),
                               rtol=8e-3 if dtype == "bfloat16" else 1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (5, 9), (1, 1), (2, 33, 33)])
def test_gradient_matches_autodiff_of_the_composite_path(shape, dtype):
    rng = np.random.default_rng(2)
    scores = tf.cast(rng.normal(0, 2, shape).astype("float32"), dtype)
    upstream = tf.cast(rng.normal(0, 1, shape).astype("float32"), dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(scores)
        fused = causal_softmax(scores)
        composite = _composite(scores)
    assert FUSED_OPS <= traced_op_types(
        lambda s: tf.gradients(causal_softmax(s), s, upstream)[0], scores
    )
    fused_gradient = tf.cast(tape.gradient(fused, scores, upstream), "float32").numpy()
    composite_gradient = tf.cast(tape.gradient(composite, scores, upstream), "float32")
    if dtype == "float32":
        tolerance = dict(rtol=1e-5, atol=1e-6)
    else:
        # The fused gradient reads the rounded probabilities, the composite
        # one its float32 softmax: both carry one rounding of the output.
        tolerance = dict(rtol=0.05, atol=2e-2 if dtype == "bfloat16" else 3e-3)
    np.testing.assert_allclose(fused_gradient, composite_gradient, **tolerance)
    _, visible = _numpy_causal_softmax(np.zeros(shape))
    assert np.all(fused_gradient[..., ~visible] == 0.0)


def test_gradient_ignores_upstream_values_at_masked_positions():
    # The composite path's masked probabilities are 0, so their upstream
    # gradient cannot reach the scores; the fused kernel must agree.
    scores = tf.constant(np.random.default_rng(3).normal(0, 1, (5, 5)).astype("float32"))
    upstream = np.ones((5, 5), "float32")
    _, visible = _numpy_causal_softmax(upstream)
    noisy = np.where(visible, upstream, 1e6).astype("float32")
    probabilities = kernels.library().tfgpt_causal_softmax(scores, [])
    library = kernels.library()
    np.testing.assert_array_equal(library.tfgpt_causal_softmax_grad(noisy, probabilities, []),
                                  library.tfgpt_causal_softmax_grad(upstream, probabilities, []))


def test_bad_shapes_are_rejected_with_a_reason():
    library = kernels.library()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="S >= T"):
        library.tfgpt_causal_softmax(tf.ones([5, 4]), [])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank"):
        library.tfgpt_causal_softmax(tf.ones([5]), [])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="same shape|Dimension"):
        library.tfgpt_causal_softmax_grad(tf.ones([2, 3, 3]), tf.ones([3, 3, 3]), [])
    assert library.tfgpt_causal_softmax(tf.ones([4, 0, 3]), []).shape == (4, 0, 3)
    for context in (contextlib.nullcontext(), kernels.disabled()):
        with context:
            with pytest.raises(ValueError, match=r"S >= T. Received: scores.shape=\(2, 5, 4\)"):
                causal_softmax(tf.ones([2, 5, 4]))
            with pytest.raises(ValueError, match=r"rank >= 2 .* Received: scores.shape=\(5,\)"):
                causal_softmax(tf.ones([5]))


def test_causal_bias_constant_and_dynamic_agree():
    constant = causal_bias(3, 5)
    dynamic = tf.function(lambda t, s: causal_bias(t, s))(tf.constant(3), tf.constant(5))
    np.testing.assert_array_equal(constant, dynamic)
    _, visible = _numpy_causal_softmax(np.zeros((3, 5)))
    np.testing.assert_array_equal(constant.numpy() == 0.0, visible)


def test_xla_disabled_and_environment_take_the_composite_ops(monkeypatch):
    scores = tf.ones([2, 4, 4])
    assert "TfgptCausalSoftmax" in traced_op_types(causal_softmax, scores)
    assert "TfgptCausalSoftmax" not in traced_op_types(causal_softmax, scores, jit_compile=True)
    with kernels.disabled():
        types = traced_op_types(causal_softmax, scores)
    assert "TfgptCausalSoftmax" not in types and "Softmax" in types
    # An unknown length at trace time builds the bias from the runtime shape.
    unknown = tf.TensorSpec([None, None, None], "float32")
    with kernels.disabled():
        composite = tf.function(causal_softmax).get_concrete_function(unknown)
    np.testing.assert_allclose(composite(tf.zeros([1, 2, 3])), [[[0.5, 0.5, 0], [1 / 3] * 3]],
                               rtol=1e-6)
    monkeypatch.setenv("TFGPT_FUSED_KERNELS", "0")
    assert "TfgptCausalSoftmax" not in traced_op_types(causal_softmax, scores)


# ---- Packed examples: segment ids --------------------------------------------

# (scores' shape (B, ..., T, S), segment ids (B, S)): several segments, ones of
# length 1, padding's 0, a query block after a cache prefix (S > T), a row of
# one segment beside a packed one, and an id that comes back after another's.
SEGMENTED = {
    "several, one of length 1": ((2, 3, 9, 9), [[1, 1, 1, 2, 3, 3, 3, 4, 0],
                                                [5, 5, 5, 5, 5, 5, 5, 5, 5]]),
    "after a prefix": ((2, 4, 7), [[1, 1, 2, 2, 2, 2, 3], [1, 2, 2, 2, 2, 2, 2]]),
    "rank 5": ((1, 2, 3, 6, 6), [[1, 2, 2, 3, 3, 3]]),
    "an id that comes back": ((1, 2, 8, 8), [[1, 1, 2, 2, 1, 1, 1, 2]]),
    "long rows": ((2, 2, 70, 70), [[1] * 30 + [2] + [3] * 36 + [0] * 3, [1] * 70]),
}


@pytest.mark.parametrize("shape, segment_ids", SEGMENTED.values(), ids=SEGMENTED.keys())
def test_segmented_forward_matches_numpy_and_masks_exactly(shape, segment_ids):
    scores = np.random.default_rng(0).normal(0, 3, shape).astype("float32")
    expected, visible = _numpy_causal_softmax(scores, segment_ids)
    segments = tf.constant(segment_ids, "int32")
    probabilities = kernels.library().tfgpt_causal_softmax(scores, [segments]).numpy()
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-7)
    assert np.all(probabilities[~np.broadcast_to(visible, shape)] == 0.0)
    np.testing.assert_allclose(causal_softmax(scores, segments), probabilities, rtol=0, atol=0)
    np.testing.assert_allclose(_composite(scores, segments), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape, segment_ids", SEGMENTED.values(), ids=SEGMENTED.keys())
def test_segmented_gradient_matches_autodiff_of_the_composite_path(shape, segment_ids, dtype):
    rng = np.random.default_rng(2)
    scores = tf.cast(rng.normal(0, 2, shape).astype("float32"), dtype)
    upstream = tf.cast(rng.normal(0, 1, shape).astype("float32"), dtype)
    segments = tf.constant(segment_ids, "int32")
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(scores)
        fused = causal_softmax(scores, segments)
        composite = _composite(scores, segments)
    assert FUSED_OPS <= traced_op_types(
        lambda s: tf.gradients(causal_softmax(s, segments), s, upstream)[0], scores
    )
    fused_gradient = tf.cast(tape.gradient(fused, scores, upstream), "float32").numpy()
    composite_gradient = tf.cast(tape.gradient(composite, scores, upstream), "float32")
    if dtype == "float32":
        tolerances = (dict(rtol=1e-5, atol=1e-7), dict(rtol=1e-5, atol=1e-6))
    else:  # one rounding of the output each, as test_gradient_matches_autodiff_...
        atol = 2e-2 if dtype == "bfloat16" else 3e-3
        tolerances = (dict(rtol=8e-3 if dtype == "bfloat16" else 1e-3, atol=1e-6),
                      dict(rtol=0.05, atol=atol))
    np.testing.assert_allclose(tf.cast(fused, "float32"), tf.cast(composite, "float32"),
                               **tolerances[0])
    np.testing.assert_allclose(fused_gradient, composite_gradient, **tolerances[1])
    _, visible = _numpy_causal_softmax(np.zeros(shape), segment_ids)
    assert np.all(fused_gradient[~np.broadcast_to(visible, shape)] == 0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rows_of_one_segment_equal_the_unsegmented_kernel_bit_for_bit(dtype):
    rng = np.random.default_rng(4)
    scores = tf.cast(rng.normal(0, 3, (3, 2, 33, 40)).astype("float32"), dtype)
    upstream = tf.cast(rng.normal(0, 1, (3, 2, 33, 40)).astype("float32"), dtype)
    one_segment = tf.constant([[1] * 40, [0] * 40, [9] * 40], "int32")
    library = kernels.library()
    for segments in ([one_segment], []):
        probabilities = library.tfgpt_causal_softmax(scores, segments)
        gradient = library.tfgpt_causal_softmax_grad(upstream, probabilities, segments)
        if segments:
            segmented = (probabilities.numpy(), gradient.numpy())
    np.testing.assert_array_equal(segmented[0], probabilities)
    np.testing.assert_array_equal(segmented[1], gradient)


def test_bad_segment_ids_are_rejected_with_a_reason():
    library = kernels.library()
    segments = tf.ones([2, 4], "int32")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank >= 3"):
        library.tfgpt_causal_softmax(tf.ones([4, 4]), [segments])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="segment_ids must be|Dimension"):
        library.tfgpt_causal_softmax(tf.ones([2, 3, 4, 5]), [segments])
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_ids must be"):
        library.tfgpt_causal_softmax_grad(tf.ones([2, 4, 4]), tf.ones([2, 4, 4]),
                                          [tf.ones([3, 4], "int32")])
    for context in (contextlib.nullcontext(), kernels.disabled()):
        with context:
            with pytest.raises(ValueError, match=r"known rank >= 3 .* Received: scores.shape="):
                causal_softmax(tf.ones([4, 4]), segments)


# ---- Inside GPT -------------------------------------------------------------


def _gpt(dropout=0.0, **overrides):
    from tfgpt import GPT

    keras.utils.set_random_seed(4)
    return GPT(vocabulary_size=50, num_layers=3, num_heads=2, hidden_dim=16,
               intermediate_dim=40, max_sequence_length=12, dropout=dropout, **overrides)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gpt_loss_and_gradients_equal_the_composite_path(policy, dropout):
    with dtype_policy(policy):
        model = _gpt(dropout)
        inputs, targets = random_inputs_and_targets(np.random.default_rng(5), 50, (2, 11))
        # With dropout, both paths draw the same masks (fused_and_composite).
        fused, composite = fused_and_composite(
            model, gpt_loss_and_gradients(model, inputs, targets))
    if policy == "float32" and dropout == 0.0:
        # The whole attention core is one kernel (tests/test_kernels_attention.py).
        assert {"TfgptCausalAttention", "TfgptCausalAttentionGrad"} <= fused[2]
    else:
        assert FUSED_OPS <= fused[2]
    assert not FUSED_OPS & composite[2]
    tolerance = dict(rtol=1e-4, atol=1e-6) if policy == "float32" else dict(rtol=0.05, atol=3e-3)
    assert_same_loss_and_gradients(model, fused, composite, tolerance)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_gpt_on_packed_rows_equals_the_composite_path(policy):
    from tfgpt.training.train_step import cross_entropy

    with dtype_policy(policy):
        # Rotary grouped-query attention (float32) and any attention under
        # mixed precision take the fused softmax.
        model = _gpt(positions="rotary", num_key_value_heads=1)
        inputs, targets = random_inputs_and_targets(np.random.default_rng(5), 50, (2, 11))
        segment_ids = tf.constant([[1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0], [1] * 11])

        def loss():
            return cross_entropy(targets, model(inputs, segment_ids=segment_ids, training=True))

        fused, composite = fused_and_composite(model, loss_and_gradients(model, loss))
    assert FUSED_OPS <= fused[2]
    assert not FUSED_OPS & composite[2]
    tolerance = dict(rtol=1e-4, atol=1e-6) if policy == "float32" else dict(rtol=0.05, atol=3e-3)
    assert_same_loss_and_gradients(model, fused, composite, tolerance)


def test_cached_generation_and_the_forward_pass_are_unchanged():
    model = _gpt()
    for weight in model.weights:  # spread the logits so greedy tokens vary
        if len(weight.shape) == 2:
            weight.assign(np.random.default_rng(6).normal(0, 0.5, weight.shape))
    prompts = [[1, 2, 3], [4, 5]]
    fused = model.generate(prompts, 6)
    with kernels.disabled():
        composite = model.generate(prompts, 6)
    assert fused == composite
    # The full forward pass (fused) and the composite one give the same logits.
    tokens = tf.constant([[1, 2, 3, 4, 5, 6, 7]])
    with kernels.disabled():
        reference = model(tokens)
    np.testing.assert_allclose(model(tokens), reference, rtol=1e-5, atol=1e-5)
