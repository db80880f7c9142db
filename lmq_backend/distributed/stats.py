"""Cache statistics over replicas: `CacheStats` summed (counters and gauges; per template, latencies pooled)."""
from __future__ import annotations

from dataclasses import fields

from ..cache.stats import CacheStats, TemplateStats

_TEMPLATE_COUNTERS = [f.name for f in fields(TemplateStats) if f.name != "latencies"]
_CACHE_NUMBERS = [f.name for f in fields(CacheStats) if f.name != "per_template"]


def sum_stats(parts: list[CacheStats]) -> CacheStats:
    """One `CacheStats` for several replicas: every counter and gauge summed (bytes in use and nodes add
    up: each replica has its own trie), per-template counters summed and their latencies pooled, so the
    hit rates are over all prefills of the cluster."""
    total = CacheStats(**{name: sum(getattr(p, name) for p in parts) for name in _CACHE_NUMBERS})
    for part in parts:
        for name, t in part.per_template.items():
            acc = total.per_template.setdefault(name, TemplateStats())
            for counter in _TEMPLATE_COUNTERS:
                setattr(acc, counter, getattr(acc, counter) + getattr(t, counter))
            acc.latencies.extend(t.latencies)
    return total
