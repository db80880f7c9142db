"""A radix trie over token ids whose nodes own the K/V slots of their tokens (the prefix cache).

K/V layout: see `kv_store.py`. ``node.slots: np.ndarray`` (int32, ``[T]``) holds the
store slots of the node's OWN ``T`` tokens (its segment ``node.ids``), so the slots of
a path root -> node concatenated are the page table of that prefix::

    trie.path_slots(node)   # int32 [node.depth]

The trie owns those slots: it takes them from a row when a segment is inserted
(`KVStore.take`) and gives them back when it evicts a node (`KVStore.free`). It never
reads or copies K/V. Without a store (tests) slots are plain ints.

Design (after SGLang's radix cache, written from scratch)
---------------------------------------------------------
* Every non-root node holds a non-empty segment; children are keyed by the first
  token of their segment, so siblings never share a first token.
* ``node.depth`` = number of tokens from the root to the END of the node.
* ``node.pins`` = pins taken directly on this node object; ``node.lock`` = pins
  on this node or any descendant (``lock == pins + sum(child.lock)``).  ``pin``
  walks to the root INCLUDING the root, so ``root.lock`` is the number of
  outstanding pins.  A node with ``lock > 0`` is never evicted; a node with
  ``lock == 0`` has a wholly unpinned subtree, hence is evictable leaf-first.
* LRU: a logical clock ``last_used``; touching a node touches all its ancestors
  with the same tick, so ``parent.last_used >= child.last_used`` always and a
  parent becomes an eviction candidate only after all its children went.
* Split at offset k (0 < k < T) of node N: a NEW node U takes the upper part
  ``N.ids[:k]`` and becomes N's parent; the ORIGINAL object N keeps the lower
  (deeper) part ``N.ids[k:]``.  Hence any reference a caller holds to N (and
  the pins it took on N) still denotes the same full prefix (N.depth is
  unchanged).  ``U.lock = N.lock`` (every pin in N's subtree passes through
  U), ``U.pins = 0``, ``U.last_used = N.last_used``; N keeps its label and U
  gets ``""`` (token boundaries don't map onto the text).  Both halves are
  views of the node's slots; ``bytes_in_use`` is unchanged.
* Eviction removes unpinned leaves in LRU order (a heap), which may turn their
  parents into candidates.  Evicted nodes are detached (``parent=None``,
  ``slots=None``), their slots freed; using one afterwards is an error.
* The budget is hard: ``bytes_in_use <= budget_bytes`` at every moment.  An
  insert whose new bytes can't fit even after evicting every unpinned node
  evicts nothing and stores nothing (returns None).

Bytes are ``tokens * bytes_per_token`` (a token's K/V over every layer).
The trie knows nothing about asyncio, models or queries.  Not thread-safe.
The cache's API, and a request's lifecycle in it, are `prefix_cache.py`'s.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

__all__ = ["TrieNode", "PrefixTrie"]


@dataclass(slots=True, eq=False)
class TrieNode:
    ids: tuple[int, ...]
    slots: np.ndarray | None
    parent: TrieNode | None
    children: dict[int, TrieNode] = field(default_factory=dict)
    depth: int = 0
    lock: int = 0
    last_used: int = 0
    label: str = ""
    pins: int = 0  # pins taken directly on this node object (lock counts the subtree's)
    bytes_per_token: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.slots is None else len(self.slots) * self.bytes_per_token

    def __repr__(self) -> str:  # dataclass repr would recurse through parent/children
        return (f"TrieNode(T={len(self.ids)}, depth={self.depth}, lock={self.lock}, pins={self.pins}, "
                f"last_used={self.last_used}, children={len(self.children)}, label={self.label!r})")


class PrefixTrie:
    def __init__(self, budget_bytes: int, bytes_per_token: int = 1, store=None):
        """`store`: the `KVStore` whose slots the nodes own (None: slots are plain ints, nothing is freed)."""
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.root = TrieNode(ids=(), slots=None, parent=None)
        self.store = store
        self.bytes_per_token = int(bytes_per_token)
        self.budget_bytes = int(budget_bytes)
        self.bytes_in_use = 0
        self._locked_bytes = 0  # bytes of nodes with lock > 0 (kept by pin/unpin: a split keeps the sum)
        self.evictions = 0
        self.evicted_tokens = 0
        self._n_nodes = 0
        self._clock = 0
        # cache tiers (cache/tiers.py): called with each leaf evict() drops and its prefix's ids, before its slots go
        self.on_evict: Callable[[PrefixTrie, TrieNode], None] | None = None

    # ------------------------------------------------------------------ basics
    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return self._n_nodes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: TrieNode, t: int) -> None:
        n: TrieNode | None = node
        while n is not None:
            n.last_used = t
            n = n.parent

    def _attached(self, node: TrieNode) -> bool:
        """Is `node` a live node of this trie? Its parents lead to this root: an evicted node is detached
        (`parent` None), and only leaves are evicted, so no live node hangs below an evicted one."""
        n = node
        while n.parent is not None:
            n = n.parent
        return n is self.root

    def _iter_nodes(self) -> Iterator[TrieNode]:
        """All nodes except the root (DFS, iterative)."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ------------------------------------------------------------------ split / walk
    def _split(self, node: TrieNode, k: int) -> TrieNode:
        """Split `node` after its first k tokens; return the new UPPER node (the original object
        becomes the lower half, so references/pins to it keep meaning the same prefix)."""
        assert node.slots is not None and 0 < k < len(node.ids)
        parent = node.parent
        assert parent is not None
        upper = TrieNode(
            ids=node.ids[:k], slots=node.slots[:k], parent=parent, children={},
            depth=node.depth - len(node.ids) + k, lock=node.lock, last_used=node.last_used, label="", pins=0,
            bytes_per_token=self.bytes_per_token,
        )
        node.slots = node.slots[k:]
        node.ids = node.ids[k:]
        node.parent = upper
        upper.children[node.ids[0]] = node
        parent.children[upper.ids[0]] = upper
        self._n_nodes += 1
        return upper

    def _walk(self, node: TrieNode, ids: tuple[int, ...], i: int, end: int) -> tuple[TrieNode, int]:
        """Follow ids[i:end] down from `node` as far as cached, splitting the last node if the match
        ends inside it. Returns (deepest node, index into ids where it ends)."""
        while i < end:
            child = node.children.get(ids[i])
            if child is None:
                break
            seg = child.ids
            T = len(seg)
            if i + T <= end and ids[i:i + T] == seg:  # fast path: whole segment matches
                node, i = child, i + T
                continue
            m = min(T, end - i)
            k = 1  # seg[0] == ids[i] by the children key
            while k < m and seg[k] == ids[i + k]:
                k += 1
            node, i = (child if k == T else self._split(child, k)), i + k
            break
        return node, i

    # ------------------------------------------------------------------ public API
    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[TrieNode, int]:
        """Longest cached prefix of ids[:limit]: returns (node, n) with node.depth == n. If the match
        ends inside a node's segment, that node is split so the returned node ends exactly at n.
        Touches last_used along the path. Budget 0 -> always (root, 0)."""
        if not self.enabled:
            return self.root, 0
        ids = tuple(ids) if type(ids) is list else tuple(map(int, ids))  # a list: the engine's own ints
        end = len(ids) if limit is None else max(0, min(int(limit), len(ids)))
        node, n = self._walk(self.root, ids, 0, end)
        self._touch(node, self._tick())
        assert node.depth == n
        return node, n

    def insert(self, parent: TrieNode, ids: Sequence[int], slots: np.ndarray, label: str = "") -> TrieNode | None:
        """Store `ids` (the tokens at positions parent.depth ...) with their K/V slots (int32 [len(ids)]).

        The part of ids already cached under `parent` is reused (split as needed) and only the rest is
        stored: the node takes ownership of the matching part of `slots` (`KVStore.take`); the caller keeps
        the slots of the part that was already cached. Evicts LRU unpinned leaves to make
        room. Returns the node covering ALL of ids (existing or new; node.depth == parent.depth+len(ids)),
        or None if the remainder cannot fit (larger than the budget, or too much is pinned) -- in that case
        nothing is evicted and nothing stored (an existing node may have been split, bytes unchanged).
        The returned node is NOT pinned: pin it. `parent` must be a live node of this trie (the caller
        should hold a pin on it; insert itself protects the path it extends while evicting)."""
        if not self.enabled:
            return None
        if not self._attached(parent):
            raise ValueError("insert: parent is not a live node of this trie (evicted?)")
        ids = tuple(ids) if type(ids) is list else tuple(map(int, ids))  # a list: the engine's own ints
        slots = np.asarray(slots)
        if slots.shape != (len(ids),):
            raise ValueError(f"insert: {slots.shape} slots for {len(ids)} tokens")

        t = self._tick()
        node, i = self._walk(parent, ids, 0, len(ids))
        if i == len(ids):
            self._touch(node, t)
            return node

        rest = slots[i:].astype(np.int32)
        need = len(rest) * self.bytes_per_token
        if self.bytes_in_use + need > self.budget_bytes:
            self.pin(node)  # protect the path we extend while evicting
            try:
                if self.bytes_in_use - self.evictable_bytes() + need > self.budget_bytes:
                    return None  # can't fit even after evicting every unpinned node: evict nothing
                self.evict(self.bytes_in_use + need - self.budget_bytes)
                assert self.bytes_in_use + need <= self.budget_bytes
            finally:
                self.unpin(node)
        if self.store is not None:
            self.store.take(rest)
        new = TrieNode(ids=ids[i:], slots=rest, parent=node, children={},
                       depth=node.depth + len(ids) - i, label=label, bytes_per_token=self.bytes_per_token)
        node.children[new.ids[0]] = new
        self.bytes_in_use += need
        self._n_nodes += 1
        self._touch(new, t)
        return new

    def pin(self, node: TrieNode) -> None:
        """lock += 1 on node and every ancestor, root included; node.pins += 1."""
        self._lock_path(node, None)
        node.pins += 1

    def move_pin(self, old: TrieNode | None, new: TrieNode | None) -> None:
        """`pin(new)` then `unpin(old)` (either None: none), walking only the path between them where `old` is an
        ancestor of `new` (a pin following what its request computed) or the same node."""
        if old is new:
            assert old is None or self._attached(old), "pin: node is not a live node of this trie"
            return
        if new is not None:
            met = self._lock_path(new, old if old is not None and old.pins > 0 else None)
            new.pins += 1
            if met:  # old's lock is unchanged: a pin of its own became one below it
                old.pins -= 1
                return
        if old is not None:
            self.unpin(old)

    def _lock_path(self, node: TrieNode, stop: TrieNode | None) -> bool:
        """lock += 1 from `node` up to `stop` (excluded; None: through the root). True if the walk met `stop`; else
        it went through the root (asserting that `node` is a live node of this trie)."""
        n: TrieNode | None = node
        while n is not None:
            if n is stop:
                return True
            if n.lock == 0 and n.slots is not None:
                self._locked_bytes += n.nbytes
            n.lock += 1
            last, n = n, n.parent
        if last is not self.root:  # a detached (evicted) node, or another trie's: undo
            self._unlock_path(node)
            raise AssertionError("pin: node is not a live node of this trie")
        return False

    def unpin(self, node: TrieNode) -> None:
        """Reverse of pin; the node must hold a pin of its own."""
        assert node.pins > 0, "unpin: node has no pin of its own"
        node.pins -= 1
        self._unlock_path(node)

    def _unlock_path(self, node: TrieNode) -> None:
        """lock -= 1 from `node` through its last ancestor (what `_lock_path(node, None)` added)."""
        n: TrieNode | None = node
        while n is not None:
            n.lock -= 1
            assert n.lock >= 0
            if n.lock == 0 and n.slots is not None:
                self._locked_bytes -= n.nbytes
            n = n.parent

    def path(self, node: TrieNode) -> list[TrieNode]:
        """root's child ... node, in order ([] for the root)."""
        out = []
        n: TrieNode | None = node
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        assert n is self.root, "path: node is not a live node of this trie"
        out.reverse()
        return out

    def path_slots(self, node: TrieNode) -> np.ndarray:
        """The slots of the tokens root -> node (int32 [node.depth]): the page table of the prefix."""
        parts = [n.slots for n in self.path(node)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def path_ids(self, node: TrieNode) -> tuple[int, ...]:
        """The token ids from the root to the end of node (the cache tiers key a node's K/V by them)."""
        return tuple(itertools.chain.from_iterable(n.ids for n in self.path(node)))

    def evictable_bytes(self) -> int:
        """Bytes of nodes with lock == 0 (each such node's whole subtree is unpinned, so all of it
        can be evicted leaf-first). O(1): kept up to date by pin and unpin."""
        return self.bytes_in_use - self._locked_bytes

    def protected_bytes(self) -> int:
        return self.bytes_in_use - self.evictable_bytes()

    def has_room(self, tokens: int) -> bool:
        """Would `insert` store `tokens` new tokens now (evicting unpinned nodes), under a pinned parent?"""
        return self.enabled and self._locked_bytes + tokens * self.bytes_per_token <= self.budget_bytes

    def evict(self, nbytes: int) -> int:
        """Free at least nbytes if possible by evicting unpinned leaves, least recently used first
        (a parent left childless and unpinned becomes a candidate). Returns the bytes freed."""
        if nbytes <= 0:
            return 0
        heap = [(n.last_used, seq, n) for seq, n in enumerate(self._iter_nodes())
                if not n.children and n.lock == 0]
        heapq.heapify(heap)
        seq = len(heap)
        freed = 0
        while heap and freed < nbytes:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and not leaf.children and leaf.lock == 0
            if self.on_evict is not None:  # cache tiers: the leaf's K/V moves down a tier
                self.on_evict(self, leaf)
            freed += leaf.nbytes
            self.bytes_in_use -= leaf.nbytes
            self.evictions += 1
            self.evicted_tokens += len(leaf.ids)
            self._n_nodes -= 1
            del parent.children[leaf.ids[0]]
            leaf.parent = None
            if self.store is not None:
                self.store.free(leaf.slots)
            leaf.slots = None
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_used, seq, parent))
                seq += 1
        return freed

    def pinned_nodes(self) -> int:
        """Number of nodes with lock > 0, the root included (0 <=> no outstanding pins)."""
        return (self.root.lock > 0) + sum(1 for n in self._iter_nodes() if n.lock > 0)

    def check(self) -> None:
        """Assert every invariant (for tests; O(nodes))."""
        r = self.root
        assert r.parent is None and r.slots is None and r.ids == () and r.depth == 0
        total = 0
        count = 0
        held: list[np.ndarray] = []

        def lock_of(n: TrieNode) -> int:
            return n.pins + sum(c.lock for c in n.children.values())

        assert r.lock == lock_of(r), "root lock mismatch"
        assert r.pins >= 0
        for n in self._iter_nodes():
            count += 1
            p = n.parent
            assert p is not None and len(n.ids) >= 1
            assert p.children.get(n.ids[0]) is n, "children key / parent link broken"
            assert n.depth == p.depth + len(n.ids), "depth"
            assert n.pins >= 0 and n.lock == lock_of(n), "lock != pins + children's locks"
            assert p.last_used >= n.last_used, "LRU clock: parent older than child"
            for key, c in n.children.items():
                assert c.ids[0] == key
            assert n.slots is not None and n.slots.shape == (len(n.ids),), "slots != tokens"
            assert n.bytes_per_token == self.bytes_per_token
            held.append(n.slots)
            total += n.nbytes
        for key, c in r.children.items():
            assert c.ids[0] == key and c.parent is r
        assert count == self._n_nodes, "node count"
        assert total == self.bytes_in_use, "bytes_in_use != sum of nbytes"
        locked = sum(n.nbytes for n in self._iter_nodes() if n.lock > 0)
        assert locked == self._locked_bytes, "locked bytes != sum of nbytes of locked nodes"
        assert 0 <= self.bytes_in_use <= self.budget_bytes, "budget exceeded"
        if not self.enabled:
            assert count == 0
        if self.store is not None:  # real slots (a test's are any ints)
            every = np.concatenate(held) if held else np.empty(0, dtype=np.int32)
            assert len(np.unique(every)) == len(every), "two nodes hold one slot"

    def dump(self) -> str:
        """Indented human-readable tree (debugging)."""
        lines: list[str] = []

        def rec(n: TrieNode, indent: int) -> None:
            for c in sorted(n.children.values(), key=lambda c: c.ids[0]):
                lines.append(f"{'  ' * indent}{list(c.ids)} d={c.depth} lock={c.lock} t={c.last_used} {c.label!r}")
                rec(c, indent + 1)

        rec(self.root, 0)
        return "\n".join(lines)
