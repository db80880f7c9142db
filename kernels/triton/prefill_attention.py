"""Paged prefill (extend) attention: the T new tokens of each row attend, causally, to the row's columns read
through its page table, cached prefix and new tokens alike, with no copy of the K/V.

Layout (the same as `decode_attention`'s paged case; see ``lmq_backend/cache/kv_store.py``)
---------------------------------------------------------------------------------------------
* ``k_cache``, ``v_cache``: one layer of the K/V store, ``[slots, H_kv, D]`` (any strides but the last).
* ``table``: int32 ``[B, S]``, row ``b``'s page table: column ``c`` is slot ``table[b, c]``.
* Rows are left-padded to a common ``end``: row ``b``'s columns are ``[start[b], end)``, its new tokens the
  last ones. ``q`` holds ``T`` tokens a row, token ``t`` at column ``end - T + t`` (the shorter rows' first
  tokens are padding).
* Query ``(b, t)`` attends to columns ``[start[b], end - T + t]``: its row's cached prefix and the new tokens
  up to itself. A query with no column (a padding token left of ``start[b]``) gets zeros.
* Query head ``h`` uses KV head ``h // G``, ``G = Hq // H_kv``.

Kernel
------
Grid ``(cdiv(T, BLOCK_T), B * H_kv)``: a program takes ``BLOCK_T`` tokens of one row and all ``G`` query heads
of one KV head (``BLOCK_T * G_PAD`` query rows, one ``tl.dot`` tile), and walks the columns its last token may
see, ``BLOCK_N`` at a time, through the page table, with an online softmax (base 2). Rows that share a cached
prefix read the same slots, which the GPU's L2 serves after the first reader: the gather of every row's
columns that this replaces moved each row's prefix through memory twice per layer. Where those programs are
far fewer than the GPU's multiprocessors (a few rows' new tokens after a long prefix), each program's columns
are split into ``SPLITS`` parts (grid axis 2; `splits_for`), each part's running max, sum and unnormalised
output go to a float32 scratch, and a second kernel (`_combine_src`, one program a query row) combines them. float32 inputs use
IEEE dots (no TF32), so float32 results stay within rounding of the reference.

On CPU tensors the kernel runs through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` was imported (tests); otherwise a torch reference (`prefill_attention_reference`) runs.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .decode_attention import interpreter_active, sm_count

__all__ = ["prefill_attention", "prefill_attention_reference", "programs", "splits_for"]


def _prefill_src(
    Q, K, V, TABLE, START, END, OUT, MID_O, MID_ML,
    qk_scale,  # sm_scale * log2(e)
    T, H_KV, HQ,
    stride_qb, stride_qt, stride_qh,
    stride_tb,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    t0 = tl.program_id(0) * BLOCK_T
    split = tl.program_id(2)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    b64 = b.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    t = t0 + offs_m // G_PAD                       # [BLOCK_M] token of each query row
    g = offs_m % G_PAD
    heads = (kvh * G + g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (t < T) & (g < G)
    mask_d = offs_d < D
    q = tl.load(Q + b64 * stride_qb + t.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    end = tl.load(END).to(tl.int32)                # read when the kernel runs (a CUDA graph's replay too)
    qcol = end - T + t                             # [BLOCK_M] the query's own column
    lo = tl.load(START + b).to(tl.int32)
    hi = tl.minimum(end, end - T + t0 + BLOCK_T)   # past the block's last column
    if SPLITS > 1:  # this program's share of the columns, whole tiles of them
        per = (tl.maximum(hi - lo, 0) + SPLITS - 1) // SPLITS
        per = (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask_n = cols < hi
        slots = tl.load(TABLE + b64 * stride_tb + cols, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(mask_n[None, :] & (cols[None, :] <= qcol[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if SPLITS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(OUT + b64 * stride_ob + t.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    else:  # the split's running max, sum and unnormalised output, for `_combine_src`
        row = ((b64 * T + t.to(tl.int64)) * HQ + heads) * SPLITS + split     # [BLOCK_M]
        tl.store(MID_O + row[:, None] * D + offs_d[None, :], acc, mask=mask_m[:, None] & mask_d[None, :])
        tl.store(MID_ML + row * 2, m_i, mask=mask_m)
        tl.store(MID_ML + row * 2 + 1, l_i, mask=mask_m)


def _combine_src(MID_O, MID_ML, OUT, T, HQ, stride_ob, stride_ot, stride_oh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """One query row (token, head) a program: its splits' partial softmaxes into the output."""
    r = tl.program_id(0).to(tl.int64)              # (b * T + t) * HQ + head
    head = r % HQ
    t = (r // HQ) % T
    b = r // (HQ * T)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(MID_ML + (r * SPLITS + offs_s) * 2)
    l = tl.load(MID_ML + (r * SPLITS + offs_s) * 2 + 1)
    acc = tl.load(MID_O + (r * SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=(offs_d < D)[None, :],
                  other=0.0)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
    total = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + b * stride_ob + t * stride_ot + head * stride_oh + offs_d, o.to(OUT.dtype.element_ty),
             mask=offs_d < D)


_JIT_KW = dict(do_not_specialize=["T"])
_prefill_kernel = triton.jit(**_JIT_KW)(_prefill_src)
_combine_kernel = triton.jit(**_JIT_KW)(_combine_src)


@functools.lru_cache(maxsize=None)
def _interpreted_kernels():
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_prefill_kernel, InterpretedFunction):
        return _prefill_kernel, _combine_kernel
    return InterpretedFunction(_prefill_src, **_JIT_KW), InterpretedFunction(_combine_src, **_JIT_KW)


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                table: torch.Tensor, start: torch.Tensor, end: int,
                                sm_scale: float | None = None) -> torch.Tensor:
    """The same contract in float32 torch ops over the gathered columns (slow; tests and CPU fallback)."""
    B, T, Hq, D = q.shape
    H_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    cols = torch.arange(end, device=q.device)
    k = k_cache[table[:B, :end].long()].float().repeat_interleave(Hq // H_kv, dim=2)   # [B, end, Hq, D]
    v = v_cache[table[:B, :end].long()].float().repeat_interleave(Hq // H_kv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k) * scale
    qcol = torch.arange(end - T, end, device=q.device)
    allowed = (cols[None, None, :] >= start.long()[:, None, None]) & (cols[None, None, :] <= qcol[None, :, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bhts,bshd->bthd", probs, v).to(q.dtype)


def _config(G: int, D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(G_PAD, BLOCK_T, BLOCK_N, num_warps): ~128 query rows a program (64 in float32, whose tiles take twice
    the registers), 64 columns a tile."""
    g_pad = triton.next_power_of_2(G)
    rows = 64 if dtype == torch.float32 or D > 64 else 128
    return g_pad, max(1, rows // g_pad), 64 if D <= 128 else 32, 4


def programs(B: int, T: int, Hq: int, H_kv: int, D: int, dtype: torch.dtype) -> int:
    """How many programs `prefill_attention` launches for these shapes: one walks all the columns its tokens
    see, so fewer than the GPU has multiprocessors leave it mostly idle (one row's few new tokens after a
    long cached prefix: 8 programs for Llama-3.2-1B)."""
    return triton.cdiv(T, _config(Hq // H_kv, D, dtype)[1]) * B * H_kv


def splits_for(B: int, T: int, Hq: int, H_kv: int, D: int, dtype: torch.dtype, columns: int, sms: int) -> int:
    """Into how many parts `prefill_attention` splits each program's columns: 1 where its programs fill the
    GPU's `sms` multiprocessors or the `columns` (an upper bound of those a row reads) are few; else the power
    of two, up to 16, that brings the programs closest to one a multiprocessor with at least two tiles of
    columns each."""
    progs, block_n = programs(B, T, Hq, H_kv, D, dtype), _config(Hq // H_kv, D, dtype)[2]
    s = 1
    while s < 16 and progs * 2 * s <= sms and columns >= 2 * s * 2 * block_n:
        s *= 2
    return s


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      start: torch.Tensor, end: int | torch.Tensor, sm_scale: float | None = None,
                      out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Attention of the new tokens ``q`` [B, T, Hq, D] of B rows over their page tables (see the module's
    docstring for the layout). ``start``: int32 [B] on q's device; ``end``: the common end column, an int
    (``T <= end <= S``) or a one-element int32 tensor on q's device that holds it (read when the kernel runs,
    as a CUDA graph's replay needs; not checked). ``splits``: the parts each program's columns are split into
    (a power of two; None: `splits_for`, from the shapes and ``end``, or the table's width where ``end`` is a
    tensor), each part's partial softmax combined by a second kernel. Returns ``out`` [B, T, Hq, D] in q's
    dtype."""
    B, T, Hq, D = q.shape
    slots, H_kv, Dk = k_cache.shape
    assert Dk == D and Hq % H_kv == 0 and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert table.dtype == torch.int32 and table.shape[0] >= B and table.stride(-1) == 1
    if isinstance(end, torch.Tensor):
        assert end.shape == (1,) and end.dtype == torch.int32 and end.device == q.device, end
        end_t = end
    else:
        assert T <= end <= table.shape[1], (T, end, table.shape)
        end_t = torch.full((1,), end, dtype=torch.int32, device=q.device)
    assert start.shape == (B,), (start.shape, B)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    assert out.shape == (B, T, Hq, D) and out.stride(-1) == 1
    if q.device.type == "cuda":
        kernel, combine = _prefill_kernel, _combine_kernel
    elif interpreter_active():
        kernel, combine = _interpreted_kernels()
    else:
        out.copy_(prefill_attention_reference(q, k_cache, v_cache, table, start, int(end_t[0]), sm_scale))
        return out
    G = Hq // H_kv
    g_pad, block_t, block_n, warps = _config(G, D, q.dtype)
    if splits is None:
        columns = table.shape[1] if isinstance(end, torch.Tensor) else end
        splits = splits_for(B, T, Hq, H_kv, D, q.dtype, columns, sm_count(q.device))
    assert splits >= 1 and splits & (splits - 1) == 0, splits
    if splits > 1:
        mid_o = torch.empty(B * T * Hq * splits * D, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(B * T * Hq * splits * 2, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_ml = out
    kernel[(triton.cdiv(T, block_t), B * H_kv, splits)](
        q, k_cache, v_cache, table, start, end_t, out, mid_o, mid_ml,
        float(sm_scale) * 1.4426950408889634,
        T, H_kv, Hq,
        q.stride(0), q.stride(1), q.stride(2),
        table.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, G_PAD=g_pad, BLOCK_T=block_t, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits,
        num_warps=warps,
    )
    if splits > 1:
        combine[(B * T * Hq,)](mid_o, mid_ml, out, T, Hq, out.stride(0), out.stride(1), out.stride(2),
                               D=D, BLOCK_D=triton.next_power_of_2(D), SPLITS=splits, num_warps=1)
    return out
