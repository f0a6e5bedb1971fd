"""The kernels' dispatch table: each reason a kernel does not run, and the
summary line against the ops a traced training step really holds."""

import numpy as np
import pytest
import tensorflow as tf

from tests.kernel_checks import (
    dtype_policy,
    forget_the_library,
    gpt_loss_and_gradients,
    require_avx512,
    traced_op_types,
)
from tfgpt import GPT, kernels
from tfgpt.kernels import build as kernel_build
from tfgpt.kernels import dispatch
from tfgpt.optim.fused_adamw import FusedAdamW

# The op each kernel name of the summary line stands for.
OPS = {
    "attention": "TfgptCausalAttention",
    "softmax": "TfgptCausalSoftmax",
    "layer_norm": "TfgptLayerNorm",
    "bias_gelu": "TfgptBiasGelu",
    "cross_entropy": "TfgptSparseCrossEntropy",
    "adamw": "TfgptResourceApplyAdamW",
}
SUMMARY_KERNELS = [name for name, kernel in dispatch.KERNELS.items() if kernel.in_summary]


def active(line):
    """The kernel names a summary line lists as running."""
    names = line.removeprefix("fused kernels: ").split(" (not: ")[0]
    return set() if names == "none" else set(names.split(", "))


def test_every_kernel_runs_in_the_plain_configuration():
    assert kernels.library() is not None, kernels.unavailable_reason()
    for name in dispatch.KERNELS:
        assert dispatch.reason(name, "float32") == "", name


@pytest.mark.parametrize("name", list(dispatch.KERNELS))
def test_turned_off_by_the_environment_and_by_disabled(name, monkeypatch):
    with kernels.disabled():
        assert dispatch.reason(name, "float32") == "turned off by kernels.disabled()"
    monkeypatch.setenv("TFGPT_FUSED_KERNELS", "0")
    assert dispatch.reason(name, "float32") == "turned off by TFGPT_FUSED_KERNELS=0"


@pytest.mark.parametrize("name", list(dispatch.KERNELS))
def test_a_visible_gpu_turns_every_kernel_off(name):
    with dispatch.simulate_gpu():
        assert dispatch.reason(name, "float32") == "a GPU is visible (CPU-only kernels)"
    assert dispatch.reason(name, "float32") == ""


def test_a_visible_gpu_takes_the_composite_ops():
    def gelu():
        return kernels.gelu(tf.ones([2, 3]))

    with dispatch.simulate_gpu():
        assert "TfgptGelu" not in traced_op_types(gelu)
    assert "TfgptGelu" in traced_op_types(gelu)


@pytest.mark.parametrize("jit_compile, expected", [(True, "XLA compiles the step"), (False, "")])
def test_xla_is_read_from_the_trace(jit_compile, expected):
    seen = []

    def traced(x):
        seen.append(dispatch.reason("layer_norm", x.dtype))
        return x

    tf.function(traced, jit_compile=jit_compile).get_concrete_function(
        tf.TensorSpec([2], tf.float32)
    )
    assert seen == [expected]
    assert dispatch.reason("layer_norm", "float32", xla=True) == "XLA compiles the step"


@pytest.mark.parametrize(
    "broken, expected",
    [
        ("missing", "library not built"),
        ("stale", "library built from other sources or another TensorFlow"),
        ("instructions", "library built for CPU features this CPU lacks: ['avx512f']"),
    ],
)
def test_an_unusable_library_is_the_reason(broken, expected, monkeypatch, tmp_path):
    if broken == "missing":
        monkeypatch.setattr(kernel_build, "LIBRARY", str(tmp_path / "missing.so"))
    elif broken == "stale":
        monkeypatch.setattr(kernel_build, "is_current", lambda *args, **kwargs: False)
    else:
        require_avx512(monkeypatch)
    forget_the_library(monkeypatch)
    for name in dispatch.KERNELS:
        assert dispatch.reason(name, "float32") == expected, name
    line = dispatch.summary("float32")
    assert line == f"fused kernels: none (not: {', '.join(SUMMARY_KERNELS)}: {expected})"
    monkeypatch.undo()  # the loaded library again, for the tests after this one
    assert kernels.library() is not None


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("attention", "bfloat16", "float32 only, not bfloat16"),
        ("attention", "float16", "float32 only, not float16"),
        ("adamw", "bfloat16", "float32 only, not bfloat16"),
        ("layer_norm", "float64", "float32, bfloat16 or float16 only, not float64"),
        ("gelu", tf.float64, "float32, bfloat16 or float16 only, not float64"),
        ("softmax", "bfloat16", ""),
        ("cross_entropy", "float16", ""),
    ],
)
def test_dtypes(name, dtype, expected):
    assert dispatch.reason(name, dtype) == expected


def test_dropout_mask_and_strategy_rules_name_their_kernels():
    for name in dispatch.KERNELS:
        expected = "attention dropout" if name == "attention" else ""
        assert dispatch.reason(name, "float32", dropout=0.1) == expected, name
        expected = "a padding mask or KV cache" if name in ("attention", "softmax") else ""
        assert dispatch.reason(name, "float32", masked=True) == expected, name
        expected = "a tf.distribute strategy updates the variables" if name == "adamw" else ""
        assert dispatch.reason(name, "float32", strategy=True) == expected, name
    # Outside training no dropout is in effect.
    assert dispatch.reason("attention", "float32", dropout=0.0) == ""


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kernel='flash'"):
        dispatch.reason("flash")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        dispatch.summary("fp8")
    with pytest.raises(ValueError, match="dtype='float64'"):
        dispatch.summary("float64")


def test_summary_groups_reasons():
    assert dispatch.summary("float32") == (
        "fused kernels: attention, layer_norm, bias_gelu, cross_entropy, adamw"
    )
    assert dispatch.summary("float16", masked=True, strategy=True) == (
        "fused kernels: layer_norm, bias_gelu, cross_entropy (not: attention: float32 only, "
        "not float16; softmax: a padding mask or KV cache; adamw: a tf.distribute strategy "
        "updates the variables)"
    )
    assert kernels.summary is dispatch.summary


def _traced_step_kernels(policy, dropout, jit_compile):
    """The summary names of the Tfgpt ops in a traced GPT training step:
    loss, gradients and the FusedAdamW update."""
    with dtype_policy(policy):
        model = GPT(vocabulary_size=53, num_layers=2, num_heads=2, hidden_dim=16,
                    intermediate_dim=24, max_sequence_length=7, dropout=dropout)
        inputs = np.random.default_rng(0).integers(0, 53, (3, 7))
        model(inputs)
        optimizer = FusedAdamW(learning_rate=1e-3, weight_decay=0.1, global_clipnorm=1.0)
        optimizer.build(model.trainable_variables)
        loss_and_gradients = gpt_loss_and_gradients(model, inputs, np.roll(inputs, -1, axis=1))

        def step():
            loss, gradients = loss_and_gradients()
            optimizer.apply(gradients, model.trainable_variables)
            return loss

        graph = tf.function(step, jit_compile=jit_compile).get_concrete_function().graph
        types = {op.type for op in graph.get_operations()}
        for function in graph._functions.values():  # noqa: SLF001 (nested functions)
            types |= {node.op for node in function.cached_definition.node_def}
    return {name for name, op in OPS.items() if op in types}


@pytest.mark.parametrize(
    "policy, dtype, dropout, xla",
    [
        ("float32", "float32", 0.0, False),
        ("mixed_bfloat16", "bfloat16", 0.0, False),
        ("float32", "float32", 0.2, False),
        ("float32", "float32", 0.0, True),
    ],
    ids=["float32", "mixed_bfloat16", "dropout", "xla"],
)
def test_summary_lists_the_kernels_a_traced_step_runs(policy, dtype, dropout, xla):
    line = dispatch.summary(dtype, xla=xla, dropout=dropout)
    assert active(line) == _traced_step_kernels(policy, dropout, xla), line
