"""lmq's own token masks: choice (`X in [...]`), INT, STARTS_WITH, (not) contains, length in characters.

Each is a numpy operation over the vocabulary or a lookup proportional to the option / string lengths,
over the tables of `VocabIndex`, memoized per node where the state space is small."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ...text.vocab import VocabIndex
from .nodes import _Ctx, _Node, _State


# ----- choice: a byte trie over the options --------------------------------------------------------------

_END = b""  # key of the terminal mark in a trie node


class _ChoiceNode(_Node):
    def __init__(self, options: list[str], vocab: VocabIndex):
        self.vocab = vocab
        self.root: dict = {}
        for o in options:
            node = self.root
            for b in o.encode("utf-8"):
                node = node.setdefault(bytes((b,)), {})
            node[_END] = True
        self._cache: OrderedDict[int, tuple[dict, np.ndarray]] = OrderedDict()
        self._masks: OrderedDict[int, tuple[dict, np.ndarray]] = OrderedDict()

    def mask_at(self, node: dict) -> np.ndarray:
        """The mask of `ids_at(node)`, read-only and shared by every state at that node (memoized, LRU: a
        step of rows in one state then moves one mask, not one a row)."""
        key = id(node)
        hit = self._masks.get(key)
        if hit is not None and hit[0] is node:
            self._masks.move_to_end(key)
            return hit[1]
        mask = np.zeros(self.vocab.size, dtype=bool)
        mask[self.ids_at(node)] = True
        mask.flags.writeable = False
        self._masks[key] = (node, mask)
        if len(self._masks) > 256:
            self._masks.popitem(last=False)
        return mask

    def ids_at(self, node: dict) -> np.ndarray:
        """The tokens whose bytes walk from `node` to some trie node (memoized per node, LRU)."""
        key = id(node)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is node:
            self._cache.move_to_end(key)
            return hit[1]
        prefixes = self.vocab.token_prefixes
        get = self.vocab.bytes_to_ids.get
        found: list[np.ndarray] = []
        stack: list[tuple[dict, bytes]] = [(node, b"")]
        while stack:
            n, acc = stack.pop()
            for k, child in n.items():
                if k is _END or not k:
                    continue
                p = acc + k
                if p not in prefixes:
                    continue
                ids = get(p)
                if ids is not None:
                    found.append(ids)
                stack.append((child, p))
        ids = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        self._cache[key] = (node, ids)
        if len(self._cache) > 4096:
            self._cache.popitem(last=False)
        return ids

    def state(self, ctx):
        return _ChoiceState(self, ctx)


class _ChoiceState(_State):
    def __init__(self, node: _ChoiceNode, ctx: _Ctx):
        self.node, self.ctx, self.at, self.dead = node, ctx, node.root, False

    def allowed(self):
        return np.zeros(self.node.vocab.size, dtype=bool) if self.dead else self.node.mask_at(self.at)

    def can_end(self):
        return not self.dead and _END in self.at

    def advance(self, tok, old_len):
        if self.dead:
            return False
        at = self.at
        for b in bytes(self.ctx.value[old_len:]):
            at = at.get(bytes((b,)))
            if at is None:
                self.dead = True
                return False
        self.at = at
        return True


# ----- INT -----------------------------------------------------------------------------------------------

def _int_tables(vocab: VocabIndex):
    def build():
        masks = [
            vocab.tokens_matching(rb" ?-?[0-9]*"),  # start
            vocab.tokens_matching(rb"-?[0-9]*"),    # after the space
            vocab.tokens_matching(rb"[0-9]+"),      # after the minus
            vocab.tokens_matching(rb"[0-9]+"),      # digits
        ]
        return masks
    return vocab.memo("int-masks", build)


def _int_step(state: int, data: bytes) -> int:
    """The INT DFA: 0 start, 1 after ' ', 2 after '-', 3 digits; -1 dead."""
    for c in data:
        if 0x30 <= c <= 0x39:
            state = 3
        elif c == 0x20 and state == 0:
            state = 1
        elif c == 0x2D and state in (0, 1):
            state = 2
        else:
            return -1
    return state


class _IntNode(_Node):
    def __init__(self, vocab: VocabIndex):
        self.vocab = vocab
        self.masks = _int_tables(vocab)

    def state(self, ctx):
        return _IntState(self, ctx)


class _IntState(_State):
    def __init__(self, node: _IntNode, ctx: _Ctx):
        self.node, self.ctx, self.q, self.dead = node, ctx, 0, False

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.masks[self.q]

    def can_end(self):
        return not self.dead and self.q == 3

    def advance(self, tok, old_len):
        if self.dead:
            return False
        self.q = _int_step(self.q, bytes(self.ctx.value[old_len:]))
        if self.q < 0:
            self.dead = True
        return not self.dead


# ----- STARTS_WITH ---------------------------------------------------------------------------------------

class _StartsWithNode(_Node):
    def __init__(self, prefix: str, vocab: VocabIndex):
        self.vocab = vocab
        self.prefix = prefix.encode("utf-8")
        self._masks: dict[int, np.ndarray] = {}

    def mask_at(self, n: int) -> np.ndarray:
        """The mask after the first n bytes of the prefix."""
        hit = self._masks.get(n)
        if hit is None:
            vocab = self.vocab
            rest = self.prefix[n:]
            hit = np.zeros(vocab.size, dtype=bool)
            for ids in vocab.ids_prefix_of(rest):
                hit[ids] = True
            hit[vocab.ids_starting_with(rest)] = True
            hit.flags.writeable = False
            self._masks[n] = hit
        return hit

    def state(self, ctx):
        return _StartsWithState(self, ctx)


class _StartsWithState(_State):
    def __init__(self, node: _StartsWithNode, ctx: _Ctx):
        self.node, self.ctx, self.dead = node, ctx, False

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        n = len(self.ctx.value)
        if n >= len(self.node.prefix):
            return None
        return self.node.mask_at(n)

    def can_end(self):
        return not self.dead and len(self.ctx.value) >= len(self.node.prefix)

    def advance(self, tok, old_len):
        if self.dead:
            return False
        p = self.node.prefix
        if old_len < len(p):
            v = self.ctx.value
            m = min(len(v), len(p))
            if bytes(v[old_len:m]) != p[old_len:m]:
                self.dead = True
        return not self.dead


# ----- contains / not contains ---------------------------------------------------------------------------

class _ContainsNode(_Node):
    def __init__(self, needle: str, vocab: VocabIndex):
        self.vocab, self.needle = vocab, needle.encode("utf-8")

    def state(self, ctx):
        return _ContainsState(self, ctx)


class _ContainsState(_State):
    def __init__(self, node: _ContainsNode, ctx: _Ctx):
        self.node, self.ctx, self.found = node, ctx, not node.needle

    def allowed(self):
        return None

    def can_end(self):
        return self.found

    def advance(self, tok, old_len):
        if not self.found:
            s = self.node.needle
            self.found = self.ctx.value.find(s, max(0, old_len - len(s) + 1)) >= 0
        return True


class _NotContainsNode(_Node):
    def __init__(self, needle: str, vocab: VocabIndex):
        self.vocab, self.needle = vocab, needle.encode("utf-8")
        self.base = ~vocab.tokens_containing(self.needle) & vocab.nonspecial if self.needle else \
            np.zeros(vocab.size, dtype=bool)
        self.base.flags.writeable = False
        self._masks: dict[int, np.ndarray] = {}  # keyed by the set of k (as a bitmask) the value ends with

    def mask_for(self, value: bytearray) -> np.ndarray:
        s = self.needle
        key = 0
        for k in range(1, len(s)):
            if value.endswith(s[:k]):
                key |= 1 << k
        if not key:
            return self.base
        hit = self._masks.get(key)
        if hit is None:
            hit = self.base.copy()
            for k in range(1, len(s)):
                if key >> k & 1:
                    hit[self.vocab.ids_starting_with(s[k:])] = False
            hit.flags.writeable = False
            if len(self._masks) < 1024:
                self._masks[key] = hit
        return hit

    def state(self, ctx):
        return _NotContainsState(self, ctx)


class _NotContainsState(_State):
    def __init__(self, node: _NotContainsNode, ctx: _Ctx):
        self.node, self.ctx, self.dead = node, ctx, not node.needle

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.mask_for(self.ctx.value)

    def can_end(self):
        return not self.dead

    def advance(self, tok, old_len):
        if not self.dead:
            s = self.node.needle
            if self.ctx.value.find(s, max(0, old_len - len(s) + 1)) >= 0:
                self.dead = True
        return not self.dead


# ----- length in characters ------------------------------------------------------------------------------

class _LenNode(_Node):
    """max_chars: the value has at most that many characters; min_chars: can_end only from there on.
    Characters are counted as `len(value.decode("utf-8", errors="replace"))` counts them, token by token
    (`VocabIndex.utf8_tables`: the count a token adds depends on the continuation bytes still expected)."""

    def __init__(self, vocab: VocabIndex, max_chars: int | None = None, min_chars: int | None = None):
        self.vocab, self.max_chars, self.min_chars = vocab, max_chars, min_chars
        self._masks: dict[tuple[int, int], np.ndarray] = {}

    def mask_for(self, pending: int, budget: int) -> np.ndarray:
        key = (pending, budget)
        hit = self._masks.get(key)
        if hit is None:
            hit = (self.vocab.utf8_tables(pending)[0] <= budget) & self.vocab.nonspecial
            hit.flags.writeable = False
            if len(self._masks) < 512:
                self._masks[key] = hit
        return hit

    def state(self, ctx):
        return _LenState(self)


class _LenState(_State):
    def __init__(self, node: _LenNode):
        self.node, self.chars, self.pending, self.dead = node, 0, 0, False

    def allowed(self):
        if self.node.max_chars is None:
            return None
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.mask_for(self.pending, self.node.max_chars - self.chars)

    def can_end(self):
        return not self.dead and (self.node.min_chars is None or self.chars >= self.node.min_chars)

    def advance(self, tok, old_len):
        chars, nxt = self.node.vocab.utf8_tables(self.pending)
        self.chars += int(chars[tok])
        self.pending = int(nxt[tok])
        if self.node.max_chars is not None and self.chars > self.node.max_chars:
            self.dead = True
        return not self.dead
