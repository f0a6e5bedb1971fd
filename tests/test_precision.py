"""The start-up warning for a mixed precision the CPU would emulate."""

import pytest

from tfgpt.optim.precision import slow_precision_warning

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize("features, warns", [
    (AVX512, True),  # no bfloat16 instructions
    (AVX512 | {"avx512_bf16"}, False),
    (AVX512 | {"amx_bf16", "amx_tile"}, False),
    (set(), False),  # flags unknown: cannot tell
])
def test_bfloat16_warns_on_an_x86_cpu_without_bfloat16_matmuls(features, warns):
    message = slow_precision_warning("bfloat16", features, machine="x86_64", has_gpu=False)
    assert (message is not None) == warns
    if warns:
        assert "AVX512_BF16" in message and "--mixed-precision off" in message


@pytest.mark.parametrize("mixed_precision, machine, has_gpu", [
    ("off", "x86_64", False),
    ("float16", "x86_64", False),
    ("bfloat16", "aarch64", False),
    ("bfloat16", "x86_64", True),  # the matmuls run on the GPU
])
def test_no_warning_elsewhere(mixed_precision, machine, has_gpu):
    assert slow_precision_warning(mixed_precision, AVX512, machine=machine, has_gpu=has_gpu) is None

