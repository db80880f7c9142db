"""lmq's float32 GEMM for few rows (gemm.c), part of `lmq_kernels.cpu` (import it from there):

    small_m_mm(x, w_t, out, accumulate=False, bias=None, rows=..., panels=None) -> bool   out (+)= x @ w_t
    choose_gemm(m, k, n, panel=0) -> bool      whether lmq's GEMM runs m rows of a [k, n] weight here
    gemm_shape(kernels) -> dict                the register blocking a built library uses

`x` [M, K] and `out` [M, N] float32 with contiguous rows, `w_t` [K, N] float32 with unit column stride (a
Linear weight stored K-major, transposed), or its panel-major copy [N / P, K, P]. False (nothing computed)
where it cannot run the operands or calibration chose torch's GEMM.
"""
from __future__ import annotations

import ctypes

import torch

from . import benches
from .library import choose, forced, load, size_class

__all__ = ["small_m_mm", "choose_gemm", "gemm_shape", "MIN_ROWS", "GEMM_MAX_ROWS"]

# The rows the float32 GEMM takes (calibration then decides per row bucket whether it or BLAS runs them): up
# to 1,024. Over panel-major weights it keeps up with BLAS's blocked GEMM to about a thousand rows on
# SmolLM2's shapes, and a prefill's rows then get the decode step's FMA chains (benchmarks/RESULTS.md).
# K-major weights without a panel copy lose to BLAS at many rows: calibration picks.
MIN_ROWS, GEMM_MAX_ROWS = 1, 1024


def choose_gemm(m: int, k: int, n: int, panel: int = 0) -> bool:
    """Whether lmq's GEMM runs m rows of a [k, n] weight on this machine (`panel`: read from panels of that
    many columns), by the calibration's class (threads, row bucket, size classes of k and n). The panels
    have their own class: they stream faster than the K-major rows, so they win classes those lose."""
    up = size_class
    return choose("gemm_panels" if panel else "gemm", (torch.get_num_threads(), up(m), up(k), up(n)),
                  lambda: benches.gemm(forced(small_m_mm), up(m), k, n, panel=panel))


def small_m_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
               bias: torch.Tensor | None = None, rows: tuple[int, int] = (MIN_ROWS, GEMM_MAX_ROWS),
               panels: torch.Tensor | None = None) -> bool:
    """out (+)= x @ w_t with the small-M kernel (with `bias`: out = bias + x @ w_t, each sum starting from
    the bias); False (nothing computed, `out` untouched) if it cannot run these operands or x's row count
    is outside `rows` (inclusive). `panels`: w_t's panel-major copy (`step.panel_major`), read instead
    where given (the same bits; two threads stream it faster than the K-major rows)."""
    m, k = x.shape
    if not rows[0] <= m <= rows[1]:
        return False
    lib = load()
    if lib is None:
        return False
    n = w_t.shape[1]
    if (x.dtype != torch.float32 or w_t.dtype != torch.float32 or out.dtype != torch.float32
            or x.device.type != "cpu" or w_t.shape[0] != k or out.shape != (m, n)
            or x.stride(1) != 1 or w_t.stride(1) != 1 or out.stride(1) != 1):
        return False
    p = panels.shape[2] if panels is not None and panels.dim() == 3 else 0
    if p and not (panels.shape == (n // p, k, p) and n % p == 0 and panels.is_contiguous()
                  and panels.dtype == torch.float32):
        p = 0
    if not choose_gemm(m, k, n, p):
        return False
    if bias is not None:
        out.copy_(bias.expand_as(out))
        accumulate = True
    threads = torch.get_num_threads()
    if p:
        lib.lmq_small_m_gemm_panels(x.data_ptr(), x.stride(0), panels.data_ptr(), panels.shape[2], out.data_ptr(),
                                    out.stride(0), m, k, n, int(accumulate), threads)
        return True
    lib.lmq_small_m_gemm(x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.stride(0), out.data_ptr(), out.stride(0),
                         m, k, n, int(accumulate), threads)
    return True


def gemm_shape(kernels: ctypes.CDLL) -> dict[str, int]:
    """The GEMM's blocking in a built library: vector lanes, rows and vectors per register block, registers, and
    the block over panels at more than 4 rows (gemm.c)."""
    out = (ctypes.c_int * 6)()
    kernels.lmq_gemm_shape(out)
    return dict(zip(("lanes", "rows", "vectors", "registers", "rows_many", "vectors_many"), out))
