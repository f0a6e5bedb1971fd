"""Fused CPU kernels for the elementwise and row-wise work of a training step.

TensorFlow runs GELU, layer normalization and masked softmax as chains of
small ops, each a pass over memory (and, under mixed precision, wrapped in
bfloat16 <-> float32 casts); once the matmuls are fast (oneDNN, AMX in
bfloat16) those chains take much of a CPU step. The kernels here do each of
them, forward and backward, in one multi-threaded pass with float32 math;
in float32, causal self-attention between its two projections is one
kernel each way as well (`causal_attention`).
They are C++ TensorFlow ops in `tfgpt/kernels/cc/`, compiled against the
installed TensorFlow by `python -m tfgpt.kernels.build` (`make setup` runs
it).

Each public function (`gelu`, ...) takes the fused op when it can and
otherwise builds the same computation from TensorFlow ops. When it can is
decided in one place, `tfgpt.kernels.dispatch`: turned off
(`TFGPT_FUSED_KERNELS=0`, `with tfgpt.kernels.disabled():`), a GPU
visible, XLA compiling the call, the library missing, stale or built for
instructions this CPU lacks (a one-time warning), and each kernel's own
rules (dtypes, attention dropout, a padding mask or cache, a
`tf.distribute` strategy). `summary(dtype, xla, dropout, ...)` names the
kernels a training run uses, and why the others are not, in one line.

Example:
>>> import tensorflow as tf
>>> from tfgpt import kernels
>>> y = kernels.gelu(tf.constant([[-1.0, 0.0, 2.0]]))
"""

import contextlib
import importlib
import json
import logging
import os
import threading

# TensorFlow is imported where it is used, not here: `python -m
# tfgpt.kernels.build --help` runs this package's __init__ first.

_logger = logging.getLogger("tfgpt.kernels")
_state = threading.local()
_lock = threading.Lock()
_library = None
_load_error = None
_loaded = False


def in_xla_context():
    """True while tracing code that XLA will compile (jit_compile=True)."""
    try:  # Private, long-stable TF API (also used by tfgpt.layers' cache writes).
        from tensorflow.python.framework.ops import get_default_graph
        from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
    except ImportError:  # pragma: no cover
        return True  # cannot tell: be safe, use the composite ops
    return bool(GraphOrParentsInXlaContext(get_default_graph()))


def env_enabled():
    """False when the environment turns the kernels off (`TFGPT_FUSED_KERNELS=0`)."""
    return os.environ.get("TFGPT_FUSED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _load():
    """Loads the built library once; returns it, or None with the reason kept."""
    global _library, _load_error, _loaded
    # Imported here, not at the top: `python -m tfgpt.kernels.build` runs
    # this package's __init__ before the build module.
    import tensorflow as tf

    from tfgpt.kernels import build as _build

    with _lock:
        if _loaded:
            return _library
        _loaded = True
        _library, _load_error = None, None
        stamp = _build.read_stamp() or {}
        missing = set(stamp.get("requires_cpu_features", [])) - _build.cpu_features()
        if not os.path.exists(_build.LIBRARY):
            _load_error = "not built"
        elif not _build.is_current(tf.__version__, stamp.get("fingerprint", {}).get("flags", [])):
            _load_error = "built from other sources or another TensorFlow"
        elif missing:
            _load_error = f"built for CPU features this CPU lacks: {sorted(missing)}"
        else:
            try:
                _library = tf.load_op_library(_build.LIBRARY)
            except (tf.errors.NotFoundError, OSError) as error:
                _load_error = f"loading failed: {error}"
        if _library is not None:
            # Every op's gradient is registered with the library, whoever
            # creates the op.
            for module in _KERNEL_MODULES:
                importlib.import_module(module)
        else:
            _logger.warning(
                "tfgpt fused kernels unavailable (%s): using TensorFlow's composite ops, "
                "slower on CPU. Build them with `python -m tfgpt.kernels.build` "
                "(part of `make setup`).", _load_error,
            )
        return _library


def library():
    """The loaded op library (a module of op functions), or None."""
    return _load()


def unavailable_reason():
    """Why `library()` is None ("" when it is loaded)."""
    _load()
    return _load_error or ""


@contextlib.contextmanager
def disabled():
    """Traces the composite TensorFlow ops instead of the fused kernels."""
    previous = getattr(_state, "disabled", False)
    _state.disabled = True
    try:
        yield
    finally:
        _state.disabled = previous


def is_disabled_here():
    """True inside `with disabled():` (in this thread)."""
    return getattr(_state, "disabled", False)


def use_fused():
    """True when a call made now may take a fused kernel: no rule common to
    all kernels says no (`dispatch.runtime_reason`)."""
    from tfgpt.kernels import dispatch

    return not dispatch.runtime_reason()


def build_info():
    """The stamp of the built library (dict), or None."""
    from tfgpt.kernels import build as _build

    stamp = _build.read_stamp()
    return json.loads(json.dumps(stamp)) if stamp else None


# The kernel functions and the dispatch table, imported on first use (they
# import TensorFlow).
_KERNEL_MODULES = (
    "tfgpt.kernels.bias_gelu_kernel",
    "tfgpt.kernels.causal_attention_kernel",
    "tfgpt.kernels.causal_softmax_kernel",
    "tfgpt.kernels.cross_entropy_kernel",
    "tfgpt.kernels.gelu_kernel",
    "tfgpt.kernels.layer_norm_kernel",
)
_LAZY = {
    "bias_gelu": "tfgpt.kernels.bias_gelu_kernel",
    "causal_attention": "tfgpt.kernels.causal_attention_kernel",
    "sparse_cross_entropy": "tfgpt.kernels.cross_entropy_kernel",
    "gelu": "tfgpt.kernels.gelu_kernel",
    "summary": "tfgpt.kernels.dispatch",
}


def __getattr__(name):
    if name == "dispatch":
        return importlib.import_module("tfgpt.kernels.dispatch")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfgpt.kernels' has no attribute {name!r}")


__all__ = ["bias_gelu", "causal_attention", "disabled", "dispatch", "gelu", "in_xla_context",
           "library", "sparse_cross_entropy", "summary", "unavailable_reason", "use_fused"]
