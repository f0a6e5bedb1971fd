"""Keeps TensorFlow's start-up noise off a CPU machine's terminal.

Imported by `tfgpt/__init__.py`, so it runs before any tfgpt module imports
TensorFlow. Two things, each a default the environment overrides:

- `TF_CPP_MIN_LOG_LEVEL=2` (unless set): TensorFlow's C++ INFO and WARNING
  lines (oneDNN notices, CPU feature guards) are not printed; errors are.
  `TF_CPP_MIN_LOG_LEVEL=0` brings every line back, and turns the filter
  below off.
- While TensorFlow imports and first lists its devices, stderr passes
  through a filter that drops the lines no environment variable reaches
  and, when this machine has no GPU device node (`/dev/nvidia*`,
  `/dev/dxg`), CUDA's complaints about a GPU that is not there. A machine
  with a GPU sees every CUDA line; every other line passes through.

TensorFlow's native libraries log before absl is initialised, to stderr
and regardless of `TF_CPP_MIN_LOG_LEVEL` or any other environment variable
("WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR", "Could not find cuda drivers on your machine"), so they
cannot be switched off from Python, only filtered out of stderr as above:
a process that imports TensorFlow before tfgpt, or without it (horovodrun's
own launcher), still prints them.
"""

import glob
import importlib.abc
import importlib.util
import os
import re
import sys
import threading

# Lines logged before absl is initialised (any machine): absl's own notice,
# and oneDNN's, which TF_CPP_MIN_LOG_LEVEL silences later on but not this
# early (seen on an AVX-512 AMD EPYC, twice, once per library TensorFlow loads).
_PRE_ABSL_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. "
)
# CUDA looking for a GPU on a machine without one (absl's "I0000 ... file.cc:N] " prefix).
_NO_GPU_NOISE = re.compile(
    r"[IWE]\d{4} [\d:.]+ +\d+ (cudart_stub|cuda_platform|cuda_executor|cuda_diagnostics)"
    r"\.cc:\d+\] "
)


def quiet_tensorflow():
    """Sets the environment so that TensorFlow starts silently on a CPU."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ["TF_CPP_MIN_LOG_LEVEL"].strip() in ("", "0"):
        return
    if "tensorflow" in sys.modules or any(
        isinstance(finder, _QuietImport) for finder in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _QuietImport())


def has_gpu_device_node():
    """True when the machine has an NVIDIA (or WSL) GPU device node."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"))


def is_noise(line, gpu):
    """True for a start-up line the filter drops (`gpu`: a GPU device node exists)."""
    line = line.rstrip("\r\n")
    return bool(_PRE_ABSL_NOISE.match(line)) or (not gpu and bool(_NO_GPU_NOISE.match(line)))


class _QuietImport(importlib.abc.MetaPathFinder):
    """Wraps the import of `tensorflow` in the stderr filter, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def quiet_exec_module(module):
            with filtered_stderr(has_gpu_device_node()):
                exec_module(module)
                # The first device listing is where CUDA logs cuInit's failure.
                module.config.list_physical_devices("GPU")

        spec.loader.exec_module = quiet_exec_module
        return spec


class filtered_stderr:
    """Passes file descriptor 2 through `is_noise` until the block ends.

    At the descriptor level, so the C++ libraries' writes are filtered as
    well as Python's; kept lines are forwarded as they arrive, so nothing
    is held back if the process dies inside the block.
    """

    def __init__(self, gpu):
        self.gpu = gpu

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = threading.Thread(target=self._forward, args=(read_end,), daemon=True)
        self._thread.start()
        return self

    def _forward(self, read_end):
        with open(read_end, "rb") as pipe:
            for line in pipe:
                if not is_noise(line.decode(errors="replace"), self.gpu):
                    os.write(self._saved, line)

    def __exit__(self, *exception):
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's last write end: the reader sees EOF
        self._thread.join()
        os.close(self._saved)
        return False
