"""Plain-torch ground truth for :func:`lmq_kernels.triton.decode_attention`.

Same cache layout as the kernel (see ``decode_attention.py``): per layer
``k_cache, v_cache: [B, H_kv, S, D]``, rows left-padded, row ``b``'s valid
tokens in columns ``[start[b], end)``.  Everything outside that range is
masked, whatever it holds (NaN/inf padding included).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = ["decode_attention_reference"]


def _end_value(end: Union[int, torch.Tensor]) -> int:
    if isinstance(end, torch.Tensor):
        return int(end.reshape(-1)[0].item())
    return int(end)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    end: Union[int, torch.Tensor],
    sm_scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of one new query token per row over its valid cache columns.

    q ``[B, Hq, D]``; k_cache/v_cache ``[B, H_kv, S, D]``; start int ``[B]``;
    end int or 1-element tensor.  Query head ``h`` reads KV head ``h // G``
    (``G = Hq // H_kv``, as Hugging Face's ``repeat_kv``).  Computed in
    ``compute_dtype`` (float32 by default; pass float64 for a tighter truth),
    returned in ``q.dtype``.  A row with no valid token returns zeros.
    """
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k_cache.shape
    assert Bk == B and Dk == D and v_cache.shape == k_cache.shape
    assert Hq % Hkv == 0
    G = Hq // Hkv
    e = _end_value(end)
    assert 0 <= e <= S
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    k = k_cache[:, :, :e].to(compute_dtype)
    v = v_cache[:, :, :e].to(compute_dtype)
    if G > 1:
        k = k.repeat_interleave(G, dim=1)
        v = v.repeat_interleave(G, dim=1)
    cols = torch.arange(e, device=q.device)
    st = start.to(device=q.device, dtype=torch.long).view(B, 1)
    valid = cols.view(1, e) >= st  # [B, e]
    valid4 = valid.view(B, 1, 1, e)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(compute_dtype), torch.where(valid4.transpose(-1, -2), k, 0)).unsqueeze(2)
    scores = scores * sm_scale
    scores = scores.masked_fill(~valid4, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows without any valid token
    out = torch.einsum("bhs,bhsd->bhd", probs.squeeze(2), torch.where(valid4.transpose(-1, -2), v, 0))
    return out.to(q.dtype)

