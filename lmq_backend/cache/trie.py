"""A radix trie over token ids whose nodes hold per-layer K/V (the prefix cache).

KV layout (shared with the engine's batch cache and the Triton decode kernel)
----------------------------------------------------------------------------
``node.kv: torch.Tensor`` has shape ``[L, 2, H_kv, T, D]``:
(layer, 0=K / 1=V, kv head, token, head dim); contiguous; the model's dtype and
device; it holds the node's OWN ``T`` tokens only (its segment ``node.ids``).
K is stored after RoPE (as Hugging Face caches keep it), so the K/V of a path
root -> node concatenated along dim 3 is exactly the cache of that prefix::

    torch.cat(trie.path_kv(node), dim=3)   # [L, 2, H_kv, node.depth, D]

Batch cache (engine): per layer K and V ``[B, H_kv, S, D]``, rows left-padded so
that every row's valid tokens end at the same column; the decode kernel reads
each row from a per-row start column to that common end.

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
  fresh contiguous copies; the old tensor is dropped; ``bytes_in_use`` is
  unchanged.
* Eviction removes unpinned leaves in LRU order (a heap), which may turn their
  parents into candidates.  Evicted nodes are detached (``parent=None``,
  ``kv=None``); using one afterwards is an error.
* The budget is hard: ``bytes_in_use <= budget_bytes`` at every moment.  An
  insert whose new bytes can't fit even after evicting every unpinned node
  evicts nothing and stores nothing (returns None).

The trie knows nothing about asyncio, models or queries.  Not thread-safe.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

__all__ = ["TrieNode", "PrefixTrie"]


@dataclass(slots=True, eq=False)
class TrieNode:
    ids: tuple[int, ...]
    kv: torch.Tensor | None
    parent: TrieNode | None
    children: dict[int, TrieNode] = field(default_factory=dict)
    depth: int = 0
    lock: int = 0
    last_used: int = 0
    label: str = ""
    pins: int = 0  # pins taken directly on this node object (lock counts the subtree's)

    @property
    def nbytes(self) -> int:
        kv = self.kv
        return 0 if kv is None else kv.numel() * kv.element_size()

    def __repr__(self) -> str:  # dataclass repr would recurse through parent/children
        return (f"TrieNode(T={len(self.ids)}, depth={self.depth}, lock={self.lock}, pins={self.pins}, "
                f"last_used={self.last_used}, children={len(self.children)}, label={self.label!r})")


def _own(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy: never aliases (or keeps alive) the source storage."""
    return x.clone(memory_format=torch.contiguous_format)


class PrefixTrie:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.root = TrieNode(ids=(), kv=None, parent=None)
        self.budget_bytes = int(budget_bytes)
        self.bytes_in_use = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self._n_nodes = 0
        self._clock = 0
        # (L, H_kv, D, dtype, device) of the stored tensors, fixed by the first insert
        self._meta: tuple | None = None

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
        n = node
        while n.parent is not None:
            if n.parent.children.get(n.ids[0]) is not n:
                return False
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
        assert node.kv is not None and 0 < k < len(node.ids)
        parent = node.parent
        assert parent is not None
        old = node.kv
        upper = TrieNode(
            ids=node.ids[:k], kv=_own(old[:, :, :, :k, :]), parent=parent, children={},
            depth=node.depth - len(node.ids) + k, lock=node.lock, last_used=node.last_used, label="", pins=0,
        )
        node.kv = _own(old[:, :, :, k:, :])
        del old
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
        ids = tuple(map(int, ids))
        end = len(ids) if limit is None else max(0, min(int(limit), len(ids)))
        node, n = self._walk(self.root, ids, 0, end)
        self._touch(node, self._tick())
        assert node.depth == n
        return node, n

    def insert(self, parent: TrieNode, ids: Sequence[int], kv: torch.Tensor, label: str = "") -> TrieNode | None:
        """Store `ids` (the tokens at positions parent.depth ...) with their kv [L, 2, H_kv, len(ids), D].

        The part of ids already cached under `parent` is reused (split as needed) and only the rest is
        stored (a private contiguous copy of the matching slice of kv). Evicts LRU unpinned leaves to make
        room. Returns the node covering ALL of ids (existing or new; node.depth == parent.depth+len(ids)),
        or None if the remainder cannot fit (larger than the budget, or too much is pinned) -- in that case
        nothing is evicted and nothing stored (an existing node may have been split, bytes unchanged).
        The returned node is NOT pinned: pin it. `parent` must be a live node of this trie (the caller
        should hold a pin on it; insert itself protects the path it extends while evicting)."""
        if not self.enabled:
            return None
        if not self._attached(parent):
            raise ValueError("insert: parent is not a live node of this trie (evicted?)")
        ids = tuple(map(int, ids))
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[3] != len(ids):
            raise ValueError(f"insert: kv shape {tuple(kv.shape)} is not [L, 2, H_kv, {len(ids)}, D]")
        meta = (kv.shape[0], kv.shape[2], kv.shape[4], kv.dtype, kv.device)
        if self._meta is None:
            self._meta = meta
        elif meta != self._meta:
            raise ValueError(f"insert: kv (L, H_kv, D, dtype, device) {meta} != stored {self._meta}")

        t = self._tick()
        node, i = self._walk(parent, ids, 0, len(ids))
        if i == len(ids):
            self._touch(node, t)
            return node

        rest = kv[:, :, :, i:, :]
        need = rest.numel() * rest.element_size()
        self.pin(node)  # protect the path we extend while evicting
        try:
            if self.bytes_in_use + need > self.budget_bytes:
                if self.bytes_in_use - self.evictable_bytes() + need > self.budget_bytes:
                    return None  # can't fit even after evicting every unpinned node: evict nothing
                self.evict(self.bytes_in_use + need - self.budget_bytes)
                assert self.bytes_in_use + need <= self.budget_bytes
            new = TrieNode(ids=ids[i:], kv=_own(rest), parent=node, children={},
                           depth=node.depth + len(ids) - i, label=label)
            node.children[new.ids[0]] = new
            self.bytes_in_use += need
            self._n_nodes += 1
        finally:
            self.unpin(node)
        self._touch(new, t)
        return new

    def pin(self, node: TrieNode) -> None:
        """lock += 1 on node and every ancestor, root included; node.pins += 1."""
        assert self._attached(node), "pin: node is not a live node of this trie"
        node.pins += 1
        n: TrieNode | None = node
        while n is not None:
            n.lock += 1
            n = n.parent

    def unpin(self, node: TrieNode) -> None:
        """Reverse of pin; the node must hold a pin of its own."""
        assert node.pins > 0, "unpin: node has no pin of its own"
        node.pins -= 1
        n: TrieNode | None = node
        while n is not None:
            n.lock -= 1
            assert n.lock >= 0
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

    def path_kv(self, node: TrieNode) -> list[torch.Tensor]:
        """The kv tensors of path(node); torch.cat(..., dim=3) is the cache of the prefix."""
        return [n.kv for n in self.path(node)]  # type: ignore[misc]

    def path_ids(self, node: TrieNode) -> tuple[int, ...]:
        """The token ids from the root to the end of node."""
        return tuple(t for n in self.path(node) for t in n.ids)

    def evictable_bytes(self) -> int:
        """Bytes of nodes with lock == 0 (each such node's whole subtree is unpinned, so all of it
        can be evicted leaf-first)."""
        return sum(n.nbytes for n in self._iter_nodes() if n.lock == 0)

    def protected_bytes(self) -> int:
        return self.bytes_in_use - self.evictable_bytes()

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
            freed += leaf.nbytes
            self.bytes_in_use -= leaf.nbytes
            self.evictions += 1
            self.evicted_tokens += len(leaf.ids)
            self._n_nodes -= 1
            del parent.children[leaf.ids[0]]
            leaf.parent = None
            leaf.kv = None
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
        assert r.parent is None and r.kv is None and r.ids == () and r.depth == 0
        total = 0
        count = 0
        storages: set[int] = set()

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
            kv = n.kv
            assert kv is not None and kv.dim() == 5 and kv.is_contiguous()
            L, two, H, T, D = kv.shape
            assert two == 2 and T == len(n.ids)
            assert self._meta == (L, H, D, kv.dtype, kv.device)
            st = kv.untyped_storage()
            assert st.nbytes() == n.nbytes, "node keeps a larger storage alive"
            assert st.data_ptr() not in storages, "two nodes share storage"
            storages.add(st.data_ptr())
            total += n.nbytes
        for key, c in r.children.items():
            assert c.ids[0] == key and c.parent is r
        assert count == self._n_nodes, "node count"
        assert total == self.bytes_in_use, "bytes_in_use != sum of nbytes"
        assert 0 <= self.bytes_in_use <= self.budget_bytes, "budget exceeded"
        if not self.enabled:
            assert count == 0

    def dump(self) -> str:
        """Indented human-readable tree (debugging)."""
        lines: list[str] = []

        def rec(n: TrieNode, indent: int) -> None:
            for c in sorted(n.children.values(), key=lambda c: c.ids[0]):
                lines.append(f"{'  ' * indent}{list(c.ids)} d={c.depth} lock={c.lock} t={c.last_used} {c.label!r}")
                rec(c, indent + 1)

        rec(self.root, 0)
        return "\n".join(lines)
