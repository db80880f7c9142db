"""`HostTier`: segments of evicted trie nodes in host memory, under a byte budget, least recently used first out.

On a GPU machine the segments' K/V live in pinned memory (they come down and go back up with asynchronous
copies: `cache/tiers.py`): the tier's `arena` (`host_arena.py`), its whole budget pinned once, whose regions
`reserve` hands out (making room as `put` does); a segment counts at its region's size. On a CPU backend the K/V
store is host memory already, so a host tier there only adds a second copy of what a larger `cache_budget` would
keep in place: `HFBackend` leaves it off on the CPU unless `host_cache=` is given (then it works the same, in
plain memory, with no arena).

Lookup: segments are indexed by (start, first token), so a sequence whose device match ends at `start`
finds its candidates with one dict lookup and checks them exactly (`Segment.continues`). The tier knows
nothing of the trie, the store or the device. Not thread-safe (the backend's event loop thread uses it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

import torch

from .host_arena import HostArena, region_bytes, tensor_bytes
from .segment import Segment


class HostTier:
    def __init__(self, budget_bytes: int, arena: HostArena | None = None):
        """`arena`: the memory the segments' K/V live in (`reserve`; its size is the budget); None: segments bring
        their own memory."""
        if budget_bytes < 0:
            raise ValueError("host tier budget must be >= 0")
        self.arena = arena
        self.budget_bytes = int(budget_bytes) if arena is None else arena.nbytes
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

    def held_bytes(self, nbytes: int) -> int:
        """The host memory a segment of `nbytes` of K/V holds (its arena region's size)."""
        return nbytes if self.arena is None else region_bytes(nbytes)

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype,
                down: Callable[[Segment], object]) -> torch.Tensor | None:
        """(With an arena) memory for a segment's K/V of `shape` and `dtype` (None: larger than the budget). Room
        is made as `put` makes it, the least recently used segments dropped, each handed to `down` (a lower tier)
        at once; where the free regions are too small, more go. While segments dropped earlier are still held
        (a disk tier writing them), so that the arena is short of free bytes, the K/V gets pinned memory of its
        own instead: the budget counts the tier's own segments, so this is at most what is held that way."""
        size = region_bytes(tensor_bytes(shape, dtype))
        if size > self.budget_bytes:
            return None
        self._make_room(size, down)
        while (kv := self.arena.tensor(shape, dtype)) is None:
            if self.arena.nbytes - self.arena.bytes_in_use < size or not self._lru:
                return torch.empty(shape, dtype=dtype, pin_memory=self.arena.pinned)
            down(self._drop(next(iter(self._lru))))
        return kv

    def put(self, seg: Segment) -> list[Segment]:
        """Keep `seg` (if it fits the budget at all), dropping the least recently used segments to make room;
        returns the segments that left (`seg` itself when it is larger than the budget), for a lower tier.
        A segment held already is only touched; the segments `seg` holds all of leave without a word (they
        are not returned: `seg` goes down in their place)."""
        name = (seg.start, seg.key)
        if name in self._lru:
            self._lru.move_to_end(name)
            return []
        held = self.held_bytes(seg.nbytes)
        if held > self.budget_bytes:
            return [seg]
        for old in [s for s in self._lru.values() if seg.start <= s.start and s.end <= seg.end
                    and np.array_equal(s.ids, seg.ids[:s.end])]:
            self._drop((old.start, old.key))
        dropped: list[Segment] = []
        self._make_room(held, dropped.append)
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
        held = sum(self.held_bytes(s.nbytes) for s in self._lru.values())
        assert self.bytes_in_use == held <= self.budget_bytes
        indexed = [s for segs in self._by_head.values() for s in segs]
        assert len(indexed) == len(self._lru) and all(self._lru[(s.start, s.key)] is s for s in indexed)

    def _make_room(self, nbytes: int, down: Callable[[Segment], object]) -> None:
        """Drop the least recently used segments until `nbytes` more fit the budget, each handed to `down` at
        once (holding none here: a segment's arena region is free again when nothing holds its K/V)."""
        while self.bytes_in_use + nbytes > self.budget_bytes:
            down(self._drop(next(iter(self._lru))))

    def _drop(self, name: tuple[int, str]) -> Segment:
        seg = self._lru.pop(name)
        head = (seg.start, int(seg.ids[seg.start]))
        rest = [s for s in self._by_head[head] if s is not seg]
        if rest:
            self._by_head[head] = rest
        else:
            del self._by_head[head]
        self.bytes_in_use -= self.held_bytes(seg.nbytes)
        return seg
