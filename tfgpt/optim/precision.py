"""Whether the CPU computes a mixed-precision policy in hardware.

Mixed bfloat16 is fast on a CPU only when its matmuls run in bfloat16
hardware: AVX512_BF16 or AMX (Intel since Cooper Lake / Sapphire Rapids,
AMD since Zen 4). Elsewhere oneDNN emulates them and a step is several
times slower than in float32: gpt-mini, batch 8 x 256, 2 threads of an
AVX-512 Xeon without either, about 740 tokens/s in bfloat16 against about
3,000 in float32 (`python -m bench.throughput --configs "tfgpt fp32"
"tfgpt bf16"`). The trainers say so at start-up instead of leaving a user to
find out from the tokens/s.
"""

import platform

from tfgpt.kernels.build import cpu_features

# /proc/cpuinfo flags under which oneDNN runs bfloat16 matmuls natively.
NATIVE_BFLOAT16 = ("avx512_bf16", "amx_bf16")


def slow_precision_warning(mixed_precision, features=None, machine=None, has_gpu=None):
    """A warning (str) when `mixed_precision` would be emulated here, else None.

    Args:
        mixed_precision: str. The trainers' `--mixed-precision` value
            ("off", "bfloat16", "float16").
        features: set of CPU flag names; default this CPU's (x86 Linux).
        machine: str. `platform.machine()` by default.
        has_gpu: bool. Whether TensorFlow sees a GPU; looked up by default.

    Only bfloat16 on an x86 CPU whose flags are known and lack
    `NATIVE_BFLOAT16` gives a warning: with a GPU the matmuls run there,
    and elsewhere (ARM, flags unknown) it cannot tell.
    """
    if mixed_precision != "bfloat16":
        return None
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return None
    if features is None:

        features = cpu_features()
    if not features or any(flag in features for flag in NATIVE_BFLOAT16):
        return None
    if has_gpu is None:
        import tensorflow as tf

        has_gpu = bool(tf.config.list_physical_devices("GPU"))
    if has_gpu:
        return None
    return (
        "this CPU has no bfloat16 matmul instructions (neither AVX512_BF16 nor AMX), so "
        "--mixed-precision bfloat16 is emulated and several times slower than float32 "
        "here; use --mixed-precision off on this machine"
    )
