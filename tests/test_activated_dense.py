"""ActivatedDense and the fused bias + GELU kernel against Keras' Dense and NumPy."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfgpt import kernels
from tfgpt.layers.activated_dense import ActivatedDense

KERAS_ACTIVATIONS = {
    "gelu": lambda x: keras.activations.gelu(x, approximate=False),
    "gelu_tanh": lambda x: keras.activations.gelu(x, approximate=True),
    "relu": keras.activations.relu,
    None: None,
}


def _numpy_gelu(x, approximate):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 33), (1, 1), (70, 1536)])
@pytest.mark.parametrize("approximate", [True, False])
def test_bias_gelu_forward_and_bias_gradient_match_numpy(shape, approximate):
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(0, 2, shape).astype("float32")
    bias = rng.normal(0, 1, shape[-1:]).astype("float32")
    upstream = rng.normal(0, 1, shape).astype("float32")
    library = kernels.library()
    out = library.tfgpt_bias_gelu(x, bias, approximate=approximate)
    expected = _numpy_gelu((x + bias).astype(np.float64), approximate)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)
    # Gradients against TensorFlow's autodiff of the composite ops.
    x_t, bias_t = tf.constant(x), tf.constant(bias)
    with tf.GradientTape() as tape:
        tape.watch([x_t, bias_t])
        composite = tf.nn.gelu(x_t + bias_t, approximate=approximate)
    dx_expected, dbias_expected = tape.gradient(composite, [x_t, bias_t], upstream)
    dx, dbias = library.tfgpt_bias_gelu_grad(upstream, x, bias, approximate=approximate)
    np.testing.assert_allclose(dx, dx_expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbias, dbias_expected, rtol=1e-4, atol=1e-3)


def test_bias_gradient_is_deterministic_and_errors_are_clear():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(0, 2, (999, 257)).astype("float32"))
    bias = tf.constant(rng.normal(0, 1, (257,)).astype("float32"))
    upstream = tf.constant(rng.normal(0, 1, (999, 257)).astype("float32"))
    library = kernels.library()
    first = library.tfgpt_bias_gelu_grad(upstream, x, bias)[1].numpy()
    for _ in range(5):
        np.testing.assert_array_equal(library.tfgpt_bias_gelu_grad(upstream, x, bias)[1], first)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="bias must be a vector"):
        library.tfgpt_bias_gelu(x, tf.ones([256]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bias_gelu_low_precision(dtype):
    rng = np.random.default_rng(1)
    x = tf.cast(rng.normal(0, 2, (64, 48)).astype("float32"), dtype)
    bias = tf.cast(rng.normal(0, 1, (48,)).astype("float32"), dtype)
    out = kernels.library().tfgpt_bias_gelu(x, bias)
    assert out.dtype == dtype
    exact = _numpy_gelu(tf.cast(x, "float32").numpy() + tf.cast(bias, "float32").numpy(), True)
    np.testing.assert_allclose(tf.cast(out, "float32"), exact,
                               rtol=1e-2 if dtype == "bfloat16" else 2e-3, atol=2e-3)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", None])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_activated_dense_equals_keras_dense(activation, policy):
    keras.config.set_dtype_policy(policy)
    try:
        ours = ActivatedDense(24, activation=activation, name="dense")
        reference = keras.layers.Dense(24, activation=KERAS_ACTIVATIONS[activation], name="dense")
        inputs = tf.constant(np.random.default_rng(2).normal(0, 1, (2, 5, 16)).astype("float32"))
        ours.build(inputs.shape)
        reference.build(inputs.shape)
        assert [w.path for w in ours.weights] == [w.path for w in reference.weights]
        for mine, theirs in zip(ours.weights, reference.weights):
            theirs.assign(np.random.default_rng(3).normal(0, 0.5, mine.shape))
            mine.assign(theirs)

        def outputs_and_gradients(layer):
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                outputs = layer(inputs)
                loss = tf.reduce_sum(tf.cast(outputs, "float32") ** 2)
            return outputs, tape.gradient(loss, [inputs] + [w.value for w in layer.weights])

        mine, theirs = outputs_and_gradients(ours), outputs_and_gradients(reference)
        assert mine[0].dtype == theirs[0].dtype
    finally:
        keras.config.set_dtype_policy("float32")
    tolerance = dict(rtol=1e-5, atol=1e-5) if policy == "float32" else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(tf.cast(mine[0], "float32"), tf.cast(theirs[0], "float32"), **tolerance)
    for a, b in zip(mine[1], theirs[1]):
        scale = max(1.0, float(tf.reduce_max(tf.abs(b))))
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, **tolerance)


def test_activated_dense_takes_the_fused_op_and_round_trips_its_config():
    layer = ActivatedDense(8, activation="gelu_tanh")
    x = tf.ones([2, 3, 4])
    graph = tf.function(layer).get_concrete_function(x).graph
    assert "TfgptBiasGelu" in {op.type for op in graph.get_operations()}
    config = layer.get_config()
    assert config["activation"] == "gelu_tanh"
    clone = ActivatedDense.from_config(config)
    assert clone.activation_name == "gelu_tanh" and clone.units == 8
    with pytest.raises(ValueError, match="activation"):
        ActivatedDense(8, activation="swish")
