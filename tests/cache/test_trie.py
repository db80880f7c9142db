"""Tests for lmq_backend.cache.trie (radix trie of KV caches): matches, inserts, pins, splits and eviction (random
operations against its invariants: test_trie_random.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lmq_backend.cache.trie import PrefixTrie, TrieNode

TOK = 96  # bytes per token


def enc(ids, start: int = 0) -> np.ndarray:
    """Slots [T] whose values encode token id and absolute position, so any slicing or offset mistake in
    the slots a node keeps shows up."""
    return np.array([t * 1000 + start + i for i, t in enumerate(ids)], dtype=np.int32)


def cat_path(trie: PrefixTrie, node: TrieNode) -> np.ndarray:
    return trie.path_slots(node)


def assert_prefix(trie: PrefixTrie, node: TrieNode, ids) -> None:
    ids = tuple(ids)
    assert node.depth == len(ids)
    assert trie.path_ids(node) == ids
    assert np.array_equal(cat_path(trie, node), enc(ids))


def ins(trie, parent, ids, label=""):
    start = parent.depth
    full_prefix = trie.path_ids(parent)
    assert len(full_prefix) == start
    return trie.insert(parent, ids, enc(ids, start), label=label)


# ---------------------------------------------------------------------------- basics

def test_empty_match():
    t = PrefixTrie(100 * TOK, TOK)
    node, n = t.match([1, 2, 3])
    assert node is t.root and n == 0
    assert len(t) == 0 and t.bytes_in_use == 0
    t.check()


def test_insert_and_match_full_and_partial():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4], label="abcd")
    assert a is not None and a.depth == 4 and a.label == "abcd"
    assert t.bytes_in_use == 4 * TOK and len(t) == 1
    t.check()

    node, n = t.match([1, 2, 3, 4, 5, 6])
    assert node is a and n == 4
    assert_prefix(t, node, [1, 2, 3, 4])

    # match ending inside the segment splits it; the original object becomes the lower half
    node, n = t.match([1, 2, 9])
    assert n == 2 and node is not a and node.depth == 2
    assert a.parent is node and a.ids == (3, 4) and a.depth == 4 and node.ids == (1, 2)
    assert a.label == "abcd" and node.label == ""
    assert len(t) == 2 and t.bytes_in_use == 4 * TOK
    assert_prefix(t, node, [1, 2])
    assert_prefix(t, a, [1, 2, 3, 4])
    t.check()

    # no match at all
    node, n = t.match([7, 1, 2])
    assert node is t.root and n == 0


def test_match_limit():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4, 5])
    node, n = t.match([1, 2, 3, 4, 5], limit=4)
    assert n == 4
    assert_prefix(t, node, [1, 2, 3, 4])
    assert a.parent is node and a.ids == (5,)
    node, n = t.match([1, 2, 3, 4, 5], limit=0)
    assert node is t.root and n == 0
    node, n = t.match([1, 2, 3, 4, 5], limit=99)
    assert node is a and n == 5
    node, n = t.match([1, 2, 3, 4], limit=4)  # exactly at a boundary: no extra split
    assert n == 4 and len(t) == 2
    t.check()


def test_insert_under_parent_and_branching():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3])
    b = ins(t, a, [4, 5])
    c = ins(t, a, [6])
    assert b.parent is a and c.parent is a
    assert_prefix(t, b, [1, 2, 3, 4, 5])
    assert_prefix(t, c, [1, 2, 3, 6])
    node, n = t.match([1, 2, 3, 6, 7])
    assert node is c and n == 4
    node, n = t.match([1, 2, 3, 4, 7])
    assert n == 4 and node.parent is a and b.parent is node
    assert_prefix(t, node, [1, 2, 3, 4])
    t.check()


def test_insert_overlapping_existing_children():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4])
    # fully contained: nothing new stored, existing (split) node returned
    x = ins(t, t.root, [1, 2])
    assert x is not None and x.depth == 2 and a.parent is x
    assert t.bytes_in_use == 4 * TOK and len(t) == 2
    # identical: returns the existing node
    assert ins(t, t.root, [1, 2, 3, 4]) is a
    # diverging inside a segment: split + store only the rest
    y = ins(t, t.root, [1, 2, 3, 9, 9])
    assert y is not None and y.ids == (9, 9) and y.depth == 5
    assert t.bytes_in_use == 6 * TOK
    assert_prefix(t, y, [1, 2, 3, 9, 9])
    assert_prefix(t, a, [1, 2, 3, 4])
    # extending past an existing leaf
    z = ins(t, t.root, [1, 2, 3, 4, 5, 6])
    assert z is not None and z.parent is a and z.ids == (5, 6)
    assert_prefix(t, z, [1, 2, 3, 4, 5, 6])
    assert t.bytes_in_use == 8 * TOK
    t.check()


def test_insert_empty_ids_returns_parent():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2])
    assert t.insert(a, [], enc([], 2)) is a
    assert t.insert(t.root, [], enc([])) is t.root
    t.check()


def test_stored_slots_do_not_alias_caller_memory():
    t = PrefixTrie(100 * TOK, TOK)
    big = enc([1, 2, 3, 4, 5, 6])
    view = big[:4]
    a = t.insert(t.root, [1, 2, 3, 4], view)
    whole = enc([7, 8])
    b = t.insert(t.root, [7, 8], whole)
    big[:] = 0
    whole[:] = 0
    assert_prefix(t, a, [1, 2, 3, 4])
    assert_prefix(t, b, [7, 8])
    t.check()


def test_split_keeps_slots_and_bytes():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4, 5, 6])
    node, _ = t.match([1, 2, 3])
    assert len(a.slots) == 3 and len(node.slots) == 3 and node.nbytes == 3 * TOK
    assert_prefix(t, node, [1, 2, 3])
    assert_prefix(t, a, [1, 2, 3, 4, 5, 6])
    assert t.bytes_in_use == 6 * TOK
    t.check()


def test_bad_slot_count_rejected():
    t = PrefixTrie(100 * TOK, TOK)
    with pytest.raises(ValueError):
        t.insert(t.root, [1, 2, 3], enc([1, 2]))
    t.check()


# ---------------------------------------------------------------------------- pins and splits

def test_pin_counts_and_unpin():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4])
    t.pin(a)
    t.pin(a)
    assert a.lock == 2 and a.pins == 2 and t.root.lock == 2
    assert t.pinned_nodes() == 2  # a and root
    t.unpin(a)
    t.unpin(a)
    assert t.pinned_nodes() == 0
    with pytest.raises(AssertionError):
        t.unpin(a)
    t.check()


def test_split_preserves_pins():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4])
    t.pin(a)
    upper, n = t.match([1, 2])
    assert n == 2 and a.parent is upper
    assert upper.lock == 1 and upper.pins == 0 and a.lock == 1 and a.pins == 1
    t.check()
    # the pinned original still denotes the full prefix; nothing in it can be evicted
    assert t.evict(10**9) == 0
    assert_prefix(t, a, [1, 2, 3, 4])
    t.unpin(a)
    assert t.pinned_nodes() == 0
    t.check()


def test_move_pin_walks_between_and_checks():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2])
    b = ins(t, a, [3])
    c = ins(t, t.root, [4])
    t.pin(a)
    t.move_pin(a, b)  # down the path: a's own pin becomes b's
    assert (a.pins, a.lock, b.pins, b.lock, t.root.lock) == (0, 1, 1, 1, 1)
    t.move_pin(b, c)  # to another path
    assert (a.lock, b.lock, c.pins, c.lock, t.root.lock) == (0, 0, 1, 1, 1)
    t.move_pin(c, c)
    assert (c.pins, c.lock) == (1, 1)
    t.check()
    t.move_pin(c, None)
    assert t.pinned_nodes() == 0
    t.evict(10**9)
    with pytest.raises(AssertionError):  # an evicted node: nothing locked
        t.move_pin(None, b)
    assert t.pinned_nodes() == 0
    t.check()


def test_unpin_requires_own_pin():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2])
    b = ins(t, a, [3])
    t.pin(b)
    with pytest.raises(AssertionError):
        t.unpin(a)  # a is locked only through b
    t.unpin(b)
    t.check()


# ---------------------------------------------------------------------------- eviction

def test_pins_prevent_eviction():
    t = PrefixTrie(10 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3, 4])
    b = ins(t, a, [5, 6])
    t.pin(b)
    c = ins(t, t.root, [7, 8, 9, 10])
    assert t.bytes_in_use == 10 * TOK
    # needs 4 tokens: only c (unpinned) can go
    d = ins(t, t.root, [11, 12, 13, 14])
    assert d is not None
    assert c.parent is None and c.slots is None  # evicted
    assert_prefix(t, b, [1, 2, 3, 4, 5, 6])
    t.check()
    # now everything but d is pinned, and d is only 4 tokens: 5 can't fit -> None, nothing evicted
    assert ins(t, t.root, [20, 21, 22, 23, 24]) is None
    assert d.parent is t.root and t.bytes_in_use == 10 * TOK
    t.unpin(b)
    assert ins(t, t.root, [20, 21, 22, 23, 24]) is not None
    t.check()


def test_eviction_lru_order():
    t = PrefixTrie(9 * TOK, TOK)
    a = ins(t, t.root, [1, 1, 1])
    b = ins(t, t.root, [2, 2, 2])
    c = ins(t, t.root, [3, 3, 3])
    t.match([1, 1, 1])  # a is now most recent; b is LRU
    ins(t, t.root, [4, 4, 4])
    assert b.parent is None and a.parent is t.root and c.parent is t.root
    assert t.evictions == 1 and t.evicted_tokens == 3
    upper, _ = t.match([3, 3])  # splits c: upper [3,3] is touched, the tail [3] (= c) is not
    ins(t, t.root, [5, 5, 5])  # needs 3 tokens: the untouched tail c (1) goes first, then a (3)
    assert c.parent is None and a.parent is None and upper.parent is t.root
    assert t.evictions == 3 and t.evicted_tokens == 7
    assert t.match([3, 3, 3])[1] == 2
    t.check()


def test_evict_leaves_first_then_parents():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2])
    b = ins(t, a, [3, 4])
    c = ins(t, a, [5])
    other = ins(t, t.root, [9])
    t.match([9])  # `other` most recent
    # LRU leaves first: b, then c; then a becomes a leaf (older than `other`), then other
    order = []
    for _ in range(4):
        freed = t.evict(1)
        gone = [n for n in (a, b, c, other) if n.parent is None and n not in order]
        assert len(gone) == 1 and freed == len(gone[0].ids) * TOK
        order.append(gone[0])
        t.check()
    assert order == [b, c, a, other]
    assert t.evict(1) == 0
    assert len(t) == 0 and t.bytes_in_use == 0
    assert t.evictions == 4 and t.evicted_tokens == 6
    t.check()


def test_evict_returns_freed_and_respects_pins():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3])
    b = ins(t, t.root, [4, 5])
    t.pin(a)
    assert t.evict(0) == 0
    assert t.evict(100 * TOK) == 2 * TOK
    assert b.parent is None and a.parent is t.root
    assert t.evictable_bytes() == 0 and t.protected_bytes() == 3 * TOK
    t.unpin(a)
    t.check()


def test_budget_zero_disables():
    t = PrefixTrie(0)
    assert t.match([1, 2, 3]) == (t.root, 0)
    assert t.insert(t.root, [1, 2, 3], enc([1, 2, 3])) is None
    assert len(t) == 0 and t.bytes_in_use == 0
    t.pin(t.root)
    t.unpin(t.root)
    assert t.pinned_nodes() == 0
    t.check()


def test_insert_larger_than_budget_stores_nothing():
    t = PrefixTrie(5 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3])
    assert ins(t, t.root, [4, 5, 6, 7, 8, 9]) is None
    assert a.parent is t.root and t.bytes_in_use == 3 * TOK and len(t) == 1 and t.evictions == 0
    # exactly the budget fits (after evicting a)
    b = ins(t, t.root, [4, 5, 6, 7, 8])
    assert b is not None and a.parent is None and t.bytes_in_use == 5 * TOK
    t.check()


def test_insert_protects_reused_path_while_evicting():
    # budget fully used by one unpinned chain; extending it must evict something else, never the chain
    t = PrefixTrie(6 * TOK, TOK)
    a = ins(t, t.root, [1, 2, 3])
    other = ins(t, t.root, [7, 7])
    t.match([7, 7])  # other is the most recent, `a` is LRU
    x = ins(t, t.root, [1, 2, 3, 4, 5])  # reuses a, needs 2 tokens: must evict `other`, not a
    assert x is not None and x.parent is a and other.parent is None
    assert_prefix(t, x, [1, 2, 3, 4, 5])
    t.check()
    # extending by more than what the unpinned rest can free: nothing evicted
    assert ins(t, t.root, [1, 2, 3, 4, 5, 6, 7]) is None
    assert x.parent is a and t.bytes_in_use == 5 * TOK
    t.check()


def test_evicted_parent_rejected():
    t = PrefixTrie(100 * TOK, TOK)
    a = ins(t, t.root, [1, 2])
    t.evict(10**9)
    with pytest.raises(ValueError):
        t.insert(a, [3], enc([3], 2))
    with pytest.raises(AssertionError):
        t.pin(a)
