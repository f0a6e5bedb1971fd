"""Which fused kernel runs, and why one does not: the one table every call site asks.

Each kernel runs when every rule below holds; the first that fails is the
reason it does not, checked in this order:

1. fused kernels are not turned off: environment `TFGPT_FUSED_KERNELS=0`,
   or `with tfgpt.kernels.disabled():` (a SavedModel export traces under
   it, so the exported graph holds only standard ops);
2. no GPU is visible (the kernels are CPU-only);
3. XLA is not compiling the call (`--xla`, `jit_compile=True`: XLA fuses
   the composite ops itself and cannot run a custom op);
4. the library is built, current, and built for instructions this CPU has;
5. the kernel's own rules (`KERNELS`): its dtypes (attention is float32
   only: in bfloat16 and float16 oneDNN's matmuls outrun the kernel's
   float32 Eigen matmuls), no attention dropout in training and no padding
   mask or KV cache (attention; the fused softmax masks causally, within
   packed examples' segments when given their ids, and nothing else), no
   `tf.distribute` strategy updating the variables (AdamW: its replicas'
   slot variables take Keras's update path).

`reason(kernel, dtype, ...)` answers at a call site, while a step is traced
(XLA is then read from the trace); `summary(...)` answers for a training
run's configuration, as one line for its start-up log.

Example:
>>> from tfgpt.kernels import dispatch
>>> dispatch.runs("attention", "bfloat16")  # float32 only
False
"""

import contextlib
import dataclasses

import tensorflow as tf

import tfgpt.kernels as kernels

_ALL_FLOATS = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One fused kernel's rules.

    Args:
        name: str. The name the summary line prints.
        dtypes: tuple of str. Dtypes of the tensor the kernel takes.
        dropout_free: bool. Does not run with dropout in training.
        mask_free: bool. Does not run with a padding mask or KV cache.
        strategy_free: bool. Does not run under a `tf.distribute` strategy.
        replaces: str or None. A kernel this one does the work of when it
            runs (then the other is not called and not listed).
        in_summary: bool. Whether a training step calls it (the GPT's dense
            layers have biases: `bias_gelu`, never a bias-free `gelu`).
    """

    name: str
    dtypes: tuple = _ALL_FLOATS
    dropout_free: bool = False
    mask_free: bool = False
    strategy_free: bool = False
    replaces: str = None
    in_summary: bool = True


# The order is the summary line's.
KERNELS = {
    kernel.name: kernel
    for kernel in (
        Kernel("attention", dtypes=("float32",), dropout_free=True, mask_free=True,
               replaces="softmax"),
        Kernel("softmax", mask_free=True),
        Kernel("layer_norm"),
        Kernel("bias_gelu", replaces="gelu"),
        Kernel("gelu", in_summary=False),
        Kernel("cross_entropy"),
        # The variables' dtype: float32, under mixed precision too.
        Kernel("adamw", dtypes=("float32",), strategy_free=True),
    )
}

_simulated_gpu = None
_has_gpu = None


@contextlib.contextmanager
def simulate_gpu(visible=True):
    """Answers as if a GPU were (or were not) visible: a test hook."""
    global _simulated_gpu
    previous, _simulated_gpu = _simulated_gpu, visible
    try:
        yield
    finally:
        _simulated_gpu = previous


def _gpu_visible():
    global _has_gpu
    if _simulated_gpu is not None:
        return _simulated_gpu
    if _has_gpu is None:
        _has_gpu = bool(tf.config.list_physical_devices("GPU"))
    return _has_gpu


def runtime_reason(xla=None):
    """Why no fused kernel runs here (rules 1-4), or "" when they may.

    Args:
        xla: bool or None. Whether XLA compiles the step; None reads it from
            the function being traced now.
    """
    if kernels.is_disabled_here():
        return "turned off by kernels.disabled()"
    if not kernels.env_enabled():
        return "turned off by TFGPT_FUSED_KERNELS=0"
    if _gpu_visible():
        return "a GPU is visible (CPU-only kernels)"
    if kernels.in_xla_context() if xla is None else xla:
        return "XLA compiles the step"
    if kernels.library() is None:
        return f"library {kernels.unavailable_reason()}"
    return ""


def reason(kernel, dtype=None, *, xla=None, dropout=0.0, masked=False, strategy=False):
    """Why `kernel` does not run in this configuration, or "" when it runs.

    Args:
        kernel: str. A name in `KERNELS`.
        dtype: dtype or str, or None. The dtype of the tensor the kernel
            would take (for `adamw` the variable's); None skips this rule.
        xla: bool or None. Whether XLA compiles the step; None reads it
            from the function being traced now.
        dropout: float. Dropout rate in effect (0 outside training).
        masked: bool. A padding mask or a KV cache is given.
        strategy: bool. A `tf.distribute` strategy updates the variables.

    Returns:
        str: "" or a short reason, e.g. "float32 only, not bfloat16".
    """
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {list(KERNELS)}. Received: kernel={kernel!r}")
    rules = KERNELS[kernel]
    why = runtime_reason(xla)
    if why:
        return why
    if dtype is not None:
        name = _dtype_name(dtype)
        if name not in rules.dtypes:
            *others, last = rules.dtypes
            takes = f"{', '.join(others)} or {last}" if others else last
            return f"{takes} only, not {name}"
    if rules.dropout_free and dropout:
        return "attention dropout"
    if rules.mask_free and masked:
        return "a padding mask or KV cache"
    if rules.strategy_free and strategy:
        return "a tf.distribute strategy updates the variables"
    return ""


def runs(kernel, dtype=None, **conditions):
    """True when `kernel` runs (`reason` is empty); same arguments as `reason`."""
    return not reason(kernel, dtype, **conditions)


def summary(dtype="float32", xla=False, dropout=0.0, masked=False, strategy=False,
            tensor_parallel=False, model_reasons=None):
    """One line naming the fused kernels a training step of this configuration runs.

    Args:
        dtype: str. The compute dtype: "float32", "bfloat16" or "float16"
            (mixed precision keeps float32 variables; AdamW sees those).
        xla: bool. Whether the step is compiled with XLA.
        dropout: float. The model's dropout rate (attention dropout).
        masked: bool. The model's attention takes a padding mask (encoders).
        strategy: bool. A `tf.distribute` strategy updates the variables
            (train_mirrored.py; Horovod is not one).
        tensor_parallel: bool. The loss is the vocabulary-parallel one
            (`--tensor-parallel`), not the cross-entropy kernel.
        model_reasons: dict or None. Kernel name -> why the model's
            layers do not call it (an RMSNorm instead of a layer norm,
            rotary attention: `tfgpt.training.loop.kernel_summary`).

    Returns:
        str, e.g. "fused kernels: softmax, layer_norm, bias_gelu,
        cross_entropy, adamw (not: attention: float32 only, not bfloat16)";
        kernels that share a reason are listed together.

    Example:
    >>> summary("float32", xla=True)
    'fused kernels: none (not: attention, softmax, layer_norm, bias_gelu, cross_entropy, adamw: XLA compiles the step)'
    """
    name = _dtype_name(dtype, argument="dtype")
    if name not in _ALL_FLOATS:
        raise ValueError(f"`dtype` must be one of {_ALL_FLOATS}. Received: dtype={dtype!r}")
    active, inactive = [], {}
    for kernel in KERNELS.values():
        if not kernel.in_summary or kernel.name in _replaced_by(active):
            continue
        why = reason(
            kernel.name, "float32" if kernel.strategy_free else name, xla=bool(xla),
            dropout=dropout, masked=masked, strategy=strategy,
        )
        if tensor_parallel and kernel.name == "cross_entropy":
            why = "--tensor-parallel's vocabulary-parallel loss runs plain ops"
        why = (model_reasons or {}).get(kernel.name) or why
        if why:
            inactive.setdefault(why, []).append(kernel.name)
        else:
            active.append(kernel.name)
    line = "fused kernels: " + (", ".join(active) or "none")
    if inactive:
        line += " (not: " + "; ".join(
            f"{', '.join(names)}: {why}" for why, names in inactive.items()
        ) + ")"
    return line


def _replaced_by(active):
    """The kernels that the `active` ones do the work of."""
    return {KERNELS[name].replaces for name in active if KERNELS[name].replaces}


def _dtype_name(dtype, argument="dtype"):
    try:
        return tf.as_dtype(dtype).name
    except TypeError as error:
        raise ValueError(
            f"`{argument}` must be a dtype. Received: {argument}={dtype!r}"
        ) from error
