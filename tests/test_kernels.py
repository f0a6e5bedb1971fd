"""tfgpt's fused CPU kernels against NumPy and TensorFlow's own ops.

The oracles: NumPy formulas for the forward values, TensorFlow's autodiff
of its composite ops (`tf.nn.gelu`, ...) for the gradients, and a model
trained on the composite path for the model-level equivalence.
"""

import math
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.kernel_checks import (
    assert_same_loss_and_gradients,
    dtype_policy,
    forget_the_library,
    fused_and_composite,
    gpt_loss_and_gradients,
    random_inputs_and_targets,
    require_avx512,
    traced_op_types,
)
from tfgpt import kernels
from tfgpt.kernels import build as kernel_build


def _numpy_gelu(x, approximate):
    x = x.astype(np.float64)
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def test_library_is_built_and_loaded():
    # `make setup` builds the kernels; a test run without them would measure
    # only the fallback.
    assert kernels.library() is not None, kernels.unavailable_reason()
    assert kernels.use_fused()


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_forward_matches_numpy(approximate):
    x = np.concatenate([np.linspace(-8, 8, 4001), [-30.0, 30.0, 0.0]]).astype("float32")
    fused = kernels.library().tfgpt_gelu(x, approximate=approximate).numpy()
    np.testing.assert_allclose(fused, _numpy_gelu(x, approximate), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_low_precision_rounds_the_float32_result_once(dtype, approximate):
    x = tf.cast(tf.constant(np.linspace(-6, 6, 999, dtype="float32")), dtype)
    fused = kernels.library().tfgpt_gelu(x, approximate=approximate)
    assert fused.dtype == dtype
    # Math in float32 on the rounded input, one rounding at the end.
    expected = tf.cast(tf.constant(_numpy_gelu(tf.cast(x, "float32").numpy(), approximate),
                                   "float32"), dtype)
    np.testing.assert_allclose(tf.cast(fused, "float32"), tf.cast(expected, "float32"),
                               rtol=1e-2 if dtype == "bfloat16" else 1e-3, atol=1e-3)


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_gradient_matches_tensorflow_autodiff(approximate):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(0, 3, (7, 33)).astype("float32"))
    upstream = tf.constant(rng.normal(0, 1, (7, 33)).astype("float32"))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        fused = kernels.gelu(x, approximate)
        composite = tf.nn.gelu(x, approximate=approximate)
    assert "TfgptGelu" in traced_op_types(lambda v: kernels.gelu(v, approximate), x)
    np.testing.assert_allclose(fused, composite, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(fused, x, upstream),
                               tape.gradient(composite, x, upstream), rtol=1e-5, atol=1e-5)


def test_gelu_second_call_shapes_and_errors():
    library = kernels.library()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="same shape"):
        library.tfgpt_gelu_grad(tf.ones([2, 3]), tf.ones([3, 2]))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        library.tfgpt_gelu(tf.ones([2], "int32"))


def test_xla_disabled_and_environment_take_the_composite_ops(monkeypatch):
    x = tf.ones([2, 3])
    gelu = lambda v: kernels.gelu(v)  # noqa: E731
    assert "TfgptGelu" in traced_op_types(gelu, x)
    # Under jit_compile XLA compiles the composite ops (it cannot run a custom op).
    assert "TfgptGelu" not in traced_op_types(gelu, x, jit_compile=True)
    with kernels.disabled():
        assert "TfgptGelu" not in traced_op_types(gelu, x)
    assert "TfgptGelu" in traced_op_types(gelu, x)
    monkeypatch.setenv("TFGPT_FUSED_KERNELS", "0")
    assert not kernels.use_fused()
    assert "TfgptGelu" not in traced_op_types(gelu, x)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_gpt_training_gradients_equal_the_composite_path(policy):
    from tfgpt import GPT

    with dtype_policy(policy):
        keras.utils.set_random_seed(4)
        model = GPT(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
                    intermediate_dim=64, max_sequence_length=12)
        inputs, targets = random_inputs_and_targets(np.random.default_rng(2), 50, (3, 12))
        fused, composite = fused_and_composite(
            model, gpt_loss_and_gradients(model, inputs, targets))
    # Float32 attention is one fused kernel; in bfloat16 only its softmax is.
    attention = ("TfgptCausalAttention" if policy == "float32" else "TfgptCausalSoftmax")
    assert {"TfgptBiasGelu", "TfgptBiasGeluGrad", "TfgptLayerNorm", "TfgptLayerNormGrad",
            attention, attention + "Grad"} <= fused[2]
    tolerance = dict(rtol=1e-4, atol=1e-6) if policy == "float32" else dict(rtol=0.05, atol=2e-3)
    assert_same_loss_and_gradients(model, fused, composite, tolerance)


def test_build_is_a_no_op_when_current_and_stale_after_a_source_change(tmp_path, monkeypatch):
    import tensorflow as tf

    flags = kernel_build.isa_flags()
    assert kernel_build.is_current(tf.__version__, flags)
    messages = []
    assert kernel_build.build(log=messages.append) == kernel_build.LIBRARY
    assert messages == [f"[kernels] up to date: {kernel_build.LIBRARY}"]
    # A copy of the sources with one byte more, in a source or in the
    # header they share, no longer matches the stamp.
    original = kernel_build.SOURCE_DIR
    for changed in ("gelu.cc", "common.h"):
        copy = tmp_path / changed / "cc"
        shutil.copytree(original, copy)
        monkeypatch.setattr(kernel_build, "SOURCE_DIR", str(copy))
        assert kernel_build.is_current(tf.__version__, flags)
        with open(copy / changed, "a") as file:
            file.write("\n")
        assert not kernel_build.is_current(tf.__version__, flags)
    assert not kernel_build.is_current("0.0.0", flags)
    # Other base compiler flags (e.g. without -DNDEBUG) make it stale too.
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", original)
    assert kernel_build.is_current(tf.__version__, flags)
    monkeypatch.setattr(kernel_build, "BASE_FLAGS", [
        flag for flag in kernel_build.BASE_FLAGS if flag != "-DNDEBUG"])
    assert not kernel_build.is_current(tf.__version__, flags)


def test_build_reports_a_compile_error(tmp_path, monkeypatch):
    for name in ("LIBRARY", "STAMP"):
        monkeypatch.setattr(kernel_build, name, str(tmp_path / os.path.basename(
            getattr(kernel_build, name))))
    (tmp_path / "cc").mkdir()
    (tmp_path / "cc" / "broken.cc").write_text("int main( {\n")
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", str(tmp_path / "cc"))
    with pytest.raises(kernel_build.BuildError, match=r"compiling broken.cc failed|broken\.cc"):
        kernel_build.build(log=lambda message: None)
    assert not os.path.exists(tmp_path / "_tfgpt_kernels.so")


def test_isa_flags_need_every_feature():
    if kernel_build.isa_flags(set()) == [] and kernel_build.isa_flags({"avx2", "fma"}) == []:
        pytest.skip("not an x86-64 machine")
    assert kernel_build.isa_flags({"avx2"}) == []
    assert kernel_build.isa_flags({"avx2", "fma", "sse4_2"}) == ["-mavx2", "-mfma"]
    assert kernel_build.required_features(["-mavx2", "-mfma"]) == ["avx2", "fma"]
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    # AVX-512 only on top of AVX2 + FMA, and only with all four parts.
    assert kernel_build.isa_flags(avx512) == []
    assert kernel_build.isa_flags({"avx2", "fma", "avx512f", "avx512bw"}) == ["-mavx2", "-mfma"]
    flags = kernel_build.isa_flags({"avx2", "fma", *avx512})
    assert flags == ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
    assert kernel_build.required_features(flags) == sorted({"avx2", "fma", *avx512})


def test_a_library_built_for_missing_instructions_is_refused(monkeypatch):
    require_avx512(monkeypatch)
    forget_the_library(monkeypatch)
    assert kernels.library() is None
    assert "avx512f" in kernels.unavailable_reason()
    monkeypatch.undo()  # the loaded library again, for the tests after this one
    assert kernels.library() is not None
