"""`PrefixCache` over a real K/V store: the radix cache's API (match, insert, lock / unlock, evict,
evictable / protected bytes) and a request's lifecycle (lookup, extend, fork, release), with the store's slots
accounted for at every step (no slot leaked, none owned twice, the budget never exceeded)."""
from __future__ import annotations

import numpy as np
import torch

from lmq_backend.cache.kv_store import KVStore
from lmq_backend.cache.prefix_cache import Pin, PrefixCache
from support.caches import node_slots


def store(slots: int = 64) -> KVStore:
    return KVStore(layers=1, heads=1, head_dim=2, dtype=torch.float32, device="cpu", capacity=slots)


def computed(kv: KVStore, n: int) -> np.ndarray:
    """Slots a row computed n tokens into (owned by the row until the cache takes them)."""
    return kv.alloc(n)


def check(cache: PrefixCache, kv: KVStore, rows: list[np.ndarray] = ()) -> None:
    cache.trie.check()
    kv.check(node_slots(cache.trie), list(rows))


def test_a_request_reads_what_another_stored_and_pins_hold_it():
    kv = store()
    cache = PrefixCache(kv, budget_bytes=40 * kv.bytes_per_token)
    first = Pin()
    slots, cached, _ = cache.lookup(first, [1, 2, 3, 4, 5], limit=4)
    assert cached == 0 and len(slots) == 0 and first.node is cache.trie.root
    row = computed(kv, 5)
    assert cache.extend(first, [1, 2, 3, 4, 5], row)  # the cache takes the row's slots
    assert first.depth == 5 and cache.bytes_in_use == 5 * kv.bytes_per_token
    check(cache, kv)

    second = Pin()
    slots, cached, _ = cache.lookup(second, [1, 2, 3, 9], limit=3)  # a match inside a node splits it
    assert cached == 3 and slots.tolist() == row[:3].tolist() and second.depth == 3
    assert cache.protected_bytes() == cache.bytes_in_use and cache.evictable_bytes() == 0
    assert cache.evict(10**9) == 0  # everything is pinned
    copy = cache.fork(second)
    assert copy.node is second.node
    for pin in (first, second, copy):
        assert cache.release(pin) and pin.node is None
    assert not cache.release(first)
    assert cache.pinned_nodes() == 0 and cache.evictable_bytes() == cache.bytes_in_use
    check(cache, kv)


def test_the_store_evicts_unpinned_leaves_when_it_runs_short():
    kv = store(slots=16)
    cache = PrefixCache(kv, budget_bytes=100 * kv.bytes_per_token)
    pin = Pin()
    cache.lookup(pin, [7, 8, 9, 10])
    assert cache.extend(pin, [7, 8, 9, 10], computed(kv, 4))
    cache.release(pin)
    assert kv.available() == 15 and kv.free_slots == 11
    taken = kv.alloc(13)  # more than the free list: the store asks the cache to evict
    assert cache.bytes_in_use < 4 * kv.bytes_per_token and cache.evictions >= 1
    check(cache, kv, [taken])


def test_lock_unlock_and_a_budget_of_zero():
    kv = store()
    cache = PrefixCache(kv, budget_bytes=8 * kv.bytes_per_token)
    node = cache.insert(cache.trie.root, [1, 2, 3], computed(kv, 3))
    assert cache.match([1, 2, 3, 4]) == (node, 3)
    cache.lock(node)
    assert cache.evict(10**9) == 0
    cache.unlock(node)
    assert cache.evict(1) == 3 * kv.bytes_per_token and len(cache) == 0
    check(cache, kv)

    off = PrefixCache(store(), budget_bytes=0)
    pin = Pin()
    assert off.lookup(pin, [1, 2, 3])[1] == 0
    assert not off.extend(pin, [1, 2, 3], np.array([1, 2, 3], dtype=np.int32)) and len(off) == 0
    off.release(pin)
