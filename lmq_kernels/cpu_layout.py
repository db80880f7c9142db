"""The memory layout lmq's CPU GEMMs want of their operands, and the memory under them (the engine lays the
weights out by it, and the calibration's benchmarks too, so that they time what the engine runs)."""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch


def padded_stride(n: int, element_size: int) -> int:
    """The row stride (elements) of a CPU GEMM operand with n columns (K-major weights [K, n], outputs [M, n]):
    n, or n + 64 bytes where n's row is a multiple of 2 KB. Rows a multiple of 4 KB apart share their L1 sets
    (at 64 KB, their L2 sets): the small-M GEMM's chunk of weight rows evicted itself between its passes
    (SmolLM2's lm_head [576, 49152] at 8 rows 14.8 -> 5.5 ms with both strides padded, gate_up [576, 3072]
    0.74 -> 0.47 ms; AMD Zen 3, 2 threads)."""
    return n + 64 // element_size if (n * element_size) % 2048 == 0 else n


HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page


def streamed_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty CPU tensor for an operand a decode step streams whole from memory every step (the weights'
    panels): its memory an anonymous mapping that Linux is asked to back with transparent huge pages
    (`madvise(MADV_HUGEPAGE)`, which hosts whose THP mode is "madvise", the common default, need before
    they use any). With 4 KB pages a step's ~540 MB of float32 weights cross ~130,000 pages, each a TLB miss
    and a page walk (two-level under a hypervisor) that the hardware prefetcher stops at. With 2 MB pages
    the 120 layer GEMMs of SmolLM2-135M at 8 rows took 15.8-16.6 -> 13.0-13.6 ms on the AVX2 build (one row
    10.1-10.5 -> 9.6-10.1), and a whole 8-row decode step of the default model 20.3-22.8 -> 19.1-19.6 ms
    (AVX2 build; native builds level; Zen 5, 2 threads; K/V in huge pages gained nothing: RESULTS.md, thirtieth
    session). Below a huge page's size, without `mmap.MADV_HUGEPAGE` (not Linux) or where the mapping fails:
    `torch.empty`. The mapping lives as long as the tensor (and its views)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(region, dtype=np.uint8)
        start = -raw.ctypes.data % HUGE_PAGE   # the first huge page's boundary: every 2 MB of it can be one
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % mmap.PAGESIZE)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
