"""The fused layer normalization against NumPy, TensorFlow autodiff and Keras.

Oracles: a float64 NumPy layer norm for the forward values, TensorFlow's
autodiff of Keras's composite ops (`keras.ops.layer_normalization`, what
`keras.layers.LayerNormalization` runs) for the gradients, Keras's layer
for the variables and config, and the models run with `kernels.disabled()`
for the model-level gradients.
"""

import os
import subprocess
import sys

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
from tfgpt.kernels.layer_norm_kernel import layer_norm
from tfgpt.layers import LayerNorm

# Widths: odd, a single column (the row is its own mean), GPT-mini's.
WIDTHS = [33, 1, 384]


@pytest.fixture(scope="module")
def library():
    library = kernels.library()
    assert library is not None, kernels.unavailable_reason()
    return library


def _inputs(shape, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    # A large offset: a one-pass variance (E[x^2] - E[x]^2) would lose digits.
    x = rng.normal(3.0, 2.0, shape).astype(dtype)
    gamma = rng.normal(1.0, 0.5, shape[-1:]).astype("float32")
    beta = rng.normal(0.0, 0.5, shape[-1:]).astype("float32")
    return x, gamma, beta


def _numpy_layer_norm(x, gamma, beta, epsilon):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(variance + epsilon)
    return (x - mean) * rstd * gamma + beta, mean[..., 0], rstd[..., 0]


# ---- Forward --------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("epsilon", [1e-12, 1e-5, 0.5])
def test_forward_matches_numpy(library, width, epsilon):
    x, gamma, beta = _inputs((3, 5, width))
    y, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta, epsilon=epsilon)
    expected_y, expected_mean, expected_rstd = _numpy_layer_norm(x, gamma, beta, epsilon)
    assert y.shape == x.shape and mean.shape == rstd.shape == (3, 5)
    np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-6)
    if width > 1:  # Width 1: variance 0, rstd = 1/sqrt(epsilon).
        np.testing.assert_allclose(rstd, expected_rstd, rtol=1e-5)
    else:
        np.testing.assert_allclose(rstd, 1 / np.sqrt(np.float32(epsilon)), rtol=1e-5)
        np.testing.assert_allclose(y, np.broadcast_to(beta, y.shape), atol=1e-6)


def test_epsilon_is_the_attribute_and_defaults_to_keras(library):
    x, gamma, beta = _inputs((4, 6))
    x[:, :] = x[:1, :]  # Same row everywhere; small variance makes epsilon visible.
    x = (x * 1e-3).astype("float32")
    for epsilon in (1e-3, 1e-2):
        y, _, _ = library.tfgpt_layer_norm(x, gamma, beta, epsilon=epsilon)
        np.testing.assert_allclose(y, _numpy_layer_norm(x, gamma, beta, epsilon)[0],
                                   rtol=1e-4, atol=1e-5)
    default, _, _ = library.tfgpt_layer_norm(x, gamma, beta)
    np.testing.assert_allclose(default, _numpy_layer_norm(x, gamma, beta, 1e-3)[0],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", WIDTHS)
def test_forward_matches_keras(width):
    x, gamma, beta = _inputs((2, 7, width))
    keras_y = keras.ops.layer_normalization(x, gamma, beta, epsilon=1e-5)
    # Width 1: Keras's `x * inv + (beta - mean * inv)` cancels two numbers near
    # |x| / sqrt(epsilon) ~ 1e3, so Keras itself is off by ~1e-5 there.
    atol = 1e-4 if width == 1 else 2e-6
    np.testing.assert_allclose(layer_norm(x, gamma, beta, 1e-5), keras_y, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_computes_in_float32_and_rounds_once(library, dtype):
    x, gamma, beta = _inputs((6, 97))
    x = tf.cast(x, dtype)
    y, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == tf.float32
    rounded = tf.cast(x, "float32").numpy()
    expected_y, expected_mean, _ = _numpy_layer_norm(rounded, gamma, beta, 1e-5)
    # The float32 statistics of the rounded input, one rounding at the end.
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-6)
    expected = tf.cast(tf.constant(expected_y, "float32"), dtype)
    step = 2.0**-7 if dtype == "bfloat16" else 2.0**-10  # Relative spacing.
    np.testing.assert_allclose(tf.cast(y, "float32"), tf.cast(expected, "float32"),
                               rtol=step, atol=1e-3)
    # And what Keras's layer computes (it too works in float32 and rounds once).
    keras_y = keras.ops.layer_normalization(x, gamma, beta, epsilon=1e-5)
    np.testing.assert_allclose(tf.cast(y, "float32"), tf.cast(keras_y, "float32"),
                               rtol=step, atol=1e-3)


# ---- Backward -------------------------------------------------------------


def _gradients(fn, x, gamma, beta, upstream):
    x, gamma, beta = (tf.constant(v) for v in (x, gamma, beta))
    with tf.GradientTape() as tape:
        tape.watch([x, gamma, beta])
        y = fn(x, gamma, beta)
    return [tf.convert_to_tensor(g) for g in tape.gradient(y, [x, gamma, beta], upstream)]


def _composite(x, gamma, beta, epsilon=1e-5):
    return keras.ops.layer_normalization(x, gamma, beta, epsilon=epsilon)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("shape", [(300,), (3, 5)])
def test_gradients_match_tensorflow_autodiff(width, shape):
    x, gamma, beta = _inputs(shape + (width,), seed=1)
    upstream = tf.constant(np.random.default_rng(2).normal(size=x.shape).astype("float32"))
    assert "TfgptLayerNorm" in traced_op_types(lambda v: layer_norm(v, gamma, beta, 1e-5), x)
    fused = _gradients(lambda *a: layer_norm(*a, 1e-5), x, gamma, beta, upstream)
    composite = _gradients(_composite, x, gamma, beta, upstream)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), fused, composite):
        scale = float(np.abs(b).max()) or 1.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5 * scale, err_msg=name)


def test_gradients_match_a_float64_reference(library):
    # Independent of TensorFlow's composite gradient: the textbook formulas.
    x, gamma, beta = _inputs((40, 33), seed=3)
    dy = np.random.default_rng(4).normal(size=x.shape)
    _, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)
    dx, dgamma, dbeta = library.tfgpt_layer_norm_grad(dy.astype("float32"), x, gamma, mean, rstd)
    _, mean64, rstd64 = _numpy_layer_norm(x, gamma, beta, 1e-5)
    xhat = (x - mean64[:, None]) * rstd64[:, None]
    g = dy * gamma
    expected_dx = rstd64[:, None] * (
        g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dgamma, (dy * xhat).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, dy.sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients_match_keras(dtype):
    x, gamma, beta = _inputs((4, 9, 65), seed=5)
    x = tf.cast(x, dtype)
    upstream = tf.cast(np.random.default_rng(6).normal(size=x.shape).astype("float32"), dtype)
    fused = _gradients(lambda *a: layer_norm(*a, 1e-5), x, gamma, beta, upstream)
    composite = _gradients(_composite, x, gamma, beta, upstream)
    assert fused[0].dtype == composite[0].dtype == dtype
    assert fused[1].dtype == fused[2].dtype == tf.float32
    for name, a, b in zip(("dx", "dgamma", "dbeta"), fused, composite):
        a, b = tf.cast(a, "float32"), tf.cast(b, "float32")
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(np.abs(b).max()),
                                   err_msg=name)


def test_parameter_gradients_are_deterministic(library):
    # Enough rows for many blocks of partial sums, summed on several threads.
    x, gamma, beta = _inputs((4096, 96), seed=7)
    dy = np.random.default_rng(8).normal(size=x.shape).astype("float32")
    _, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)
    first = [t.numpy() for t in library.tfgpt_layer_norm_grad(dy, x, gamma, mean, rstd)]
    for _ in range(20):
        again = library.tfgpt_layer_norm_grad(dy, x, gamma, mean, rstd)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
    forward = [library.tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)[0] for _ in range(2)]
    np.testing.assert_array_equal(*forward)


_ONE_THREAD_GRADIENTS = """
import sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
from tfgpt import kernels
x, gamma, beta, dy = (np.load(sys.argv[1])[key] for key in ("x", "gamma", "beta", "dy"))
_, mean, rstd = kernels.library().tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)
dx, dgamma, dbeta = kernels.library().tfgpt_layer_norm_grad(dy, x, gamma, mean, rstd)
np.savez(sys.argv[1], dx=dx, dgamma=dgamma, dbeta=dbeta)
"""


def test_parameter_gradients_do_not_depend_on_the_thread_count(library, tmp_path):
    # The row blocks are set by the shape alone, so one thread sums exactly
    # what this process's pool sums.
    x, gamma, beta = _inputs((1000, 40), seed=9)
    dy = np.random.default_rng(10).normal(size=x.shape).astype("float32")
    path = tmp_path / "tensors.npz"
    np.savez(path, x=x, gamma=gamma, beta=beta, dy=dy)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _ONE_THREAD_GRADIENTS, str(path)], check=True,
                   cwd=root, capture_output=True)
    one_thread = np.load(path)
    _, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta, epsilon=1e-5)
    pooled = library.tfgpt_layer_norm_grad(dy, x, gamma, mean, rstd)
    for name, value in zip(("dx", "dgamma", "dbeta"), pooled):
        np.testing.assert_array_equal(value, one_thread[name], err_msg=name)


def test_empty_inputs(library):
    x, gamma, beta = _inputs((0, 5, 8))
    y, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta)
    assert y.shape == (0, 5, 8) and mean.shape == (0, 5)
    dx, dgamma, dbeta = library.tfgpt_layer_norm_grad(x, x, gamma, mean, rstd)
    assert dx.shape == (0, 5, 8)
    np.testing.assert_array_equal(dgamma, np.zeros(8))
    np.testing.assert_array_equal(dbeta, np.zeros(8))


def test_shape_errors_name_the_argument(library):
    x, gamma, beta = _inputs((2, 3, 8))
    errors = (tf.errors.InvalidArgumentError, ValueError)
    with pytest.raises(errors, match="gamma"):
        library.tfgpt_layer_norm(x, gamma[:5], beta)
    with pytest.raises(errors, match="beta"):
        library.tfgpt_layer_norm(x, gamma, np.ones((2, 8), "float32"))
    with pytest.raises(errors, match="at least one axis"):
        library.tfgpt_layer_norm(np.float32(1.0), gamma[:1], beta[:1])
    with pytest.raises(errors, match="epsilon"):
        library.tfgpt_layer_norm(x, gamma, beta, epsilon=-1.0)
    _, mean, rstd = library.tfgpt_layer_norm(x, gamma, beta)
    with pytest.raises(errors, match="same shape"):
        library.tfgpt_layer_norm_grad(x[:, :2], x, gamma, mean, rstd)
    with pytest.raises(errors, match="mean and rstd"):
        library.tfgpt_layer_norm_grad(x, x, gamma, mean[:, :2], rstd[:, :2])
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        library.tfgpt_layer_norm(tf.ones([2, 3], "int32"), gamma[:3], beta[:3])


def test_static_shapes_are_inferred():
    def fn(x):
        y, mean, rstd = kernels.library().tfgpt_layer_norm(x, tf.ones([8]), tf.zeros([8]))
        assert y.shape.as_list() == [None, 3, 8] and mean.shape.as_list() == [None, 3]
        return y

    tf.function(fn).get_concrete_function(tf.TensorSpec([None, 3, 8]))
    with pytest.raises(ValueError, match="must be equal|Dimensions"):
        tf.function(fn).get_concrete_function(tf.TensorSpec([None, 3, 7]))


# ---- Dispatch -------------------------------------------------------------


def test_xla_disabled_environment_and_float64_take_keras_ops(monkeypatch):
    x, gamma, beta = _inputs((2, 3, 8))
    fn = lambda v: layer_norm(v, gamma, beta, 1e-5)  # noqa: E731
    assert "TfgptLayerNorm" in traced_op_types(fn, x)
    assert "TfgptLayerNorm" not in traced_op_types(fn, x, jit_compile=True)
    np.testing.assert_allclose(tf.function(fn, jit_compile=True)(x), fn(x), rtol=1e-5, atol=1e-5)
    with kernels.disabled():
        assert "TfgptLayerNorm" not in traced_op_types(fn, x)
        np.testing.assert_array_equal(fn(x), _composite(x, gamma, beta))
    assert "TfgptLayerNorm" not in traced_op_types(fn, x.astype("float64"))
    monkeypatch.setenv("TFGPT_FUSED_KERNELS", "0")
    assert "TfgptLayerNorm" not in traced_op_types(fn, x)


# ---- The Keras layer ------------------------------------------------------


def test_layer_has_keras_variables_names_and_config():
    ours = LayerNorm(epsilon=1e-5, name="norm")
    theirs = keras.layers.LayerNormalization(epsilon=1e-5, name="norm")
    for layer in (ours, theirs):
        layer.build((2, 5, 12))
    assert [(v.path, v.shape, v.dtype, v.trainable) for v in ours.weights] == [
        (v.path, v.shape, v.dtype, v.trainable) for v in theirs.weights
    ]
    assert ours.get_config() == theirs.get_config()
    restored = LayerNorm.from_config(ours.get_config())
    assert restored.get_config() == ours.get_config()
    serialized = keras.saving.serialize_keras_object(ours)
    assert isinstance(keras.saving.deserialize_keras_object(serialized), LayerNorm)


def test_layer_default_name_is_keras_s():
    names = [LayerNorm().name, keras.layers.LayerNormalization().name, LayerNorm().name]
    assert all(name.startswith("layer_normalization") for name in names)
    assert len(set(names)) == 3


def test_layer_reads_a_checkpoint_of_keras_s_layer(tmp_path):
    x, _, _ = _inputs((2, 5, 12))
    theirs = keras.layers.LayerNormalization(epsilon=1e-5, name="norm")
    theirs.build(x.shape)
    rng = np.random.default_rng(9)
    for variable in theirs.weights:
        variable.assign(rng.normal(size=variable.shape))
    path = tf.train.Checkpoint(layer=theirs).write(str(tmp_path / "ckpt"))
    ours = LayerNorm(epsilon=1e-5, name="norm")
    ours.build(x.shape)
    tf.train.Checkpoint(layer=ours).read(path).assert_consumed()
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")
@pytest.mark.parametrize(
    "kwargs",
    [dict(axis=[1, 2]), dict(axis=1), dict(center=False), dict(scale=False),
     dict(rms_scaling=True)],
)
def test_other_configurations_run_keras_s_call(kwargs):
    x, _, _ = _inputs((2, 5, 12))
    ours, theirs = LayerNorm(**kwargs), keras.layers.LayerNormalization(**kwargs)
    ours.build(x.shape)
    theirs.build(x.shape)
    for a, b in zip(ours.weights, theirs.weights):
        a.assign(np.random.default_rng(1).normal(size=a.shape))
        b.assign(a)
    assert "TfgptLayerNorm" not in traced_op_types(ours, x)
    np.testing.assert_array_equal(ours(x), theirs(x))


@pytest.mark.parametrize("axis", [-1, 2])
def test_plain_configuration_takes_the_fused_kernel(axis):
    x, _, _ = _inputs((2, 5, 12))
    layer = LayerNorm(axis=axis, epsilon=1e-5)
    assert "TfgptLayerNorm" in traced_op_types(layer, x)
    reference = keras.layers.LayerNormalization(axis=axis, epsilon=1e-5)
    reference.build(x.shape)
    np.testing.assert_allclose(layer(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_mixed_precision_output_dtype_is_keras_s(input_dtype):
    x = tf.cast(_inputs((2, 5, 12))[0], input_dtype)
    ours = LayerNorm(dtype="mixed_bfloat16")
    theirs = keras.layers.LayerNormalization(dtype="mixed_bfloat16")
    y, expected = ours(x), theirs(x)
    assert y.dtype == expected.dtype == tf.bfloat16
    assert [v.dtype for v in ours.weights] == [v.dtype for v in theirs.weights]
    np.testing.assert_allclose(tf.cast(y, "float32"), tf.cast(expected, "float32"),
                               rtol=1e-2, atol=1e-2)


# ---- Models ---------------------------------------------------------------


def _gpt_loss_and_gradients():
    from tfgpt import GPT

    model = GPT(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=64, max_sequence_length=12)
    inputs, targets = random_inputs_and_targets(np.random.default_rng(2), 50, (3, 12))
    return model, gpt_loss_and_gradients(model, inputs, targets)


def _bert_loss_and_gradients():
    from tfgpt import Bert

    model = Bert(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                 intermediate_dim=24, max_sequence_length=12, dropout=0.0)
    rng = np.random.default_rng(3)
    inputs = {
        "token_ids": tf.constant(rng.integers(0, 50, (3, 9)).astype("int32")),
        "segment_ids": tf.constant(np.repeat([[0] * 5 + [1] * 4], 3, 0).astype("int32")),
        "padding_mask": tf.constant(np.ones((3, 9), "int32")),
        "mask_positions": tf.constant([[1, 4], [2, 6], [0, 8]], "int32"),
    }
    labels = tf.constant(rng.integers(0, 50, (3, 2)).astype("int32"))

    def loss():
        outputs = model(inputs, training=True)
        mlm = keras.losses.sparse_categorical_crossentropy(
            labels, outputs["mlm_logits"], from_logits=True)
        nsp = keras.losses.sparse_categorical_crossentropy(
            tf.constant([0, 1, 0]), outputs["nsp_logits"], from_logits=True)
        return tf.reduce_mean(mlm) + tf.reduce_mean(nsp)

    return model, loss_and_gradients(model, loss)


@pytest.mark.parametrize("family", ["gpt", "bert"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_model_gradients_equal_the_composite_path(family, policy):
    with dtype_policy(policy):
        keras.utils.set_random_seed(4)
        build = _gpt_loss_and_gradients if family == "gpt" else _bert_loss_and_gradients
        model, step = build()
        fused, composite = fused_and_composite(model, step)
    assert {"TfgptLayerNorm", "TfgptLayerNormGrad"} <= fused[2]
    assert "TfgptLayerNorm" not in composite[2]
    tolerance = dict(rtol=1e-4, atol=1e-5) if policy == "float32" else dict(rtol=0.05, atol=3e-3)
    assert_same_loss_and_gradients(model, fused, composite, tolerance)
