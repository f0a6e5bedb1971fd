"""What the kernel tests share: the op types of a trace, a GPT's loss and
gradients run with and without the fused kernels and compared, and a
library made to look unusable."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfgpt import kernels
from tfgpt.kernels import build as kernel_build


def traced_op_types(function, *args, jit_compile=False, **kwargs):
    """The op types in the graph of `function(*args, **kwargs)`.

    A Python function or a layer is traced as a new `tf.function` (compiled
    with XLA under `jit_compile`); a `tf.function` is traced as it is.
    """
    if not hasattr(function, "get_concrete_function"):
        python_function = function
        function = tf.function(
            lambda *inputs: python_function(*inputs, **kwargs), jit_compile=jit_compile
        )
    return {op.type for op in function.get_concrete_function(*args).graph.get_operations()}


@contextlib.contextmanager
def dtype_policy(policy):
    """Keras's global dtype policy set to `policy` inside, float32 again after."""
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


def random_inputs_and_targets(rng, vocabulary_size, shape):
    """Two int32 token tensors of `shape` drawn from `rng`: inputs, then targets."""
    return tuple(
        tf.constant(rng.integers(0, vocabulary_size, shape).astype("int32")) for _ in range(2)
    )


def loss_and_gradients(model, loss):
    """A function of no arguments returning `loss()` and its gradients, one
    per trainable variable of `model` (traced anew under each `tf.function`)."""

    def run():
        with tf.GradientTape() as tape:
            value = loss()
        return value, tape.gradient(value, [v.value for v in model.trainable_variables])

    return run


def gpt_loss_and_gradients(model, inputs, targets):
    """`loss_and_gradients` of a GPT's training-mode cross-entropy on (inputs, targets)."""
    from tfgpt.training.train_step import cross_entropy

    return loss_and_gradients(model, lambda: cross_entropy(targets, model(inputs, training=True)))


def fused_and_composite(model, loss_and_gradients):
    """`loss_and_gradients` traced and run with the fused kernels, then again
    under `kernels.disabled()`: two `(loss, gradients, op_types)` triples.

    The model's seed state is put back between the two runs, so that with
    dropout both draw the same masks.
    """
    seed_states = [variable.numpy() for variable in model.non_trainable_variables]
    step = tf.function(loss_and_gradients)
    fused = (*step(), traced_op_types(step))
    for variable, state in zip(model.non_trainable_variables, seed_states):
        variable.assign(state)
    with kernels.disabled():
        step = tf.function(loss_and_gradients)
        composite = (*step(), traced_op_types(step))
    return fused, composite


def assert_same_loss_and_gradients(model, fused, composite, loss_tolerance,
                                   gradient_tolerance=None):
    """The losses and each trainable variable's gradients of two
    `fused_and_composite` runs agree (gradients within `loss_tolerance`
    unless `gradient_tolerance` is given); a failure names the variable."""
    np.testing.assert_allclose(fused[0], composite[0], **loss_tolerance)
    for variable, a, b in zip(model.trainable_variables, fused[1], composite[1]):
        np.testing.assert_allclose(tf.convert_to_tensor(a), tf.convert_to_tensor(b),
                                   err_msg=variable.path, **(gradient_tolerance or loss_tolerance))


def require_avx512(monkeypatch):
    """The built library's stamp asks for AVX-512 and this CPU has only AVX2
    and FMA: a venv built on an AVX-512 machine and copied to one without it."""
    stamp = kernel_build.read_stamp()
    monkeypatch.setattr(kernel_build, "read_stamp", lambda: {
        **stamp, "requires_cpu_features": ["avx2", "fma", "avx512f"]})
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: {"avx2", "fma"})


def forget_the_library(monkeypatch):
    """The next `kernels.library()` loads the library again (with whatever
    `monkeypatch` has changed); `monkeypatch.undo()` brings back the loaded one."""
    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_load_error", None)
