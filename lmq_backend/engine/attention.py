"""Attention for the model's own forwards (prefills; decode steps of models without a fused step):
grouped-query attention straight on the pool's K/V views.

Hugging Face's sdpa path copies K/V of a batch up to three times per layer (non-contiguous views,
`repeat_kv` for GQA); on a CPU, where a batch of rows sharing a long cached prefix is memory-bound,
those copies cost more than the attention itself. This function hands the pool's views (any strides) to
torch's fused CPU attention with `enable_gqa`, so a batch costs one blocked pass over its cache and never
materialises the [queries x columns] scores (less than half the time of a masked softmax over explicit
scores, for a few rows over a thousand columns).

A single query per row (a decode step) folds each kv head's group of query heads into the query axis:
[B, Hq, 1, D] is read as [B, Hkv, Hq/Hkv, D], plain attention of Hq/Hkv queries over one kv head, so the
kernel never expands K/V for GQA.

Without padding the model's forward passes no mask (`compat.pool_mask`): the T new queries attend causally
to the S columns ending with theirs, whatever came from the cache before them. On a GPU that is flash
attention with a lower-right causal bias; Hugging Face's own mask for it (T != S after a cache hit) is an
explicit [T, S] tensor, which rules flash attention out.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# Every backend of torch's fused attention but cuDNN's: cuDNN builds an execution plan for every new shape
# (host time in the first prefill of each new prompt length, where flash attention's costs nothing), and a
# query engine sees a new length at every call.
_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The columns (cached + new tokens of every row) that one prefill's attention may gather, every layer: the
# model's forward and the torch paths copy them ([rows x columns] of K and V a layer); the kernels that
# read through the page tables do not (`ModelRunner.prefill_read_limit`).
PREFILL_READ = 131072


def model_attention(device: torch.device):
    """The context the engine runs the model's forwards in: on a GPU, torch's fused attention without the
    cuDNN backend (see _GPU_BACKENDS); on the CPU, nothing to change."""
    return sdpa_kernel(_GPU_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D]; key, value [B, Hkv, S, D]; attention_mask bool [B, 1, T, S] (True: attend) or
    None for plain causal attention of the T queries ending at column S. A query that may attend to
    nothing (a padding position) gets zeros. Returns ([B, T, Hq, D], None)."""
    t, s = query.shape[2], key.shape[2]
    cuda = query.device.type == "cuda"
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > -1  # an additive float mask: 0 where allowed
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    if t == 1 and hq != hkv and (attention_mask is None or attention_mask.shape[1] == 1):
        # one query a row: the group's query heads are the queries of their kv head (the row's mask
        # [B, 1, 1, S] broadcasts over them)
        out = F.scaled_dot_product_attention(query.reshape(b, hkv, hq // hkv, d), key, value,
                                             attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, hq, d), None
    if cuda and hq != hkv:
        # torch's GPU kernels take GQA in flash attention only (bf16/fp16, no mask): expand K/V as transformers
        # does, so that every case (masked, float32) has a fused kernel (the copy is cheap next to it)
        key, value = (x.repeat_interleave(hq // hkv, dim=1) for x in (key, value))
    if attention_mask is None and t > 1:  # causal, aligned to the last column (SDPA's is_causal is not)
        if cuda:  # flash or memory-efficient attention, both take a lower-right causal bias as it is
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(t, s),
                                                 scale=scaling)
            return out.transpose(1, 2), None
        last = torch.arange(s - t, s, device=query.device)[:, None]
        attention_mask = torch.arange(s, device=query.device)[None, :] <= last
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != hq)
    return out.transpose(1, 2), None
