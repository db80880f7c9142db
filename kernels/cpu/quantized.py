"""The weight-only quantized ops of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports them; import
them from there), on the layouts of qgemm.c:

    quantized_mm(x, q, scale, zero, out, accumulate=False) -> bool   out (+)= x @ W^T, W int8 / int4 [N, K]
    dequantize(q, scale, zero, out) -> bool                          out = W as float32 ([N, K] or panels)
    layout_ok(q, scale, zero, k) -> bool                             (q, scale, zero) is such a W [N, k]

int8: q int8 [N, K] with scale [N, K/32] (zero None); int4: q uint8 [N, K/2] with scale (d) and zero (m)
[N, K/32] (GGUF's Q4_1 order). They return False (nothing computed) where they cannot run the operands or, for
`quantized_mm`, where calibration chose what runs otherwise (the weight de-quantized, then torch's GEMM;
`choose_quantized`: its class).
"""
from __future__ import annotations

import weakref

import torch

from . import benches
from .library import choose, forced, load, size_class

__all__ = ["quantized_mm", "dequantize", "layout_ok", "choose_quantized", "MIN_ROWS", "MAX_ROWS"]

MIN_ROWS, MAX_ROWS = 1, 16   # the rows `quantized_mm` takes (a decode step's; calibration decides per bucket)


def choose_quantized(m: int, k: int, n: int, int4: bool) -> bool:
    """Whether lmq's quantized GEMM runs m rows of an int4 (else int8) weight [n, k] here."""
    up = size_class
    return choose("qgemm_i4" if int4 else "qgemm_i8", (torch.get_num_threads(), up(m), up(k), up(n)),
                  lambda: benches.qgemm(forced(quantized_mm), dequantize, up(m), k, n, int4))


def quantized_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 out: torch.Tensor, accumulate: bool = False) -> bool:
    """out (+)= x @ W^T for a weight-only quantized W [N, K]; x [M, K] and out [M, N] float32 with contiguous
    rows, M <= MAX_ROWS. Calibrated against what runs otherwise: the weight de-quantized (`dequantize`) and
    torch's GEMM (torch's own weight-only kernels are far slower than that: benchmarks/bench_quantized.py)."""
    m, k = x.shape
    if not MIN_ROWS <= m <= MAX_ROWS:
        return False
    lib = load()
    if lib is None:
        return False
    n = q.shape[0]
    int4 = q.dtype == torch.uint8
    if (x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1
            or out.shape != (m, n) or not _weight_ok(q, scale, zero, k)):
        return False
    if not choose_quantized(m, k, n, int4):
        return False
    threads = torch.get_num_threads()
    if int4:
        lib.lmq_qgemm_i4(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                         out.data_ptr(), out.stride(0), m, k, n, int(accumulate), threads)
        return True
    lib.lmq_qgemm_i8(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), out.data_ptr(), out.stride(0),
                     m, k, n, int(accumulate), threads)
    return True


_checked: dict[int, tuple] = {}   # id(q) -> (weakref to q, scale, zero, k, ok); dropped with q


def _weight_ok(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int) -> bool:
    """`layout_ok`, remembered per weight tensor (a decode step multiplies the same ~120 weights every step:
    their checks were a quarter of a call's Python)."""
    seen = _checked.get(id(q))
    if seen is not None and seen[0]() is q and seen[1] is scale and seen[2] is zero and seen[3] == k:
        return seen[4]
    ok = layout_ok(q, scale, zero, k)
    key = id(q)
    _checked[key] = (weakref.ref(q, lambda _, key=key: _checked.pop(key, None)), scale, zero, k, ok)
    return ok


def layout_ok(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int) -> bool:
    """Whether (q, scale, zero) is a weight [N, k] in the layout of qgemm.c (int8 or int4)."""
    n, groups = q.shape[0], k // 32
    if k % 32 or not q.is_contiguous() or not scale.is_contiguous() or scale.dtype != torch.float32 \
            or scale.shape != (n, groups) or scale.device.type != "cpu":
        return False
    if q.dtype == torch.uint8:
        return (zero is not None and q.shape[1] * 2 == k and zero.shape == scale.shape and zero.is_contiguous()
                and zero.dtype == torch.float32)
    return zero is None and q.dtype == torch.int8 and q.shape[1] == k


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, out: torch.Tensor) -> bool:
    """out = W as float32, with the same bits as torch's q * scale and d * q + m (no fused multiply-add): out
    [N, K] contiguous, or W's panels [N / P, K, P] (P <= 64: the small-M GEMM's panel-major operand,
    `small_m_mm(panels=)`). Not calibrated: a copy at memory speed that torch's several passes (unpack,
    convert, multiply, add) cannot beat."""
    lib = load()
    if lib is None or out.dim() not in (2, 3) or not out.is_contiguous() or out.dtype != torch.float32:
        return False
    if out.dim() == 2:
        (n, k), p = out.shape, 0
    else:
        n, k, p = out.shape[0] * out.shape[2], out.shape[1], out.shape[2]
        if p > 64:
            return False
    if q.shape[0] != n or not layout_ok(q, scale, zero, k):
        return False
    if zero is None:
        lib.lmq_dequant_i8(q.data_ptr(), scale.data_ptr(), out.data_ptr(), n, k, p, torch.get_num_threads())
    else:
        lib.lmq_dequant_i4(q.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), n, k, p,
                           torch.get_num_threads())
    return True
