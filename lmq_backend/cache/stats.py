"""Cache statistics, as `backend.stats()` reports them, and a table of them for people.

What is counted
---------------
Every time a hole is filled or a `distribution` is scored, the backend *prefills*: it needs the K/V of
every prompt token so far. It looks the prompt's token ids up in the prefix trie (one *lookup*), takes
the longest cached prefix from the trie (*reused* tokens) and computes the rest (*prefilled* tokens).
A lookup that reuses at least one token is a *hit*.

- ``tokens_requested``: prompt tokens the prefills needed, summed over prefills (= reused + prefilled).
- ``tokens_reused``: of those, tokens served from the trie.
- ``tokens_prefilled``: of those, tokens computed by the model.
- ``token_hit_rate`` = ``tokens_reused / tokens_requested``: the share of prompt tokens served from the
  cache, counted per prefill as serving engines count it (SGLang's cache hit rate is
  cached / (cached + new) over prefills). A query with two holes prefills twice, and the second prefill
  usually reuses the first's prompt and generated value, so it counts twice. The last prompt token is
  always computed (its logits pick the next token), so an exact repeat of a prompt of N tokens reuses
  N - 1 of them.
- ``tokens_decoded``: generated tokens fed back through the model, one forward each; not part of the
  hit rate.
- ``evictions``: trie nodes dropped to stay within the cache budget since the last ``reset_stats()``.
- ``bytes_in_use``, ``nodes``, ``pinned_nodes``: the trie now (gauges, not reset by ``reset_stats()``).

The cache tiers under the trie (``cache/tiers.py``; all 0 without them). Tokens loaded back from a tier count
as reused, like the trie's own:

- ``host_hits``, ``disk_hits``: prefill lookups that loaded tokens from host memory, from disk files.
- ``tokens_from_host``, ``tokens_from_disk``: the tokens they loaded (part of ``tokens_reused``).
- ``bytes_to_host``, ``bytes_from_host``: K/V copied down to host memory (evictions), and loaded back up.
- ``bytes_to_disk``, ``bytes_from_disk``: K/V files written, and read (whole files, checks included).
- ``disk_rejected``: files ignored (torn, truncated, corrupted, or of another model, dtype or layout).
- ``host_bytes_in_use``: the host tier now (a gauge).

Counters are kept in total and per query template (``per_template``, keyed by ``Query.name``: the
function name for ``@lmq.query``, else the ``name=`` given, else the first line of the source that is not the
decoder clause alone; ``lmq run``/``lmq profile`` name a file's query by its path). Each template also records
the wall time of each call (``latencies``, seconds; the most recent LATENCY_WINDOW calls, so that a server's
statistics stay the same size), summarised as ``p50``/``p95``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields

_COUNTERS = ("calls", "lookups", "hits", "tokens_requested", "tokens_reused", "tokens_prefilled", "tokens_decoded")
LATENCY_WINDOW = 10_000  # the calls a template's latencies keep, the most recent (p50 / p95 are over them)
TIER_COUNTERS = ("host_hits", "disk_hits", "tokens_from_host", "tokens_from_disk", "bytes_to_host",
                 "bytes_from_host", "bytes_to_disk", "bytes_from_disk", "disk_rejected")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, interpolated linearly between ranks (as numpy's default);
    None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


class _Rates:
    """Hit rates and latency percentiles, derived from the counters of TemplateStats and CacheStats."""

    __slots__ = ()

    @property
    def token_hit_rate(self) -> float:
        """tokens_reused / tokens_requested (0.0 before any prefill)."""
        return _rate(self.tokens_reused, self.tokens_requested)

    @property
    def lookup_hit_rate(self) -> float:
        """hits / lookups: the share of prefills that reused at least one token."""
        return _rate(self.hits, self.lookups)

    @property
    def p50(self) -> float | None:
        """Median call latency in seconds (None before any call)."""
        return percentile(self.latencies, 50)

    @property
    def p95(self) -> float | None:
        """95th-percentile call latency in seconds (None before any call)."""
        return percentile(self.latencies, 95)


@dataclass(slots=True)
class TemplateStats(_Rates):
    """The counters of one query template (a compiled query, named by its name or first line)."""

    calls: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_requested: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, one per finished call (the latest ones)

    @classmethod
    def live(cls) -> "TemplateStats":
        """A template's record as a backend keeps it: its latencies the last LATENCY_WINDOW calls'."""
        return cls(latencies=deque(maxlen=LATENCY_WINDOW))

    def record_call(self, seconds: float) -> None:
        self.calls += 1
        self.latencies.append(seconds)

    def record_prefill(self, requested: int, reused: int) -> None:
        self.lookups += 1
        self.hits += reused > 0
        self.tokens_requested += requested
        self.tokens_reused += reused
        self.tokens_prefilled += requested - reused

    def copy(self) -> "TemplateStats":
        """A snapshot (its latencies a list of their own)."""
        return TemplateStats(*(getattr(self, f) for f in _COUNTERS), latencies=list(self.latencies))

    def as_dict(self, latencies: bool = False) -> dict:
        """JSON-ready: the counters, the hit rates and p50/p95 (seconds; null before any call). The raw
        latency list only with `latencies=True`."""
        d = {f: getattr(self, f) for f in _COUNTERS}
        d.update(token_hit_rate=self.token_hit_rate, lookup_hit_rate=self.lookup_hit_rate,
                 p50_seconds=self.p50, p95_seconds=self.p95)
        if latencies:
            d["latencies"] = list(self.latencies)
        return d


@dataclass(slots=True)
class CacheStats(_Rates):
    """A backend's cache statistics (`backend.stats()`); see the module docstring for the definitions."""

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
    host_hits: int = 0
    disk_hits: int = 0
    tokens_from_host: int = 0
    tokens_from_disk: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    disk_rejected: int = 0
    host_bytes_in_use: int = 0

    @property
    def calls(self) -> int:
        """Finished query calls, over all templates."""
        return sum(t.calls for t in self.per_template.values())

    @property
    def latencies(self) -> list[float]:
        """Every call's latency (seconds), over all templates."""
        return [x for t in self.per_template.values() for x in t.latencies]

    def since(self, earlier: "CacheStats") -> "CacheStats":
        """The counters accumulated between `earlier` and this snapshot (both from the same backend, with
        no `reset_stats()` between); the gauges (bytes in use, nodes) are this snapshot's. Latencies are
        those of the calls after `earlier` (as many of them as this snapshot still holds)."""
        out = CacheStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(CacheStats)
                            if f.name in _COUNTERS or f.name in TIER_COUNTERS or f.name == "evictions"},
                         bytes_in_use=self.bytes_in_use, nodes=self.nodes, pinned_nodes=self.pinned_nodes,
                         host_bytes_in_use=self.host_bytes_in_use)
        for name, t in self.per_template.items():
            e = earlier.per_template.get(name, TemplateStats())
            d = TemplateStats(*(getattr(t, f) - getattr(e, f) for f in _COUNTERS))
            kept = list(t.latencies)
            d.latencies = kept[len(kept) - min(d.calls, len(kept)):]
            if any(getattr(d, f) for f in _COUNTERS):
                out.per_template[name] = d
        return out

    def as_dict(self, latencies: bool = False) -> dict:
        """JSON-ready (`json.dumps` takes it as is): the counters, gauges, hit rates, the number of calls,
        p50/p95 latency in seconds (null before any call) in total and per template. The raw latency
        lists only with `latencies=True`."""
        d = {f.name: getattr(self, f.name) for f in fields(CacheStats) if f.name != "per_template"}
        d.update(calls=self.calls, token_hit_rate=self.token_hit_rate, lookup_hit_rate=self.lookup_hit_rate,
                 p50_seconds=self.p50, p95_seconds=self.p95,
                 per_template={name: t.as_dict(latencies) for name, t in self.per_template.items()})
        return d


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One model forward of the engine, as `backend.on_step(callback)` reports it."""

    kind: str            # "prefill", "decode" or "score"
    batch_size: int      # rows in the forward
    new_tokens: int      # tokens computed in this forward (all rows)
    cached_tokens: int   # tokens the rows attended to from the cache (served from the trie or earlier steps)
    seconds: float       # wall time of the forward


# ----- for people ---------------------------------------------------------------------------------------

def format_bytes(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as `cache_budget="2GB"` reads them)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _short(name: str, width: int) -> str:
    name = " ".join(name.split())  # a first line of source may hold tabs; keep the table on one line
    if len(name) <= width:
        return name
    if "/" in name and " " not in name:  # a file's path: its end names it
        return "…" + name[-(width - 1):]
    return name[: width - 1] + "…"


def format_table(stats: CacheStats, name_width: int = 36) -> str:
    """The statistics as a plain-text table: one row per template and a total row (calls, prompt tokens,
    reused, prefilled, token hit rate, decoded, p50/p95 latency), then the trie's state."""
    headers = ("template", "calls", "prompt tok", "reused", "prefilled", "hit rate", "decoded", "p50 ms", "p95 ms")

    def row(name: str, calls: int, t, p50, p95):
        return (_short(name, name_width), str(calls), str(t.tokens_requested), str(t.tokens_reused),
                str(t.tokens_prefilled), f"{100 * t.token_hit_rate:.1f}%", str(t.tokens_decoded), _ms(p50), _ms(p95))

    rows = [row(name, t.calls, t, t.p50, t.p95) for name, t in sorted(stats.per_template.items())]
    total = row("total", stats.calls, stats, stats.p50, stats.p95)
    widths = [max(len(r[i]) for r in [headers, *rows, total]) for i in range(len(headers))]

    def line(r) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "-" * len(line(headers))
    out = [line(headers), rule, *(line(r) for r in rows)]
    if rows:
        out.append(rule)
    out.append(line(total))
    out.append("")
    out.append(f"cache: {stats.lookups} lookups, {stats.hits} hits; {stats.evictions} evictions; "
               f"{format_bytes(stats.bytes_in_use)} in use in {stats.nodes} nodes ({stats.pinned_nodes} pinned)")
    if any(getattr(stats, name) for name in TIER_COUNTERS) or stats.host_bytes_in_use:
        out.append(f"tiers: host {stats.host_hits} hits, {stats.tokens_from_host} tokens "
                   f"({format_bytes(stats.bytes_to_host)} down, {format_bytes(stats.bytes_from_host)} up, "
                   f"{format_bytes(stats.host_bytes_in_use)} held); disk {stats.disk_hits} hits, "
                   f"{stats.tokens_from_disk} tokens ({format_bytes(stats.bytes_to_disk)} written, "
                   f"{format_bytes(stats.bytes_from_disk)} read, {stats.disk_rejected} files ignored)")
    out.append("hit rate = prompt tokens served from the prefix cache / prompt tokens the prefills needed")
    return "\n".join(out)
