"""The greedy pick of every row under each of K token masks, in one pass over the logits.

``masked_argmax_k(logits [B, V], masks bool [K, V]) -> int64 [K, B]``: entry ``[k, b]`` is the index of the
largest ``logits[b, v]`` with ``masks[k, v]``, the first such index on ties, 0 where the mask allows nothing:
``torch.where(masks[:, None], logits[None], -inf).argmax(-1)`` (``lmq_backend/engine/picks.py``), without
materialising the ``[K, B, V]`` copy. The fused GPU step picks this way under its greedy masks (an H200,
256 rows x 128,256 tokens, two masks: the torch form wrote and re-read 130 MB a step, ~265 us).

Kernel: one program a row walks V in tiles of ``BLOCK`` with every mask at once (``K_PAD`` rows of a tile),
keeping per mask the best value and its index; a tile's maximum replaces the running one only when strictly
greater, so the first index wins ties, as ``torch.argmax``. Logits hold no NaN (a model's logits).

On CPU tensors the kernel runs through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` was imported (tests); otherwise the torch form runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import interpreter_active

__all__ = ["masked_argmax_k", "masked_argmax_k_reference"]

BLOCK = 1024


@triton.jit
def _masked_argmax_kernel(LOGITS, stride_lb, MASKS, stride_mk, OUT, stride_ok, V, K,
                          K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs_k = tl.arange(0, K_PAD)
    offs_v = tl.arange(0, BLOCK)
    has_k = offs_k < K
    best = tl.full([K_PAD], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([K_PAD], dtype=tl.int64)
    row = LOGITS + b.to(tl.int64) * stride_lb
    for v0 in range(0, V, BLOCK):
        v = v0 + offs_v
        in_v = v < V
        x = tl.load(row + v, mask=in_v, other=float("-inf")).to(tl.float32)
        m = tl.load(MASKS + offs_k[:, None] * stride_mk + v[None, :], mask=has_k[:, None] & in_v[None, :], other=0)
        xk = tl.where(m != 0, x[None, :], float("-inf"))          # [K_PAD, BLOCK]
        tile_best = tl.max(xk, axis=1)
        tile_i = tl.argmax(xk, axis=1, tie_break_left=True).to(tl.int64) + v0
        better = tile_best > best
        best = tl.where(better, tile_best, best)
        best_i = tl.where(better, tile_i, best_i)
    tl.store(OUT + offs_k.to(tl.int64) * stride_ok + b, best_i, mask=has_k)


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
    _masked_argmax_kernel[(B,)](logits, logits.stride(0), masks.view(torch.int8), masks.stride(0), out, out.stride(0), V, K,
                                K_PAD=triton.next_power_of_2(max(K, 1)), BLOCK=BLOCK)
    return out
