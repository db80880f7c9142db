"""The CPU kernels' variants this host can build and run (`TARGETS`), and the `kernels` fixture that runs
lmq_kernels.cpu's functions on each of them."""
from __future__ import annotations

import platform

import pytest

from lmq_kernels import cpu
from lmq_kernels.cpu.toolchain import cpu_flags

X86 = platform.machine() in ("x86_64", "AMD64")
FLAGS = set(cpu_flags().split())
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# the variants this host runs: its own, the AVX2 one where it has AVX2+FMA, the portable SSE2 one (x86),
# the AVX-512 one where it has AVX-512
TARGETS = ["native"] + (["x86-64-v3"] if X86 and {"avx2", "fma"} <= FLAGS else []) + (["x86-64"] if X86 else []) \
    + (["x86-64-v4"] if X86 and AVX512 <= FLAGS else [])


@pytest.fixture(params=TARGETS)
def kernels(request):
    """The module's functions run on the variant built for `request.param` (uncalibrated: always the C
    kernel where it takes the operands). A failed build fails the test."""
    lib = cpu.build(request.param)
    assert lib is not None, f"the {request.param} build failed: {cpu.build_error(request.param)}"
    with cpu.use(lib):
        yield lib
