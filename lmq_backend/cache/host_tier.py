"""`HostTier`: segments of evicted trie nodes in host memory, under a byte budget, least recently used first out.

On a GPU machine the segments' K/V live in pinned memory (they come down and go back up with asynchronous
copies: `cache/tiers.py`), each block from torch's pinned allocator, which rounds a block up to a power of
two bytes: a pinned tier counts each segment at that size, so the memory it holds stays within its budget. On a CPU backend the K/V store is host memory already, so a host tier there only
adds a second copy of what a larger `cache_budget` would keep in place: `HFBackend` leaves it off on the CPU
unless `host_cache=` is given (then it works the same, in plain memory).

Lookup: segments are indexed by (start, first token), so a sequence whose device match ends at `start`
finds its candidates with one dict lookup and checks them exactly (`Segment.continues`). The tier knows
nothing of the trie, the store or the device. Not thread-safe (the backend's event loop thread uses it).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .segment import Segment


def held_bytes(nbytes: int, pinned: bool) -> int:
    """The host memory a segment of `nbytes` of K/V holds: a pinned block is a power of two bytes."""
    return 1 << max(nbytes - 1, 0).bit_length() if pinned else nbytes


class HostTier:
    def __init__(self, budget_bytes: int, pinned: bool = False):
        if budget_bytes < 0:
            raise ValueError("host tier budget must be >= 0")
        self.budget_bytes = int(budget_bytes)
        self.pinned = pinned
        self.bytes_in_use = 0
        self._lru: OrderedDict[tuple[int, str], Segment] = OrderedDict()   # oldest first
        self._by_head: dict[tuple[int, int], list[Segment]] = {}           # (start, first token) -> segments

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self):
        """The segments held, least recently used first."""
        return iter(list(self._lru.values()))

    def starts(self, start: int, token: int) -> bool:
        """Does any segment start at `start` with `token`?"""
        return (start, token) in self._by_head

    def covering(self, ids: np.ndarray, start: int) -> Segment | None:
        """A segment that holds the K/V of tokens [start, len(ids)) of `ids` (int32): it begins at or before
        `start` and continues `ids` to their end. Touches it. (A trie node evicted after a split, or after a
        load that took only part of a segment, is held already.)"""
        end = len(ids)
        for name, seg in reversed(self._lru.items()):  # the most recently used first
            if seg.start <= start and seg.end >= end and seg.ids[end - 1] == ids[end - 1] \
                    and np.array_equal(seg.ids[:end], ids):
                self._lru.move_to_end(name)
                return seg
        return None

    def put(self, seg: Segment) -> list[Segment]:
        """Keep `seg` (if it fits the budget at all), dropping the least recently used segments to make room;
        returns the segments that left (`seg` itself when it is larger than the budget), for a lower tier.
        A segment held already is only touched; the segments `seg` holds all of leave without a word (they
        are not returned: `seg` goes down in their place)."""
        name = (seg.start, seg.key)
        if name in self._lru:
            self._lru.move_to_end(name)
            return []
        held = held_bytes(seg.nbytes, self.pinned)
        if held > self.budget_bytes:
            return [seg]
        for old in [s for s in self._lru.values() if seg.start <= s.start and s.end <= seg.end
                    and np.array_equal(s.ids, seg.ids[:s.end])]:
            self._drop((old.start, old.key))
        dropped = []
        while self.bytes_in_use + held > self.budget_bytes:
            dropped.append(self._drop(next(iter(self._lru))))
        self._lru[name] = seg
        self._by_head.setdefault((seg.start, int(seg.ids[seg.start])), []).append(seg)
        self.bytes_in_use += held
        return dropped

    def find(self, ids: list[int], ids32: np.ndarray | None, start: int, limit: int,
             past: int | None = None) -> tuple[Segment | None, int]:
        """The segment starting at `start` that continues `ids` furthest (short of `limit`), and how many of its
        tokens do; with `past`, only one that continues them beyond position `past` (a match ending there: a
        segment that starts before it may hold what follows). Touches it. `ids32`: the same ids as int32
        (built here when None and needed)."""
        past = start if past is None else past
        if not start <= past < limit:
            return None, 0
        candidates = self._by_head.get((start, ids[start]))
        if not candidates:
            return None, 0
        token = ids[past]
        candidates = [seg for seg in candidates if seg.end > past and seg.ids[past] == token]
        if not candidates:
            return None, 0
        if ids32 is None:
            ids32 = np.asarray(ids, dtype=np.int32)
        best, most = None, past - start
        for seg in candidates:
            k = seg.continues(ids32, limit)
            if k > most:
                best, most = seg, k
        if best is None:
            return None, 0
        self._lru.move_to_end((best.start, best.key))
        return best, most

    def clear(self) -> None:
        self._lru.clear()
        self._by_head.clear()
        self.bytes_in_use = 0

    def check(self) -> None:
        """Assert the bookkeeping (for tests)."""
        held = sum(held_bytes(s.nbytes, self.pinned) for s in self._lru.values())
        assert self.bytes_in_use == held <= self.budget_bytes
        indexed = [s for segs in self._by_head.values() for s in segs]
        assert len(indexed) == len(self._lru) and all(self._lru[(s.start, s.key)] is s for s in indexed)

    def _drop(self, name: tuple[int, str]) -> Segment:
        seg = self._lru.pop(name)
        head = (seg.start, int(seg.ids[seg.start]))
        rest = [s for s in self._by_head[head] if s is not seg]
        if rest:
            self._by_head[head] = rest
        else:
            del self._by_head[head]
        self.bytes_in_use -= held_bytes(seg.nbytes, self.pinned)
        return seg
