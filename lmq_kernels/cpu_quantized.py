"""The quantized GEMM of lmq's CPU kernels (part of `lmq_kernels.cpu`, which re-exports these; import them from
there), on the panels of cpu_qgemm.c:

    pack(q, d, m=None) -> QWeight                 int4 levels (0..15, with m) or int8 levels (-127..127) [N, K]
                                                  and their scales per group of 32 -> panels of 16 outputs
    unpack(w) -> (q, d, m)                        `pack` undone
    qgemm(x, w, out, accumulate=False)            out (+)= x @ W^T, x float32 [M, K] quantized to int8 per
                                                  group of 32 (W4A8 / W8A8), any row count
    qgemm_torch(x, w, out, accumulate=False)      the same bits with torch's ops

See cpu_qgemm.c for the arithmetic: the integer dot products are exact, the float part is the same roundings in
the same order on every instruction set, so the C kernel (any build) and torch's emulation agree bit for bit.
`qgemm` runs lmq's kernel, or (no C compiler, LMQ_CPU_KERNELS=0) the emulation; it always computes. Not
calibrated: there is no torch kernel of this product to choose against (torch's weight-only kernels multiply
float activations, and were measured 20-40x slower than float32 `torch.mm` on AVX2:
benchmarks/bench_quantized.py), and the emulation does the work of a float32 GEMM and more.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

GROUP, PANEL = 32, 16        # weights a scale along K; outputs a panel (cpu_qgemm.c)


@dataclass(frozen=True)
class QWeight:
    """A weight [n, k] in cpu_qgemm.c's panels (P = ceil(n / 16)): int4 q uint8 [P, 8 k] with d and m float32
    [P, k/32, 16]; int8 q int8 [P, 16 k] with d and `sums` int32 [P, k/32, 16] (each group's sum of q)."""
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    sums: torch.Tensor | None
    n: int
    PANEL = PANEL   # outputs a panel (a class constant, not a field)

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == torch.uint8 else 8

    @property
    def k(self) -> int:
        return self.q.shape[1] // (PANEL * self.bits // 8)      # a panel's bytes: 16 outputs x k x bits / 8

    def ok(self) -> bool:
        """Whether the tensors are such a weight (shapes, dtypes, contiguity, on the CPU)."""
        p, k = -(-self.n // PANEL), self.k
        aux = self.m if self.bits == 4 else self.sums
        other = self.sums if self.bits == 4 else self.m
        want = torch.float32 if self.bits == 4 else torch.int32
        return (k > 0 and k % GROUP == 0 and other is None and aux is not None and aux.dtype == want
                and self.q.shape == (p, k * PANEL * self.bits // 8) and self.d.dtype == torch.float32
                and self.d.shape == aux.shape == (p, k // GROUP, PANEL)
                and all(t.is_contiguous() and t.device.type == "cpu" for t in (self.q, self.d, aux)))


def _panels(t: torch.Tensor, p: int) -> torch.Tensor:
    """[n, G] per-output values -> [P, G, 16] (zero rows pad n to 16 P)."""
    t = torch.cat([t, t.new_zeros(p * PANEL - t.shape[0], t.shape[1])]) if t.shape[0] < p * PANEL else t
    return t.reshape(p, PANEL, t.shape[1]).permute(0, 2, 1).contiguous()


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> QWeight:
    """Levels q [N, K] with d (and for int4, m) [N, K/32] -> panels: int4 where `m` is given (q in 0..15),
    else int8 (q in -127..127)."""
    n, k = q.shape
    p = -(-n // PANEL)
    if m is None:
        q8 = q.to(torch.int8)
        sums = q8.view(n, k // GROUP, GROUP).sum(-1, dtype=torch.int32)
        q8 = torch.cat([q8, q8.new_zeros(p * PANEL - n, k)]) if p * PANEL > n else q8
        qp = q8.view(p, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(p, 16 * k)  # [P, K/4, 16, 4]
        return QWeight(qp, _panels(d.float(), p), None, _panels(sums, p), n)
    q4 = q.to(torch.uint8)
    q4 = torch.cat([q4, q4.new_zeros(p * PANEL - n, k)]) if p * PANEL > n else q4
    v = q4.view(p, PANEL, k // 8, 2, 4)                                             # k = 8 c + 4 half + j
    qp = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().view(p, 8 * k)
    return QWeight(qp, _panels(d.float(), p), _panels(m.float(), p), None, n)


def unpack(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [n, K]: uint8 0..15 or int8, d [n, K/32], m [n, K/32] or None)."""
    p, k, n = w.q.shape[0], w.k, w.n
    rows = lambda t: t.permute(0, 2, 1).reshape(p * PANEL, k // GROUP)[:n]  # noqa: E731
    if w.bits == 8:
        q = w.q.view(p, k // 4, PANEL, 4).permute(0, 2, 1, 3).reshape(p * PANEL, k)
        return q[:n], rows(w.d), None
    b = w.q.view(p, k // 8, PANEL, 4)
    q = torch.stack([b & 15, b >> 4], dim=2).permute(0, 3, 1, 2, 4).reshape(p * PANEL, k)   # [P, 16, K/8, 2, 4]
    return q[:n], rows(w.d), rows(w.m)


def q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 quantized per group of 32 as cpu_qgemm.c's lmq_q8_rows does: (xq [M, K/32, 32] float
    holding the int8 values, xs [M, K/32], s = xs * sum(xq) [M, K/32])."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    a = g.abs().amax(-1)
    inv = torch.where(a > 0, torch.full_like(a, 127.0) / a, torch.zeros_like(a))   # tensor / tensor: a true
    xq = torch.round(g * inv[..., None]).clamp_(-127, 127)                          # division, as in C
    xs = a / torch.full_like(a, 127.0)
    return xq, xs, xs * xq.sum(-1)


def qgemm_torch(x: torch.Tensor, w: QWeight, out: torch.Tensor, accumulate: bool = False, rows: int = 64) -> None:
    """`qgemm` with torch's ops, the same bits: the integer sums are exact float32 sums (under 2^24), the rest
    the kernel's roundings in its order. `rows` a pass (the per-group sums take rows x N x K/32 floats)."""
    q, d, mn = unpack(w)
    n, k = q.shape
    qg = q.float().view(n, k // GROUP, GROUP).permute(1, 2, 0)                      # [G, 32, n]
    for r in range(0, x.shape[0], rows):
        xq, xs, s = q8_rows(x[r:r + rows].float())
        sums = torch.bmm(xq.permute(1, 0, 2), qg)                                   # [G, rows, n]
        acc = torch.zeros(xq.shape[0], n)
        for g in range(k // GROUP):
            acc = acc + (sums[g] * d[:, g]) * xs[:, g:g + 1]
            if mn is not None:
                acc = acc + mn[:, g] * s[:, g:g + 1]
        if accumulate:
            out[r:r + rows] += acc
        else:
            out[r:r + rows] = acc


_local = threading.local()   # .scratch: the rows quantized, this thread's


def qgemm(x: torch.Tensor, w: QWeight, out: torch.Tensor, accumulate: bool = False) -> None:
    """out (+)= x @ W^T; x [M, K] float32 and out [M, N] with contiguous rows, any M. lmq's kernel, else
    `qgemm_torch` (the same bits)."""
    m, k = x.shape
    lib = cpu._load()
    if (lib is None or x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1
            or out.stride(1) != 1 or m == 0):
        if m:
            qgemm_torch(x, w, out, accumulate)
        return
    size = lib.lmq_qgemm_scratch(m, k)
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < size:
        scratch = _local.scratch = torch.empty(size, dtype=torch.uint8)
    aux = w.m if w.bits == 4 else w.sums
    lib.lmq_qgemm(x.data_ptr(), x.stride(0), m, k, w.q.data_ptr(), w.d.data_ptr(), aux.data_ptr(), w.n, w.bits,
                  out.data_ptr(), out.stride(0), int(accumulate), scratch.data_ptr(), torch.get_num_threads())


def bind(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the quantized entry points."""
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.lmq_qgemm.argtypes = [ptr, c_long, c_int, c_long, ptr, ptr, ptr, c_long, c_int, ptr, c_long, c_int, ptr,
                              c_int]
    lib.lmq_qgemm.restype = None
    lib.lmq_qgemm_scratch.argtypes = [c_int, c_long]
    lib.lmq_qgemm_scratch.restype = c_long


# last: cpu.py imports this module at its end (either may be imported first)
from . import cpu  # noqa: E402
