"""The small ops of a step in lmq's CPU kernels (ops.c), part of `lmq_kernels.cpu` (import them from there):

    rmsnorm(x, w, eps, out) -> bool          out = w * (x * rsqrt(mean(x^2) + eps)), rows of x
    silu_mul(gu, out) -> bool                out = silu(gate) * up, gu = [gate | up]
    rope_append(qkv, cos, sin, ...) -> bool  RoPE of q and k, K/V appended to the paged store

Each takes float32 rows with a contiguous last dimension and returns False (nothing computed) where it cannot
run the operands or calibration chose torch's form (`choose_rmsnorm`, `choose_silu_mul`, `choose_rope_append`:
the classes, shared with the warm-up).
"""
from __future__ import annotations

import torch

from . import benches
from .library import choose, forced, load, rows_ok, size_class

__all__ = ["rmsnorm", "silu_mul", "rope_append", "choose_rmsnorm", "choose_silu_mul", "choose_rope_append"]


def choose_rmsnorm(m: int, n: int) -> bool:
    """Whether lmq's RMSNorm runs m rows of n here."""
    up = size_class
    return choose("rmsnorm", (torch.get_num_threads(), up(m), up(n)),
                  lambda: benches.rmsnorm(forced(rmsnorm), up(m), n))


def choose_silu_mul(m: int, i: int) -> bool:
    """Whether lmq's SiLU-mul runs m rows of i outputs here."""
    up = size_class
    return choose("silu_mul", (torch.get_num_threads(), up(m), up(i)),
                  lambda: benches.silu_mul(forced(silu_mul), up(m), i))


def choose_rope_append(n: int, hq: int, hkv: int, d: int, norms: bool, tokens: int) -> bool:
    """Whether lmq's RoPE + K/V append runs n tokens (`tokens` a row) of this head shape here."""
    up = size_class
    return choose("rope_append", (torch.get_num_threads(), up(n), hq, hkv, d, int(bool(norms)), int(tokens > 1)),
                  lambda: benches.rope_append(forced(rope_append), up(n), hq, hkv, d, bool(norms)))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> bool:
    """out = w * (x * rsqrt(mean(x^2) + eps)) for the rows of x [M, N] (HF's RMSNorm in float32)."""
    lib = load()
    if lib is None or x.dim() != 2 or out.shape != x.shape or w.shape != x.shape[1:] or not w.is_contiguous() \
            or not rows_ok(x, w, out):
        return False
    m, n = x.shape
    if not choose_rmsnorm(m, n):
        return False
    lib.lmq_rmsnorm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), m, n,
                    float(eps), torch.get_num_threads())
    return True


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> bool:
    """out = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2 I], out [M, I]."""
    lib = load()
    if lib is None or gu.dim() != 2 or out.dim() != 2 or gu.shape != (out.shape[0], 2 * out.shape[1]) \
            or not rows_ok(gu, out):
        return False
    m, i = out.shape
    if not choose_silu_mul(m, i):
        return False
    lib.lmq_silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), out.stride(0), m, i, torch.get_num_threads())
    return True


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, q: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, tokens: int, end: int,
                nrows: int) -> bool:
    """The fused step's RoPE + K/V append (the contract of its Triton kernel, `_rope_append_kernel`): qkv
    [N, (Hq + 2 Hkv) D] holds N = rows x `tokens` tokens, row-major; q [N, Hq, D] gets rope(qnorm(q)); token
    t of row b writes rope(knorm(k)) and v to the store's k_cache/v_cache [slots, Hkv, D] at the slot of
    column end - (tokens - 1) + t of its page table (`table` int32 [rows, S], unit column stride), unless its
    position (int32 [N]) is negative or b >= nrows. cos, sin [N, D/2]: RoPE's angles per token (rotate-half)."""
    lib = load()
    if lib is None:
        return False
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    norms = [x for x in (q_norm, k_norm) if x is not None]
    if (qkv.shape != (n, (hq + 2 * hkv) * d) or cos.shape != (n, d // 2) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous() or positions.dtype != torch.int32
            or positions.numel() < n or not positions.is_contiguous() or v_cache.shape != k_cache.shape
            or k_cache.dim() != 3 or k_cache.shape[2] != d or (q_norm is None) != (k_norm is None)
            or table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1
            or not all(x.shape == (d,) and x.is_contiguous() for x in norms)
            or q.stride(2) != 1 or not rows_ok(qkv, cos, sin, q, k_cache, v_cache, *norms)):
        return False
    if not choose_rope_append(n, hq, hkv, d, bool(norms), tokens):
        return False
    lib.lmq_rope_append(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                        q_norm.data_ptr() if q_norm is not None else None,
                        k_norm.data_ptr() if k_norm is not None else None, float(eps),
                        q.data_ptr(), q.stride(0), q.stride(1),
                        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                        table.data_ptr(), table.stride(0),
                        n, tokens, end, nrows, hq, hkv, d, torch.get_num_threads())
    return True
