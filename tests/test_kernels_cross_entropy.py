"""The fused sparse cross-entropy against NumPy and TensorFlow's op."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.kernel_checks import (
    assert_same_loss_and_gradients,
    dtype_policy,
    fused_and_composite,
    gpt_loss_and_gradients,
    random_inputs_and_targets,
)
from tfgpt import kernels
from tfgpt.training.train_step import cross_entropy


def _numpy_cross_entropy(logits, labels):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_softmax, labels[..., None], -1)[..., 0]


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (64, 2000)])
def test_losses_and_gradients_match_numpy_and_tensorflow(shape):
    rng = np.random.default_rng(sum(shape))
    logits = rng.normal(0, 4, shape).astype("float32")
    labels = rng.integers(0, shape[-1], shape[:-1]).astype("int32")
    logits_t = tf.constant(logits)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(logits_t)
        fused = kernels.sparse_cross_entropy(labels, logits_t)
        reference = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits_t)
        weights = tf.constant(rng.normal(0, 1, shape[:-1]).astype("float32"))
        fused_sum = tf.reduce_sum(fused * weights)
        reference_sum = tf.reduce_sum(reference * weights)
    np.testing.assert_allclose(fused, _numpy_cross_entropy(logits, labels), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tape.gradient(fused_sum, logits_t),
                               tape.gradient(reference_sum, logits_t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_logits_are_read_in_their_dtype(dtype):
    rng = np.random.default_rng(0)
    logits = tf.cast(rng.normal(0, 4, (16, 300)).astype("float32"), dtype)
    labels = rng.integers(0, 300, (16,)).astype("int32")
    loss, backprop = kernels.library().tfgpt_sparse_cross_entropy(logits, labels)
    assert loss.dtype == tf.float32 and backprop.dtype == dtype
    expected = _numpy_cross_entropy(tf.cast(logits, "float32").numpy(), labels)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-5)


def test_a_traced_loss_reads_the_low_precision_logits_before_their_cast():
    rng = np.random.default_rng(1)
    low = tf.constant(rng.normal(0, 2, (4, 6, 50)).astype("float32"))
    labels = tf.constant(rng.integers(0, 50, (4, 6)).astype("int32"))

    @tf.function
    def loss_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            logits = tf.cast(tf.cast(x, "bfloat16") * 2, "float32")  # a model's float32 logits
            loss = cross_entropy(labels, logits)
        return loss, tape.gradient(loss, x)

    graph = loss_and_gradient.get_concrete_function(low).graph
    fused = [op for op in graph.get_operations() if op.type == "TfgptSparseCrossEntropy"]
    assert fused and fused[0].inputs[0].dtype == tf.bfloat16
    loss, gradient = loss_and_gradient(low)
    with kernels.disabled():
        reference_loss, reference_gradient = tf.function(loss_and_gradient.python_function)(low)
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)
    np.testing.assert_allclose(gradient, reference_gradient, rtol=1e-2, atol=1e-4)


def test_out_of_range_labels_and_bad_shapes_raise():
    library = kernels.library()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"label 5 at row 1 is outside .*\[0, 5\)"):
        library.tfgpt_sparse_cross_entropy(tf.zeros([2, 5]), tf.constant([0, 5]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        library.tfgpt_sparse_cross_entropy(tf.zeros([2, 5]), tf.constant([-1, 0]))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        library.tfgpt_sparse_cross_entropy(tf.zeros([2, 5]), tf.constant([0, 1, 2]))


def test_gpt_step_under_mixed_bfloat16_equals_the_composite_loss():
    from tfgpt import GPT

    with dtype_policy("mixed_bfloat16"):
        keras.utils.set_random_seed(5)
        model = GPT(vocabulary_size=60, num_layers=1, num_heads=2, hidden_dim=16,
                    intermediate_dim=32, max_sequence_length=8)
        inputs, targets = random_inputs_and_targets(np.random.default_rng(3), 60, (2, 8))
        fused, reference = fused_and_composite(
            model, gpt_loss_and_gradients(model, inputs, targets))
    assert_same_loss_and_gradients(model, fused, reference, dict(rtol=1e-3),
                                   dict(rtol=0.05, atol=2e-3))
