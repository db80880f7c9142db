"""The greedy pick of every row under each of K token masks, in one pass over the logits.

``masked_argmax_k(logits [B, V], masks bool [K, V]) -> int64 [K, B]``: entry ``[k, b]`` is the index of the
largest ``logits[b, v]`` with ``masks[k, v]``, the first such index on ties, 0 where the mask allows nothing:
``torch.where(masks[:, None], logits[None], -inf).argmax(-1)`` (``lmq_backend/engine/picks.py``), without
materialising the ``[K, B, V]`` copy. The fused GPU step picks this way under its greedy masks (at a few
hundred rows of a 128k vocabulary the torch form writes and re-reads over a hundred MB a step).

Kernel: a program per row and split of V (as many splits as keep ~2 programs per SM busy: one program
walking a 128k-token row alone would take a sizeable share of a one-row decode step) walks its
columns in tiles of ``BLOCK`` with every mask at once (``K_PAD`` rows of a tile), keeping per mask the best
value and its index; a tile's maximum replaces the running one only when strictly greater, so the first
index wins ties, as ``torch.argmax``. A second kernel takes per row the first split with the largest value.
Logits hold no NaN (a model's logits).

On CPU tensors the kernel runs through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` was imported (tests); otherwise the torch form runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import interpreter_active, sm_count

__all__ = ["MaskedPicks", "masked_argmax_k", "masked_argmax_k_reference"]

BLOCK = 1024
SPARSE_SHARE = 64  # a mask allowing at most 1/SPARSE_SHARE of the tokens is picked from its token list


@triton.jit(do_not_specialize=["K", "CHUNK", "SPLITS"])  # one compiled kernel for every batch size
def _masked_argmax_kernel(LOGITS, stride_lb, MASKS, stride_mk, OUT, stride_ok, PART_V, PART_I, V, K, CHUNK,
                          SPLITS, K_PAD: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr):
    """Program (b, s): row b's columns [s CHUNK, (s + 1) CHUNK) under every mask; its best value and index per
    mask go to PART_V / PART_I [K, B, SPLITS] (DIRECT, one split: the index straight to OUT)."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    offs_k = tl.arange(0, K_PAD)
    offs_v = tl.arange(0, BLOCK)
    has_k = offs_k < K
    best = tl.full([K_PAD], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([K_PAD], dtype=tl.int64)
    row = LOGITS + b.to(tl.int64) * stride_lb
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for v0 in range(lo, hi, BLOCK):
        v = v0 + offs_v
        in_v = v < hi
        x = tl.load(row + v, mask=in_v, other=float("-inf")).to(tl.float32)
        m = tl.load(MASKS + offs_k[:, None] * stride_mk + v[None, :], mask=has_k[:, None] & in_v[None, :], other=0)
        xk = tl.where(m != 0, x[None, :], float("-inf"))          # [K_PAD, BLOCK]
        tile_best = tl.max(xk, axis=1)
        tile_i = tl.argmax(xk, axis=1, tie_break_left=True).to(tl.int64) + v0
        better = tile_best > best
        best = tl.where(better, tile_best, best)
        best_i = tl.where(better, tile_i, best_i)
    if DIRECT:
        tl.store(OUT + offs_k.to(tl.int64) * stride_ok + b, best_i, mask=has_k)
    else:
        B = tl.num_programs(0)
        at = (offs_k.to(tl.int64) * B + b) * SPLITS + s
        tl.store(PART_V + at, best, mask=has_k)
        tl.store(PART_I + at, best_i, mask=has_k)


@triton.jit(do_not_specialize=["K", "SPLITS"])
def _combine_kernel(PART_V, PART_I, OUT, stride_ok, K, SPLITS, K_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Row b: per mask, the index of the first split with the largest best value (the splits run in column
    order, so that is the first index overall)."""
    b = tl.program_id(0)
    B = tl.num_programs(0)
    offs_k = tl.arange(0, K_PAD)
    offs_s = tl.arange(0, S_PAD)
    ok = (offs_k[:, None] < K) & (offs_s[None, :] < SPLITS)
    at = (offs_k[:, None].to(tl.int64) * B + b) * SPLITS + offs_s[None, :]
    val = tl.load(PART_V + at, mask=ok, other=float("-inf"))
    idx = tl.load(PART_I + at, mask=ok, other=0)
    top = tl.max(val, axis=1)
    win = tl.min(tl.where(val == top[:, None], offs_s[None, :], S_PAD), axis=1)   # the first split holding it
    pick = tl.sum(tl.where(offs_s[None, :] == win[:, None], idx, 0), axis=1)
    tl.store(OUT + offs_k.to(tl.int64) * stride_ok + b, pick, mask=offs_k < K)


def masked_argmax_k_reference(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The torch form (see the module docstring)."""
    return torch.where(masks[:, None].to(logits.device), logits[None], float("-inf")).argmax(-1)


def masked_argmax_k(logits: torch.Tensor, masks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[K, B] int64 picks of `logits` [B, V] (last stride 1) under `masks` [K, V] (bool), written into `out`
    ([K, B] int64, last stride 1) when given (CUDA-graph friendly: no allocation)."""
    B, V = logits.shape
    K = masks.shape[0]
    assert masks.shape == (K, V) and masks.dtype == torch.bool and logits.stride(-1) == 1
    if out is None:
        out = torch.empty(K, B, dtype=torch.int64, device=logits.device)
    if logits.device.type != "cuda" and not interpreter_active():
        out.copy_(masked_argmax_k_reference(logits, masks))
        return out
    masks = masks.contiguous()
    assert out.shape == (K, B) and out.stride(-1) == 1
    tiles = triton.cdiv(V, BLOCK)
    splits = min(tiles, max(1, triton.cdiv(2 * sm_count(logits.device), B)))
    chunk = triton.cdiv(tiles, splits) * BLOCK
    splits = triton.cdiv(V, chunk)
    k_pad = triton.next_power_of_2(max(K, 1))
    direct = splits == 1
    part_v = out if direct else torch.empty(K, B, splits, dtype=torch.float32, device=logits.device)
    part_i = out if direct else torch.empty(K, B, splits, dtype=torch.int64, device=logits.device)
    _masked_argmax_kernel[(B, splits)](logits, logits.stride(0), masks.view(torch.int8), masks.stride(0), out,
                                       out.stride(0), part_v, part_i, V, K, chunk, splits, K_PAD=k_pad,
                                       BLOCK=BLOCK, DIRECT=direct)
    if not direct:
        _combine_kernel[(B,)](part_v, part_i, out, out.stride(0), K, splits, K_PAD=k_pad,  # (S_PAD: the most
                              S_PAD=triton.next_power_of_2(min(tiles, 2 * sm_count(logits.device))))  # splits)
    return out



class MaskedPicks:
    """`masked_argmax_k` under a fixed set of masks [K, V], where a mask that allows few tokens (at most
    1/SPARSE_SHARE of V: a UTF-8 character's continuations, ~70 of 49,152 tokens) is picked by gathering
    those tokens' logits instead of one more row of every tile (each mask row read with every tile costs
    about as much as the logits' own pass). Same picks: a mask's tokens are kept in increasing order, so the first of
    tied maxima wins; padding is -inf. CUDA-graph friendly once built (no host reads)."""

    def __init__(self, masks: torch.Tensor):
        K, V = masks.shape
        counts = masks.sum(1).tolist()
        sparse = [k for k, c in enumerate(counts) if 0 < c * SPARSE_SHARE <= V]
        dense = [k for k in range(K) if k not in sparse]
        dev = masks.device
        self.dense = masks[dense].contiguous()
        self._dense_at = torch.tensor(dense, dtype=torch.int64, device=dev)
        self._dense_first = dense == list(range(len(dense)))  # written in place: out[:len(dense)]
        self._sparse_at = torch.tensor(sparse, dtype=torch.int64, device=dev)
        width = max((counts[k] for k in sparse), default=0)
        self._tokens = torch.zeros(len(sparse), width, dtype=torch.int64, device=dev)
        self._pad = torch.ones(len(sparse), width, dtype=torch.bool, device=dev)
        for j, k in enumerate(sparse):
            ids = masks[k].nonzero()[:, 0]  # increasing
            self._tokens[j, :len(ids)] = ids
            self._pad[j, :len(ids)] = False

    def __call__(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [K, B] (int64, last stride 1) := the picks of `logits` [B, V] under each mask."""
        if len(self.dense):
            if self._dense_first:
                masked_argmax_k(logits, self.dense, out=out[:len(self.dense)])
            else:
                out.index_copy_(0, self._dense_at, masked_argmax_k(logits, self.dense))
        if len(self._tokens):
            tokens = self._tokens
            vals = logits[:, tokens.flatten()].view(-1, *tokens.shape).float().masked_fill(self._pad, float("-inf"))
            out.index_copy_(0, self._sparse_at, tokens.gather(1, vals.argmax(-1).T))
        return out
