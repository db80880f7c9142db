"""The quantized ops of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports them; import them from
there), on the layouts of cpu_qgemm.c (int8) and cpu_q4a8.c (int4):

    quantized_mm(x, q, scale, None, out, accumulate=False) -> bool   out (+)= x @ W^T, W int8 [N, K], x float32
    dequantize(q, scale, None, out) -> bool                          out = the int8 W as float32
    layout_ok(q, scale, zero, k) -> bool                             (q, scale, zero) is such a W [N, k], int8
                                                                     or int4 panels
    pack_q4(q, d, m) / unpack_q4(qp, dp, mp, n)                      int4 levels [N, K] <-> panels of 16 outputs
    q4a8_mm(x, qp, dp, mp, out, accumulate=False)                    out (+)= x @ W^T, W int4, x quantized to
                                                                     int8 per group of 32 (any row count)

int8: q int8 [N, K] with scale [N, K/32]: w = q * scale, x float32 (W8A32); `quantized_mm` returns False
(nothing computed) where it cannot run the operands or where calibration chose what runs otherwise (the weight
de-quantized, then torch's GEMM): see cpu.py.

int4: w = d q + m (q in 0..15, d and m a group of 32 along K: GGUF's Q4_1 values), multiplied with the rows
quantized to int8 (W4A8, as llama.cpp multiplies Q4_1 with Q8_1): see cpu_q4a8.c for the arithmetic.
`q4a8_mm` runs lmq's kernel, or (no C compiler, LMQ_CPU_KERNELS=0) `q4a8_torch`, which computes the same bits
with torch's ops; it always computes. Not calibrated: there is no torch kernel of this product to choose
against (torch's own int4 kernels multiply float activations), and its emulation here does the work of a
float32 GEMM and more.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from . import cpu_benches as _benches

MIN_ROWS, MAX_ROWS = 1, 16   # the rows `quantized_mm` takes (a decode step's; calibration decides per bucket)
GROUP, PANEL = 32, 16        # weights a scale along K; int4 outputs a panel (cpu_q4a8.c)


def quantized_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 out: torch.Tensor, accumulate: bool = False) -> bool:
    """out (+)= x @ W^T for an int8 W [N, K]; x [M, K] and out [M, N] float32 with contiguous rows, M <=
    MAX_ROWS. Calibrated against what runs otherwise: the weight de-quantized (`dequantize`) and torch's GEMM
    (torch's own weight-only kernels measured 20-40x slower than that on AVX2: benchmarks/bench_quantized.py)."""
    m, k = x.shape
    if not MIN_ROWS <= m <= MAX_ROWS or zero is not None:
        return False
    lib = cpu._load()
    if lib is None:
        return False
    n = q.shape[0]
    if (x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1
            or out.shape != (m, n) or not _weight_ok(q, scale, zero, k)):
        return False
    threads, up = torch.get_num_threads(), cpu._up
    if not cpu.choose("qgemm_i8", (threads, up(m), up(k), up(n)),
                      lambda: _benches.qgemm(cpu._forced(quantized_mm), dequantize, up(m), k, n)):
        return False
    lib.lmq_qgemm_i8(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), out.data_ptr(), out.stride(0),
                     m, k, n, int(accumulate), threads)
    return True


_checked: dict[int, tuple] = {}   # id(q) -> (weakref to q, scale, zero, k, ok); dropped with q


def _weight_ok(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int) -> bool:
    """`layout_ok`, remembered per weight tensor (a decode step multiplies ~120 fixed weights: their checks
    took ~5 of the ~20 us of Python a call)."""
    seen = _checked.get(id(q))
    if seen is not None and seen[0]() is q and seen[1] is scale and seen[2] is zero and seen[3] == k:
        return seen[4]
    ok = layout_ok(q, scale, zero, k)
    key = id(q)
    _checked[key] = (weakref.ref(q, lambda _, key=key: _checked.pop(key, None)), scale, zero, k, ok)
    return ok


def layout_ok(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int) -> bool:
    """Whether (q, scale, zero) is a weight of K = k in the layout of cpu_qgemm.c (int8 [N, k]) or cpu_q4a8.c
    (int4 panels: q uint8 [P, 8 k], scale (d) and zero (m) float32 [P, k / 32, 16])."""
    groups = k // GROUP
    if k % GROUP or k <= 0 or not q.is_contiguous() or not scale.is_contiguous() or scale.dtype != torch.float32 \
            or scale.device.type != "cpu" or q.device.type != "cpu":
        return False
    if q.dtype == torch.uint8:
        p = q.shape[0]
        return (zero is not None and q.shape == (p, 8 * k) and scale.shape == (p, groups, PANEL)
                and zero.shape == scale.shape and zero.is_contiguous() and zero.dtype == torch.float32)
    return zero is None and q.dtype == torch.int8 and q.shape[1] == k and scale.shape == (q.shape[0], groups)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, out: torch.Tensor) -> bool:
    """out = the int8 W as float32 (out [N, K] contiguous), with the same bits as torch's q * scale. Not
    calibrated: a copy at memory speed that torch's passes (convert, multiply) cannot beat."""
    lib = cpu._load()
    if lib is None or zero is not None or out.dim() != 2 or not out.is_contiguous() or out.dtype != torch.float32:
        return False
    n, k = out.shape
    if q.shape[0] != n or not layout_ok(q, scale, zero, k):
        return False
    lib.lmq_dequant_i8(q.data_ptr(), scale.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return True


# ------------------------------------------------------------------------------------------------ int4

def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 levels q [N, K] (0..15, any integer dtype) with d and m [N, K/32] -> cpu_q4a8.c's panels (qp uint8
    [P, 8 K], dp and mp float32 [P, K/32, 16], P = ceil(N / 16), the padding zeros)."""
    n, k = q.shape
    p = -(-n // PANEL)
    pad = p * PANEL - n
    q, d, m = q.to(torch.uint8), d.float(), m.float()
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d, m = torch.cat([d, d.new_zeros(pad, k // GROUP)]), torch.cat([m, m.new_zeros(pad, k // GROUP)])
    v = q.view(p, PANEL, k // 8, 2, 4)                                   # k = 8 c + 4 half + j
    qp = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().view(p, 8 * k)
    panels = lambda t: t.reshape(p, PANEL, k // GROUP).permute(0, 2, 1).contiguous()  # noqa: E731
    return qp, panels(d), panels(m)


def unpack_q4(qp: torch.Tensor, dp: torch.Tensor, mp: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_q4` undone: (q uint8 [n, K], d, m float32 [n, K/32])."""
    p, k = qp.shape[0], qp.shape[1] // 8
    b = qp.view(p, k // 8, PANEL, 4)
    q = torch.stack([b & 15, b >> 4], dim=2).permute(0, 3, 1, 2, 4).reshape(p * PANEL, k)  # [P, 16, K/8, 2, 4]
    rows = lambda t: t.permute(0, 2, 1).reshape(p * PANEL, k // GROUP)[:n]  # noqa: E731
    return q[:n], rows(dp), rows(mp)


def q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 quantized per group of 32 as cpu_q4a8.c's lmq_q8_rows does: (xq [M, K/32, 32] float
    holding the int8 values, xs [M, K/32], s = xs * sum(xq) [M, K/32])."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    a = g.abs().amax(-1)
    inv = torch.where(a > 0, torch.full_like(a, 127.0) / a, torch.zeros_like(a))   # tensor / tensor: a true
    xq = torch.round(g * inv[..., None]).clamp_(-127, 127)                          # division, as in C
    xs = a / torch.full_like(a, 127.0)
    return xq, xs, xs * xq.sum(-1)


def q4a8_torch(x: torch.Tensor, qp: torch.Tensor, dp: torch.Tensor, mp: torch.Tensor, out: torch.Tensor,
               accumulate: bool = False, rows: int = 64) -> None:
    """`q4a8_mm` with torch's ops, the same bits: the integer sums are exact float32 sums (under 2^24), the rest
    the kernel's roundings in its order. `rows` a pass (the per-group sums take rows x N x K/32 floats)."""
    n = out.shape[1]
    q, d, mn = unpack_q4(qp, dp, mp, n)
    k = q.shape[1]
    qg = q.float().view(n, k // GROUP, GROUP).permute(1, 2, 0)                      # [G, 32, n]
    for r in range(0, x.shape[0], rows):
        xq, xs, s = q8_rows(x[r:r + rows].float())
        sums = torch.bmm(xq.permute(1, 0, 2), qg)                                   # [G, rows, n]
        acc = torch.zeros(xq.shape[0], n)
        for g in range(k // GROUP):
            acc = acc + (sums[g] * d[:, g]) * xs[:, g:g + 1]
            acc = acc + mn[:, g] * s[:, g:g + 1]
        if accumulate:
            out[r:r + rows] += acc
        else:
            out[r:r + rows] = acc


_local = threading.local()   # .scratch: the rows quantized, this thread's


def q4a8_mm(x: torch.Tensor, qp: torch.Tensor, dp: torch.Tensor, mp: torch.Tensor, out: torch.Tensor,
            accumulate: bool = False) -> None:
    """out (+)= x @ W^T for an int4 W in panels (`pack_q4`); x [M, K] float32 and out [M, N] with contiguous
    rows, any M. lmq's kernel, else `q4a8_torch` (the same bits)."""
    m, k = x.shape
    lib = cpu._load()
    if (lib is None or x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1
            or out.stride(1) != 1 or m == 0):
        if m:
            q4a8_torch(x, qp, dp, mp, out, accumulate)
        return
    size = lib.lmq_q4a8_scratch(m, k)
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < size:
        scratch = _local.scratch = torch.empty(size, dtype=torch.uint8)
    lib.lmq_q4a8(x.data_ptr(), x.stride(0), m, k, qp.data_ptr(), dp.data_ptr(), mp.data_ptr(), out.shape[1],
                 out.data_ptr(), out.stride(0), int(accumulate), scratch.data_ptr(), torch.get_num_threads())


def bind(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the quantized entry points."""
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.lmq_qgemm_i8.argtypes = [ptr, c_long, ptr, ptr, ptr, c_long, c_int, c_long, c_long, c_int, c_int]
    lib.lmq_dequant_i8.argtypes = [ptr, ptr, ptr, c_long, c_long, c_int]
    lib.lmq_q4a8.argtypes = [ptr, c_long, c_int, c_long, ptr, ptr, ptr, c_long, ptr, c_long, c_int, ptr, c_int]
    lib.lmq_qgemm_i8.restype = lib.lmq_dequant_i8.restype = lib.lmq_q4a8.restype = None
    lib.lmq_q4a8_scratch.argtypes = [c_int, c_long]
    lib.lmq_q4a8_scratch.restype = c_long


# last: cpu.py imports this module at its end (either may be imported first)
from . import cpu  # noqa: E402
