"""`PrefixCache`: the prefix cache of one backend, its API and a request's lifecycle in it.

The API is SGLang's radix cache's: `match` (the longest cached prefix, split at a token boundary), `insert`,
`lock` / `unlock` (a pin walks to the root: a locked path is never evicted), `evict` (unlocked leaves, least
recently used first), `evictable_bytes` / `protected_bytes`. The nodes and their bookkeeping are the trie's
(`trie.py`); their K/V slots are the store's (`kv_store.py`), which asks the cache to evict when it runs short
(`KVStore.reclaim`, `KVStore.evictable`).

A request holds a `Pin`: the node covering the prefix it reads, locked while it does. Its lifecycle:

    slots, cached, loads = cache.lookup(pin, ids, limit)  # match, and move the pin to the match: its page table
    slots = cache.find(pin, ids)                    # all of ids in the trie (else None): the pin moved there
    cache.extend(pin, ids, slots)                   # insert what it computed under its pin; the pin follows
    cache.release(pin)                              # done (finished, failed or cancelled): unlock
    copy = cache.fork(pin)                          # a second pin on the same node (a beam's copy)

`budget_bytes` bounds what the cache keeps (0: nothing is kept, every prefill computes the whole prompt).

Under the trie, the cache tiers (`tiers.py`: host memory, a disk folder), if the cache has them: an evicted node
moves down to them, a stored one is written through to disk, and a lookup goes on in them after the trie's match
(loading what it finds into fresh slots, as trie nodes; where the trie has no room, into the request's own slots
when its prefill runs: `Loads`). A request's disk files are read before it is queued
(`stage`, in a worker thread), and each prefill's speed tells the tiers when a load is worth it
(`observe_prefill`). Without tiers these do nothing.
"""
from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .kv_store import KVStore
from .segment import Segment
from .tiers import CacheTiers, Loads, TierOptions, build_tiers
from .trie import PrefixTrie, TrieNode


@dataclass(slots=True, eq=False)
class Pin:
    """A request's lock on the cached prefix it reads (`node`: None, none held)."""

    node: TrieNode | None = None

    @property
    def depth(self) -> int:
        """Tokens of the prefix the pin holds."""
        return 0 if self.node is None else self.node.depth


class PrefixCache:
    def __init__(self, store: KVStore, budget_bytes: int, tiers: TierOptions | None = None):
        """`tiers`: the tiers under the trie (none where the trie is off: `budget_bytes` 0)."""
        self.trie = PrefixTrie(budget_bytes, store.bytes_per_token, store)
        # the store asks the trie for slots through a weak reference: no cycle keeps the store's memory alive
        # once the engine is dropped
        trie, per_token = weakref.proxy(self.trie), store.bytes_per_token
        store.reclaim = lambda n: trie.evict(n * per_token)
        store.evictable = lambda: trie.evictable_bytes() // per_token
        self.tiers: CacheTiers | None = None
        if tiers is not None and self.trie.enabled:
            self.tiers = build_tiers(store, tiers)
        if self.tiers is not None:  # cache tiers: an evicted leaf moves down
            self.trie.on_evict = self.tiers.evicted

    # ----- the cache ------------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.trie.budget_bytes

    @property
    def bytes_in_use(self) -> int:
        return self.trie.bytes_in_use

    @property
    def evictions(self) -> int:
        """Nodes evicted so far."""
        return self.trie.evictions

    def __len__(self) -> int:
        return len(self.trie)

    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[TrieNode, int]:
        """The longest cached prefix of ids[:limit]: (node, its length); a match inside a node splits it."""
        return self.trie.match(ids, limit)

    def insert(self, parent: TrieNode, ids: Sequence[int], slots: np.ndarray) -> TrieNode | None:
        """Store `ids` after `parent`'s prefix with their K/V `slots` (the cache takes those it keeps): the node
        covering them, or None where they cannot fit (see `PrefixTrie.insert`)."""
        return self.trie.insert(parent, ids, slots)

    def lock(self, node: TrieNode) -> None:
        self.trie.pin(node)

    def unlock(self, node: TrieNode) -> None:
        self.trie.unpin(node)

    def evict(self, nbytes: int) -> int:
        """Evict unlocked leaves, least recently used first, until `nbytes` are freed; returns the bytes freed."""
        return self.trie.evict(nbytes)

    def evictable_bytes(self) -> int:
        return self.trie.evictable_bytes()

    def protected_bytes(self) -> int:
        return self.trie.protected_bytes()

    def pinned_nodes(self) -> int:
        """Nodes with a pin on them or below them, the root included (0: no request holds a pin)."""
        return self.trie.pinned_nodes()

    def tier_counts(self, since: dict[str, int] | None = None) -> dict[str, int]:
        """The tiers' counters (`CacheTiers.counts`; {} without tiers)."""
        return {} if self.tiers is None else self.tiers.counts(since)

    def close(self) -> None:
        """Finish the tiers' files being written and let the host tier's memory go."""
        if self.tiers is not None:
            self.tiers.close()

    # ----- a request's lifecycle ------------------------------------------------------------------------

    async def stage(self, ids: list[int], limit: int) -> list[Segment]:
        """The disk tier's segments that may continue the match of ids[:limit] (read in a worker thread, the
        event loop free meanwhile), for `lookup` to load; [] without a disk tier or where no file is worth it."""
        tiers = self.tiers
        at = None if tiers is None else tiers.stage_from(self.trie, ids, limit)
        if at is None:
            return []
        return await asyncio.to_thread(tiers.stage, ids, at, limit)

    def lookup(self, pin: Pin, ids: Sequence[int], limit: int | None = None,
               staged: Sequence[Segment] = ()) -> tuple[np.ndarray, int, Loads | None]:
        """Match ids[:limit] (in the trie, then in the tiers and the `staged` segments) and move `pin` to the
        match: (the trie's page table of the prefix, int32 [m]; n, the tokens cached; the K/V of tokens [m, n),
        which the tiers hold and the trie had no room for, for the request's prefill to copy into slots of its
        own: `Loads`, or None where n == m)."""
        node, cached = self.trie.match(ids, limit)
        loads = None
        if self.tiers is not None:  # cache tiers: the match goes on in host memory and the staged files
            node, cached, loads = self.tiers.load(self.trie, node, ids, cached,
                                                  len(ids) if limit is None else limit, list(staged))
        self.move(pin, node)
        return self.trie.path_slots(node), cached + (loads.tokens if loads else 0), loads

    def find(self, pin: Pin, ids: Sequence[int]) -> np.ndarray | None:
        """The trie's page table of all of `ids`, the pin moved there; None where the trie does not hold them all
        (the pin stays). (A request whose whole prompt another one has just stored, joining on its K/V.)"""
        node, n = self.trie.match(ids)
        if n < len(ids):
            return None
        self.move(pin, node)
        return self.trie.path_slots(node)

    def extend(self, pin: Pin, ids: Sequence[int], slots: np.ndarray) -> bool:
        """Insert `ids` (with their K/V `slots`) after the pin's prefix, and move the pin to them; False where
        nothing was stored (a cache of budget 0, or they do not fit: the pin stays)."""
        if self.trie.budget_bytes == 0 or pin.node is None:
            return False
        node = self.trie.insert(pin.node, ids, slots)
        if node is None:
            if self.tiers is not None:  # cache tiers: what the trie has no room for goes down as if evicted
                self.tiers.refused(self.trie, pin.node, ids, slots)
            return False
        self.move(pin, node)
        if self.tiers is not None:  # cache tiers: a long new node is written to disk
            self.tiers.inserted(self.trie, node)
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` new tokens in `seconds`, from its lookup to its logits (the tiers' cost
        model: `CacheTiers.worth`)."""
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds)

    def release(self, pin: Pin) -> bool:
        """Drop the pin's lock; True if it held one."""
        held = pin.node is not None
        self.move(pin, None)
        return held

    def fork(self, pin: Pin) -> Pin:
        """A new pin on the same node."""
        copy = Pin()
        self.move(copy, pin.node)
        return copy

    def move(self, pin: Pin, node: TrieNode | None) -> None:
        """Move the pin to `node` (None: drop it), locking the new node before unlocking the old."""
        self.trie.move_pin(pin.node, node)
        pin.node = node
