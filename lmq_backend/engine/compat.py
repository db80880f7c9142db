"""Every difference between the transformers versions lmq supports (5.17 to the newest) lives here.

- 5.24 renamed the forward argument `past_key_values=` to `cache=`.
- `Cache.crop` changed meaning in 5.15; lmq never crops: it builds caches from tensors and reads them back.
- `cache_position` is not passed: position ids are always explicit.
- 5.25 kernelizes every model `from_pretrained` loads (`use_kernels` defaults to on): on CUDA, ROCm and XPU a
  Llama's RMSNorm, SiLU and RoPE become kernels fetched from the Hugging Face Hub (Liger's RMSNorm, ...), and
  without the `kernels` package the load fails. lmq loads local folders only, never a hub, and the model's own
  forward is its reference (prefills, other models, the tests' exactness checks): `PRETRAINED` turns it off
  (5.17-5.24 took the argument, off by default).
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


# keyword arguments of every `from_pretrained` of a model (see the module's docstring)
PRETRAINED = {"use_kernels": False}


@lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes `cache` to this model's forward or generate (`cache=` from 5.24)."""
    return {_cache_argument(type(model)): cache}


def output_cache(output):
    """The cache a forward or `generate(return_dict_in_generate=True)` returned."""
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]] | None) -> DynamicCache:
    """A DynamicCache holding per-layer (K, V) of shape [B, H_kv, T, D] (an empty one for None)."""
    if not layers:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=layers)


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) tensors [B, H_kv, T, D] of a cache returned by a forward."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # pragma: no cover - older caches


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
            cache, logits_to_keep: int = 1):
    """One forward with an explicit cache (no mask: every row attends to all of it, causally); returns
    (logits [B, logits_to_keep, V], cache)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(model, cache))
    return out.logits, output_cache(out) or cache


class _PoolLayer(DynamicLayer):
    """One layer of a `KVPool` seen as a transformers cache layer, for a range of row slots whose cache
    starts at column `first`: `update` writes the new K/V into the rows' store slots (only where `write` is
    true, if given) and returns the K/V of every column read through the rows' page tables, [B, H, S, D]
    (gathered: a copy per layer, freed after it)."""

    def __init__(self, pool, layer: int, columns: torch.Tensor, length: int, write: torch.Tensor | None):
        super().__init__()
        self.k, self.v = pool.store.layer(layer)            # [N, H_kv, D] each
        self.columns, self.write = columns, write             # slots [B, S_total] of every column read
        self.device = self.k.device
        self.is_initialized = True
        self.length = length
        self.keys = self.values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        lo, hi = self.length, self.length + t
        slots = self.columns[:, lo:hi]                          # [B, T]
        for dst, new in ((self.k, key_states), (self.v, value_states)):
            new = new.transpose(1, 2)                           # [B, T, H, D]
            if self.write is None:
                dst[slots.reshape(-1)] = new.reshape(-1, *new.shape[2:]).to(dst.dtype)
            else:
                dst[slots[self.write]] = new[self.write].to(dst.dtype)
        self.length = hi
        cols = self.columns[:, :hi]
        self.keys, self.values = self.k[cols].transpose(1, 2), self.v[cols].transpose(1, 2)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length


def pool_cache(pool, rows: slice, first: int, length: int, new: int, write: torch.Tensor | None = None) -> Cache:
    """A transformers cache over slots `rows` of `pool` (a `KVPool`): columns [first, first + length) are
    the cache, a forward of `new` tokens appends after them. `write` [B, T] bool limits which new tokens
    are stored (padding is not)."""
    columns = pool.columns(rows, first, first + length + new)
    write = None if write is None else write.to(columns.device)
    return Cache(layers=[_PoolLayer(pool, i, columns, length, write) for i in range(pool.shape[0])])


POOL_ATTENTION = "lmq_grouped"


def pool_mask(**kwargs):
    """The mask function of lmq's attention: None (plain causal attention of the new tokens, aligned to the
    last column) when nothing is padded, where transformers' sdpa mask would build an explicit one after a
    cache hit; otherwise transformers' sdpa mask. transformers calls mask functions by keyword (5.17+)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and kwargs.get("mask_function") is causal_mask_function):
        return None
    return sdpa_mask(**kwargs)


def use_grouped_attention(model) -> bool:
    """Route the model's attention through `attention.grouped_attention` (with sdpa's boolean masks).
    Returns False, leaving the model as it is, where this transformers version or model cannot."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import grouped_attention

    AttentionInterface.register(POOL_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(POOL_ATTENTION, pool_mask)
    try:
        model.set_attn_implementation(POOL_ATTENTION)
    except (ValueError, AttributeError, KeyError):
        return False
    return True


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config, across architectures' attribute names."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return layers, kv_heads, head_dim
