"""Cache statistics, as `backend.stats()` reports them.

Hit rate is counted per prefill, as serving engines report it: `token_hit_rate` = tokens served from the
trie / prompt tokens the prefills needed (served + computed).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class TemplateStats:
    """The counters of one query template (a compiled query, named by its name or first line)."""

    calls: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_requested: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_reused / self.tokens_requested if self.tokens_requested else 0.0

    def record_prefill(self, requested: int, reused: int) -> None:
        self.lookups += 1
        self.hits += reused > 0
        self.tokens_requested += requested
        self.tokens_reused += reused
        self.tokens_prefilled += requested - reused


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_requested: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    evictions: int = 0
    bytes_in_use: int = 0
    nodes: int = 0
    pinned_nodes: int = 0
    per_template: dict[str, TemplateStats] = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_reused / self.tokens_requested if self.tokens_requested else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["token_hit_rate"] = self.token_hit_rate
        for name, t in self.per_template.items():
            d["per_template"][name]["token_hit_rate"] = t.token_hit_rate
        return d
