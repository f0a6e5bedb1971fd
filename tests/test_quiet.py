"""TensorFlow starts silently under tfgpt on a CPU machine (tfgpt.quiet)."""

import os
import subprocess
import sys

import pytest

from tests.launch import REPO
from tfgpt import quiet

NOISE = [
    "All log messages before absl::InitializeLog() is called",
    "Could not find cuda drivers",
    "failed call to cuInit",
    "cpu_feature_guard",
    "rebuild TensorFlow with the appropriate compiler flags",
]
PROGRAM = (
    "import sys; import tfgpt; import tensorflow as tf; "
    "print('user line', file=sys.stderr); print(float(tf.constant(1.0) + 1))"
)


def _run(program, **env):
    environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    environment["PYTHONPATH"] = str(REPO)
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=environment,
        cwd=REPO, timeout=300,
    )


def test_importing_tensorflow_through_tfgpt_prints_no_start_up_noise():
    result = _run(PROGRAM)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "2.0\n"
    for noise in NOISE:
        assert noise not in result.stderr, result.stderr
    # Lines that are not noise pass through the filter.
    assert result.stderr.splitlines() == ["user line"], result.stderr


@pytest.mark.skipif(quiet.has_gpu_device_node(), reason="the CUDA lines differ with a GPU")
def test_the_environment_brings_the_lines_back():
    # The filter is a default: TF_CPP_MIN_LOG_LEVEL=0 asks for every line.
    result = _run(PROGRAM, TF_CPP_MIN_LOG_LEVEL="0")
    assert result.returncode == 0, result.stderr
    assert "Could not find cuda drivers" in result.stderr
    assert "All log messages before absl::InitializeLog()" in result.stderr


def test_the_filter_drops_only_the_known_lines():
    absl = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    cuda = ("I0000 00:00:1795597610.031461    5470 cudart_stub.cc:31] Could not find cuda "
            "drivers on your machine, GPU will not be used.")
    cu_init = ("E0000 00:00:1795599621.396325   23289 cuda_platform.cc:52] failed call to "
               "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)")
    other_error = ("E0000 00:00:1795599621.396325   23289 op_kernel.cc:1840] OP_REQUIRES "
                   "failed at matmul_op.cc:12 : INVALID_ARGUMENT")
    onednn = ("I0000 00:00:1795613233.107319   30762 port.cc:153] oneDNN custom operations are "
              "on. You may see slightly different numerical results due to floating-point "
              "round-off errors from different computation orders. To turn them off, set the "
              "environment variable `TF_ENABLE_ONEDNN_OPTS=0`.")
    assert quiet.is_noise(absl + "\n", gpu=False) and quiet.is_noise(absl, gpu=True)
    assert quiet.is_noise(onednn, gpu=False) and quiet.is_noise(onednn, gpu=True)
    # Another line of the same file is not.
    assert not quiet.is_noise(onednn.replace("oneDNN custom operations are on", "Other"), gpu=False)
    assert quiet.is_noise(cuda, gpu=False) and quiet.is_noise(cu_init, gpu=False)
    # A machine with a GPU device node sees every CUDA line.
    assert not quiet.is_noise(cuda, gpu=True) and not quiet.is_noise(cu_init, gpu=True)
    assert not quiet.is_noise(other_error, gpu=False)
    assert not quiet.is_noise("Traceback (most recent call last):", gpu=False)


def test_filtered_stderr_forwards_other_lines_at_the_descriptor_level(capfd):
    with quiet.filtered_stderr(gpu=False):
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called "
                    b"are written to STDERR\n")
        os.write(2, b"kept line\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "kept line\nafter\n"
