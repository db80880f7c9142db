"""The sampled pick of every row in two passes over its logits (no [R, V] float32 copies).

``sample_rows(logits [R, V], masks bool [M, V] | None, mask_of int [R], temperature f32 [R], u f32 [R])
-> int64 [R]``: row r's token of softmax(logits[r] / T_r) over the tokens ``masks[mask_of[r]]`` allows, at
which the cumulative mass, summed in vocabulary order, first passes u_r times the whole (never past the last
token with mass; T <= 0 is taken as 1: the caller's greedy rows). The arithmetic of
``lmq_backend/engine/picks.inverse_cdf`` without a nucleus. On a GPU a decode step's CUDA graph samples with
it and so does the host where the graph did not (`picks.sample`), so that both pick the same token; the
torch form takes six passes over the rows, a large share of a sampled step at a few hundred rows.

Kernels, for a split of ``CHUNK`` columns of a row each (a fixed width: the summation order of a row depends
on V alone, never on how many rows share the call, so a row's token is its own):
1. ``_split_sums``: the split's largest z = x / T among the allowed tokens and sum(exp(z - max)), in one
   pass (per lane, the mass rescaled as its largest z grows).
2. ``_split_search``: the row's largest z (M) and total mass (each split's sum scaled to M, added in split
   order) from the partials; the split's mass before it (the same terms, the splits before it); then the
   split's running sum of exp(z - M), tile by tile (``tl.cumsum``), for the first token where it passes
   u * total; and the split's last token with mass.
3. ``_first_crossing``: per row the first split's crossing, else the last token with mass (0: none).
Logits hold no NaN (a model's logits).

On CPU tensors the kernels run through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` was imported (tests); otherwise there is no CPU form here (`picks.inverse_cdf` serves the CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import interpreter_active

__all__ = ["sample_rows", "CHUNK"]

CHUNK = 8192    # columns a program takes (a Llama-3 row: 16 splits)
BLOCK = 1024    # columns a tile
_NONE = tl.constexpr(2 ** 62)  # no crossing in the split


@triton.jit(do_not_specialize=["V", "CHUNK", "SPLITS"])
def _split_sums(LOGITS, stride_l, MASKS, stride_m, MASK_OF, TEMP, PART_M, PART_L, V, CHUNK, SPLITS,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    t = tl.load(TEMP + r)
    t = tl.where(t > 0, t, 1.0)
    row = LOGITS + r * stride_l
    mrow = MASKS + tl.load(MASK_OF + r).to(tl.int64) * stride_m
    offs = tl.arange(0, BLOCK)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m = tl.full([BLOCK], float("-inf"), tl.float32)   # per lane: the largest z and the mass scaled to it
    mass = tl.zeros([BLOCK], tl.float32)
    for v0 in range(lo, hi, BLOCK):
        v = v0 + offs
        ok = v < hi
        if HAS_MASK:
            ok = ok & (tl.load(mrow + v, mask=ok, other=0) != 0)
        z = tl.where(ok, tl.load(row + v, mask=ok, other=0.0).to(tl.float32) / t, float("-inf"))
        new = tl.maximum(m, z)
        mass = tl.where(new > float("-inf"), mass * tl.exp(m - new) + tl.where(ok, tl.exp(z - new), 0.0), 0.0)
        m = new
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m > float("-inf"), mass * tl.exp(m - top), 0.0), axis=0)
    tl.store(PART_M + r * SPLITS + s, top)
    tl.store(PART_L + r * SPLITS + s, total)


@triton.jit(do_not_specialize=["V", "CHUNK", "SPLITS"])
def _split_search(LOGITS, stride_l, MASKS, stride_m, MASK_OF, TEMP, U, PART_M, PART_L, CROSS, LAST, V, CHUNK,
                  SPLITS, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, S_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    t = tl.load(TEMP + r)
    t = tl.where(t > 0, t, 1.0)
    offs_s = tl.arange(0, S_PAD)
    in_s = offs_s < SPLITS
    pm = tl.load(PART_M + r * SPLITS + offs_s, mask=in_s, other=float("-inf"))
    pl = tl.load(PART_L + r * SPLITS + offs_s, mask=in_s, other=0.0)
    top = tl.max(pm, axis=0)
    scaled = tl.where(pl > 0, pl * tl.exp(pm - top), 0.0)
    total = tl.sum(scaled, axis=0)
    carry = tl.sum(tl.where(offs_s < s, scaled, 0.0), axis=0)
    target = tl.load(U + r) * total
    row = LOGITS + r * stride_l
    mrow = MASKS + tl.load(MASK_OF + r).to(tl.int64) * stride_m
    offs = tl.arange(0, BLOCK)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    cross = tl.full([BLOCK], _NONE, tl.int64)
    last = tl.full([BLOCK], -1, tl.int64)
    for v0 in range(lo, hi, BLOCK):
        v = v0 + offs
        ok = v < hi
        if HAS_MASK:
            ok = ok & (tl.load(mrow + v, mask=ok, other=0) != 0)
        z = tl.load(row + v, mask=ok, other=0.0).to(tl.float32) / t
        p = tl.where(ok, tl.exp(z - top), 0.0)
        run = carry + tl.cumsum(p, axis=0)
        cross = tl.minimum(cross, tl.where((run > target) & (p > 0), v.to(tl.int64), _NONE))
        last = tl.maximum(last, tl.where(p > 0, v.to(tl.int64), -1))
        carry += tl.sum(p, axis=0)
    tl.store(CROSS + r * SPLITS + s, tl.min(cross, axis=0))
    tl.store(LAST + r * SPLITS + s, tl.max(last, axis=0))


@triton.jit(do_not_specialize=["SPLITS"])
def _first_crossing(CROSS, LAST, OUT, SPLITS, S_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    in_s = offs_s < SPLITS
    cross = tl.min(tl.load(CROSS + r * SPLITS + offs_s, mask=in_s, other=_NONE), axis=0)
    last = tl.max(tl.load(LAST + r * SPLITS + offs_s, mask=in_s, other=-1), axis=0)
    tl.store(OUT + r, tl.where(cross < _NONE, cross, tl.maximum(last, 0)))


def sample_rows(logits: torch.Tensor, masks: torch.Tensor | None, mask_of: torch.Tensor, temperature: torch.Tensor,
                u: torch.Tensor, out: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """[R] int64 sampled picks (see the module docstring), written into `out` when given (CUDA-graph friendly:
    no host reads; the partials are allocated per call from torch's caching allocator)."""
    R, V = logits.shape
    assert logits.stride(-1) == 1 and mask_of.shape == (R,) and temperature.shape == (R,) and u.shape == (R,)
    assert temperature.dtype == torch.float32 and u.dtype == torch.float32 and chunk % BLOCK == 0
    assert logits.device.type == "cuda" or interpreter_active(), "sample_rows runs on a GPU (or the interpreter)"
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if masks is not None:
        assert masks.dtype == torch.bool and masks.shape[1] == V and masks.stride(-1) == 1
    splits = triton.cdiv(V, chunk)
    s_pad = triton.next_power_of_2(splits)
    dev = logits.device
    part_m = torch.empty(R, splits, dtype=torch.float32, device=dev)
    part_l = torch.empty(R, splits, dtype=torch.float32, device=dev)
    cross = torch.empty(R, splits, dtype=torch.int64, device=dev)
    last = torch.empty(R, splits, dtype=torch.int64, device=dev)
    m = masks.view(torch.int8) if masks is not None else logits  # (not read without a mask)
    stride_m = masks.stride(0) if masks is not None else 0
    _split_sums[(R, splits)](logits, logits.stride(0), m, stride_m, mask_of, temperature, part_m, part_l, V, chunk,
                             splits, HAS_MASK=masks is not None, BLOCK=BLOCK)
    _split_search[(R, splits)](logits, logits.stride(0), m, stride_m, mask_of, temperature, u, part_m, part_l, cross,
                               last, V, chunk, splits, HAS_MASK=masks is not None, BLOCK=BLOCK, S_PAD=s_pad)
    _first_crossing[(R,)](cross, last, out, splits, S_PAD=s_pad)
    return out
