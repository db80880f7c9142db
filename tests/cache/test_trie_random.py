"""Tests for lmq_backend.cache.trie under random operations: a harness checking every match, pin, insert and
eviction against the trie's invariants, driven by seeded random runs and a hypothesis state machine (the
unit tests: test_trie.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmq_backend.cache.trie import PrefixTrie, TrieNode

from test_trie import TOK, cat_path, enc


class Harness:
    """Drives a trie with random operations and checks, after each one, that:
    every match returns K/V equal to the encoding of the matched ids; the match is the longest
    (no child continues it); pinned prefixes stay fully cached; budget and check() hold."""

    def __init__(self, budget_tokens: int, rng: random.Random):
        self.t = PrefixTrie(budget_tokens * TOK, TOK)
        self.rng = rng
        self.pins: list[tuple[TrieNode, tuple[int, ...]]] = []
        self.seen: list[tuple[int, ...]] = []

    def rand_seq(self) -> tuple[int, ...]:
        r = self.rng
        if self.seen and r.random() < 0.7:  # share a prefix with something seen
            base = r.choice(self.seen)
            k = r.randint(0, len(base))
            return base[:k] + tuple(r.randint(0, 3) for _ in range(r.randint(0, 6)))
        return tuple(r.randint(0, 3) for _ in range(r.randint(1, 10)))

    def verify_match(self, ids, limit=None):
        t = self.t
        node, n = t.match(ids, limit)
        end = len(ids) if limit is None else min(limit, len(ids))
        assert node.depth == n <= end
        assert t.path_ids(node) == tuple(ids[:n])
        assert np.array_equal(cat_path(t, node), enc(ids[:n]))
        if n < end:
            assert ids[n] not in node.children, "match was not the longest"
        return node, n

    def op_match(self):
        ids = self.rand_seq()
        limit = self.rng.choice([None, self.rng.randint(0, len(ids) + 1)])
        self.verify_match(ids, limit)

    def op_insert(self):
        """Engine-like: match, pin, insert the remainder, pin the result, unpin the parent."""
        t = self.t
        ids = self.rand_seq()
        self.seen.append(ids)
        parent, n = self.verify_match(ids, self.rng.randint(0, len(ids)))
        t.pin(parent)
        rest = ids[n:]
        budget_left = t.budget_bytes - t.protected_bytes()
        ev_before, bytes_before = t.evictions, t.bytes_in_use
        node = t.insert(parent, rest, enc(rest, n), label="x")
        if node is not None:
            assert node.depth == len(ids)
            assert t.path_ids(node) == ids
            assert np.array_equal(cat_path(t, node), enc(ids))
            if self.rng.random() < 0.5:
                t.pin(node)
                self.pins.append((node, ids))
        elif t.enabled:
            assert rest, "an empty insert always succeeds"
            assert len(rest) * TOK > budget_left, "insert failed although the whole rest would fit"
            assert t.evictions == ev_before and t.bytes_in_use == bytes_before, "failed insert evicted"
        t.unpin(parent)
        t.check()
        if node is not None:
            assert self.verify_match(ids)[1] == len(ids)

    def op_insert_stale_overlap(self):
        """Two queries prefilled the same prefix concurrently: insert under an older parent
        something that is (partly) cached already."""
        t = self.t
        if not self.seen:
            return
        ids = self.rng.choice(self.seen)
        k = self.rng.randint(0, len(ids))
        parent, n = self.verify_match(ids, k)
        extra = tuple(self.rng.randint(0, 3) for _ in range(self.rng.randint(0, 3)))
        full = ids + extra
        rest = full[n:]
        t.pin(parent)
        node = t.insert(parent, rest, enc(rest, n))
        if node is not None:
            assert t.path_ids(node) == full
            assert np.array_equal(cat_path(t, node), enc(full))
        t.unpin(parent)

    def op_unpin(self):
        if self.pins:
            node, _ = self.pins.pop(self.rng.randrange(len(self.pins)))
            self.t.unpin(node)

    def op_move_pin(self):
        """A request's pin follows its prefix (`move_pin`): to a match of ids that often extend its own (a node
        below it), the same node, or another path; the locks must be those of pinning the new and unpinning the
        old."""
        t = self.t
        if not self.pins:
            return
        k = self.rng.randrange(len(self.pins))
        old, old_ids = self.pins[k]
        r = self.rng.random()
        ids = old_ids + tuple(self.rng.randint(0, 3) for _ in range(self.rng.randint(0, 4))) if r < 0.6 else \
            old_ids if r < 0.7 else self.rand_seq()
        new, n = self.verify_match(ids)
        t.move_pin(old, new)
        self.pins[k] = (new, tuple(ids[:n]))

    def op_evict(self):
        before = self.t.bytes_in_use
        want = self.rng.randint(0, self.t.budget_bytes)
        ev = self.t.evictable_bytes()
        freed = self.t.evict(want)
        assert self.t.bytes_in_use == before - freed
        assert freed >= min(want, ev) and freed <= ev

    def invariants(self):
        t = self.t
        t.check()
        assert t.bytes_in_use <= t.budget_bytes
        for node, ids in self.pins:
            assert node is t.root or (node.parent is not None and node.slots is not None), "pinned node evicted"
            assert t.path_ids(node) == ids
            assert np.array_equal(cat_path(t, node), enc(ids))

    def finish(self):
        while self.pins:
            self.t.unpin(self.pins.pop()[0])
        assert self.t.pinned_nodes() == 0
        self.t.check()
        ev = self.t.evictable_bytes()
        assert ev == self.t.bytes_in_use
        assert self.t.evict(10**12) == ev
        assert len(self.t) == 0 and self.t.bytes_in_use == 0
        self.t.check()

    def step(self):
        ops = [self.op_match, self.op_insert, self.op_insert, self.op_insert_stale_overlap,
               self.op_unpin, self.op_evict, self.op_move_pin]
        self.rng.choice(ops)()
        self.invariants()


@pytest.mark.parametrize("seed", range(30))
def test_random_operations(seed):
    rng = random.Random(seed)
    h = Harness(budget_tokens=rng.choice([5, 12, 30, 200]), rng=rng)
    for _ in range(300):
        h.step()
    h.finish()


class TrieMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h: Harness | None = None

    @precondition(lambda self: self.h is None)
    @rule(budget=st.sampled_from([0, 3, 8, 20, 64]), seed=st.integers(0, 2**32 - 1))
    def init(self, budget, seed):
        self.h = Harness(budget, random.Random(seed))

    @precondition(lambda self: self.h is not None)
    @rule()
    def match(self):
        self.h.op_match()

    @precondition(lambda self: self.h is not None)
    @rule()
    def insert(self):
        self.h.op_insert()

    @precondition(lambda self: self.h is not None)
    @rule()
    def insert_overlap(self):
        self.h.op_insert_stale_overlap()

    @precondition(lambda self: self.h is not None)
    @rule()
    def unpin(self):
        self.h.op_unpin()

    @precondition(lambda self: self.h is not None)
    @rule()
    def move_pin(self):
        self.h.op_move_pin()

    @precondition(lambda self: self.h is not None)
    @rule()
    def evict(self):
        self.h.op_evict()

    @invariant()
    def inv(self):
        if self.h is not None:
            self.h.invariants()

    def teardown(self):
        if self.h is not None:
            self.h.finish()


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
