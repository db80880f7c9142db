"""Every difference between the transformers versions lmq supports (5.17 to the newest) lives here.

- 5.24 renamed the forward argument `past_key_values=` to `cache=`.
- `Cache.crop` changed meaning in 5.15; lmq never crops: it builds caches from tensors and reads them back.
- `cache_position` is not passed: position ids are always explicit.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import transformers
from transformers import DynamicCache

TRANSFORMERS_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())


@lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            cache, logits_to_keep: int = 1):
    """One forward with an explicit cache; returns (logits [B, logits_to_keep, V], cache)."""
    kwargs = {_cache_argument(type(model)): cache}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    return out.logits, new_cache
