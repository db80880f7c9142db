"""Prefix-aware routing with a load-balancing fallback, after SGLang's cache-aware router.

Each replica has an `ApproxPrefixTree` of the prompt text routed to it. A call goes to:
1. the least-loaded replica when loads are too uneven: max - min > `balance_abs` and max > `balance_rel` * min
   (load = calls in flight);
2. else the replica whose tree matches the most of the call's text, when that match covers more than
   `cache_threshold` of the text (ties: the less loaded one);
3. else the replica with the smallest tree (the most room for a new prefix; ties: the less loaded one).
The text is then inserted into the chosen replica's tree, so that calls that follow go where it went. A replica
started in place of a lost one may take over the lost one's tree (`add`): where the replicas share a disk tier,
the lost replica's prefixes are on disk, and its calls keep going to one replica, which warms them from there.
Pure Python; the cluster (`cluster.py`) calls `choose` (which counts the call as started there) before a
dispatch and `finished` after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .prefix_tree import ApproxPrefixTree


@dataclass(slots=True)
class RouterConfig:
    cache_threshold: float = 0.5  # share of the text that must match for a prefix-affine choice
    balance_abs: int = 32         # loads are uneven when max - min exceeds this ...
    balance_rel: float = 1.5      # ... and max exceeds this multiple of min
    max_tree_chars: int = 2**22   # per replica; least-recently-used leaves are dropped beyond it


@dataclass(slots=True)
class RouteCounts:
    """How calls were routed: by prefix match, to the smallest tree, or to the least loaded."""

    prefix: int = 0
    smallest_tree: int = 0
    least_loaded: int = 0


@dataclass
class Router:
    config: RouterConfig = field(default_factory=RouterConfig)
    trees: dict[int, ApproxPrefixTree] = field(default_factory=dict)
    loads: dict[int, int] = field(default_factory=dict)
    counts: RouteCounts = field(default_factory=RouteCounts)

    def add(self, replica: int, tree: ApproxPrefixTree | None = None) -> None:
        """A replica to route to, with the text routed to it so far (`tree`: a lost replica's, whose prefixes the
        new one finds on a disk tier they share; None: none)."""
        self.trees[replica] = tree if tree is not None else ApproxPrefixTree(self.config.max_tree_chars)
        self.loads[replica] = 0

    def remove(self, replica: int) -> ApproxPrefixTree | None:
        """A replica is gone: its tree is forgotten (its device cache went with it), and returned."""
        self.loads.pop(replica, None)
        return self.trees.pop(replica, None)

    @property
    def replicas(self) -> list[int]:
        return list(self.trees)

    def choose(self, text: str, weight: int = 1) -> int:
        """The replica for a call whose prompt starts with `text`; counts `weight` calls as started there."""
        if not self.trees:
            raise LookupError("no replica to route to")
        loads = self.loads
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.config.balance_abs and hi > self.config.balance_rel * lo:
            replica = min(loads, key=loads.get)
            self.counts.least_loaded += 1
        else:
            matches = {r: tree.match(text) for r, tree in self.trees.items()}
            best = max(matches.values())
            if text and best > self.config.cache_threshold * len(text):
                replica = min((r for r in matches if matches[r] == best), key=loads.get)
                self.counts.prefix += 1
            else:
                replica = min(self.trees, key=lambda r: (self.trees[r].size, loads[r]))
                self.counts.smallest_tree += 1
        self.trees[replica].insert(text)
        self.started(replica, weight)
        return replica

    def started(self, replica: int, weight: int = 1) -> None:
        if replica in self.loads:
            self.loads[replica] += weight

    def finished(self, replica: int, weight: int = 1) -> None:
        if replica in self.loads:
            self.loads[replica] = max(0, self.loads[replica] - weight)
