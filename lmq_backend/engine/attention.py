"""Attention for the torch path (CPU): grouped-query attention straight on the pool's K/V views.

Hugging Face's sdpa path copies K/V of a batch up to three times per layer (non-contiguous views,
`repeat_kv` for GQA); on a CPU, where a batch of rows sharing a long cached prefix is memory-bound,
those copies cost more than the attention itself. This function reads K/V in place (any strides), and
groups the query heads of each K/V head, so a batch costs one pass over its cache.
"""
from __future__ import annotations

import math

import torch

SCORE_BYTES = 256 * 2**20  # chunk the queries so that one block of scores stays below this


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D]; key, value [B, Hkv, S, D]; attention_mask bool [B, 1, T, S] (True: attend) or
    None for plain causal attention of the T queries ending at column S. Returns ([B, T, Hq, D], None)."""
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(d)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > -1  # an additive float mask: 0 where allowed
    out = torch.empty(b, hkv, g, t, d, dtype=query.dtype, device=query.device)
    q = query.view(b, hkv, g, t, d)
    key_t = key.transpose(-1, -2)  # [B, Hkv, D, S]: a view; the matmuls read K/V in place
    step = max(1, SCORE_BYTES // max(1, b * hq * s * 4))
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        n = hi - lo
        scores = torch.matmul(q[:, :, :, lo:hi].reshape(b, hkv, g * n, d), key_t).float().mul_(scaling)
        scores = scores.view(b, hkv, g, n, s)
        if attention_mask is not None:
            allowed = attention_mask[:, :, lo:hi, :][:, :, None]  # [B, 1, 1, n, S]
        else:
            rows = torch.arange(lo, hi, device=query.device)[:, None] + (s - t)
            allowed = torch.arange(s, device=query.device)[None, :] <= rows
        scores.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(value.dtype)  # a fully masked (pad) query gives 0
        out[:, :, :, lo:hi] = torch.matmul(probs.view(b, hkv, g * n, s), value).view(b, hkv, g, n, d)
    return out.view(b, hq, t, d).transpose(1, 2), None
