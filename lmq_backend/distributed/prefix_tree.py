"""An approximate prefix tree of the prompt text one replica recently served (the router's guess at what its
trie holds). Characters, not tokens: the router never tokenizes. Edges are strings; a node remembers when a
call last passed through it, and `evict` drops least-recently-used leaves until the tree holds at most
`max_chars` characters. Pure Python; knows nothing of Ray or of models.
"""
from __future__ import annotations

import heapq
import itertools

_clock = itertools.count()


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (binary search over slice comparisons, which run
    in C: O(log n) comparisons instead of a Python loop per character)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: str, parent: "_Node | None"):
        self.edge = edge                       # the text on the edge from the parent to this node
        self.children: dict[str, _Node] = {}   # keyed by the first character of the child's edge
        self.parent = parent
        self.last_used = next(_clock)


class ApproxPrefixTree:
    """`insert(text)`, `match(text) -> matched chars`, `evict()`; `size` is the characters held."""

    def __init__(self, max_chars: int = 2**22):
        self.root = _Node("", None)
        self.size = 0
        self.max_chars = max_chars

    def match(self, text: str) -> int:
        """Characters of the longest prefix of `text` that the tree holds."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                return pos
            n = common_prefix_length(child.edge, text[pos:pos + len(child.edge)])
            pos += n
            if n < len(child.edge):
                return pos
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Add `text` (marking its path as just used), then evict down to `max_chars` if over."""
        node, pos = self.root, 0
        stamp = next(_clock)
        node.last_used = stamp
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.last_used = stamp
                node.children[text[pos]] = leaf
                self.size += len(text) - pos
                break
            n = common_prefix_length(child.edge, text[pos:pos + len(child.edge)])
            if n < len(child.edge):  # split the edge at the mismatch
                middle = _Node(child.edge[:n], node)
                node.children[text[pos]] = middle
                child.edge, child.parent = child.edge[n:], middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = stamp
            pos += n
            node = child
        if self.size > self.max_chars:
            self.evict(self.max_chars)

    def evict(self, max_chars: int) -> None:
        """Drop least-recently-used leaves until at most `max_chars` characters remain."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n is not self.root]
        heapq.heapify(leaves)
        while self.size > max_chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
