"""The memory layout lmq's CPU GEMMs want of their operands (the engine lays the weights out by it, and the
calibration's benchmarks too, so that they time what the engine runs)."""
from __future__ import annotations


def padded_stride(n: int, element_size: int) -> int:
    """The row stride (elements) of a CPU GEMM operand with n columns (K-major weights [K, n], outputs [M, n]):
    n, or n + 64 bytes where n's row is a multiple of 2 KB. Rows a multiple of 4 KB apart share their L1 sets
    (at 64 KB, their L2 sets): the small-M GEMM's chunk of weight rows evicted itself between its passes
    (benchmarks/RESULTS.md has the measurements)."""
    return n + 64 // element_size if (n * element_size) % 2048 == 0 else n
