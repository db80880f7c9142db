"""The mask nodes' contract, free text, and the combinators and / or / not.

A hole's constraint compiles to a tree of `_Node`s (reusable, built once per compilation, may memoize
masks per vocabulary); `node.state(ctx)` gives a `_State` for one generation, all states of a tree
sharing one `_Ctx` (the value's bytes so far)."""
from __future__ import annotations

import numpy as np


class _Ctx:
    """The shared value of one generation: the bytes so far and the token ends."""

    __slots__ = ("value", "ends", "tokens")

    def __init__(self) -> None:
        self.value = bytearray()
        self.ends: list[int] = []
        self.tokens: list[int] = []


class _Node:
    # whether its states' masks cost far more than checking one token (`_State.allows`): a greedy pick then
    # checks the unconstrained pick first (`HoleLoop`); llguidance's (llg.py)
    checks_tokens = False
    # whether, under a token limit, a mask holds only the tokens after which the value can still end within the
    # tokens the limit leaves (`HoleState._looks_ahead`); not llguidance's (llg.py)
    looks_ahead = True

    def state(self, ctx: _Ctx) -> "_State":
        raise NotImplementedError


class _State:
    """allowed(): bool mask (non-special only) or None for every non-special token. can_end().
    advance(tok, old_len): the token's bytes are ctx.value[old_len:]; returns False if the token breaks
    this part (it is dead from then on)."""

    dead = False

    def allowed(self) -> np.ndarray | None:
        raise NotImplementedError

    def allows(self, tok: int) -> bool:
        """Whether allowed() holds `tok` (a non-special token), without computing the whole mask where a
        state can tell more cheaply."""
        mask = self.allowed()
        return mask is None or bool(mask[tok])

    def can_end(self) -> bool:
        raise NotImplementedError

    def advance(self, tok: int, old_len: int) -> bool:
        raise NotImplementedError


# ----- free text -----------------------------------------------------------------------------------------

class _FreeNode(_Node):
    def state(self, ctx):
        return _FreeState()


class _FreeState(_State):
    def allowed(self):
        return None

    def can_end(self):
        return True

    def advance(self, tok, old_len):
        return True


# ----- and / or / not ------------------------------------------------------------------------------------

class _AndNode(_Node):
    def __init__(self, parts: list[_Node]):
        self.parts = parts
        self.checks_tokens = any(p.checks_tokens for p in parts)
        self.looks_ahead = all(p.looks_ahead for p in parts)

    def state(self, ctx):
        return _AndState([p.state(ctx) for p in self.parts])


class _AndState(_State):
    def __init__(self, parts: list[_State]):
        self.parts = parts

    def allowed(self):
        out = None
        for p in self.parts:
            m = p.allowed()
            if m is None:
                continue
            if out is None:
                out = m
            else:
                out = out & m
        return out

    def allows(self, tok):
        return all(p.allows(tok) for p in self.parts)

    def can_end(self):
        return all(p.can_end() for p in self.parts)

    def advance(self, tok, old_len):
        ok = True
        for p in self.parts:
            ok = p.advance(tok, old_len) and ok
        return ok


class _OrNode(_Node):
    def __init__(self, parts: list[_Node]):
        self.parts = parts
        self.checks_tokens = any(p.checks_tokens for p in parts)
        self.looks_ahead = all(p.looks_ahead for p in parts)

    def state(self, ctx):
        return _OrState([p.state(ctx) for p in self.parts])


class _OrState(_State):
    def __init__(self, parts: list[_State]):
        self.parts = parts

    def allowed(self):
        out = None
        for p in self.parts:
            if p.dead:
                continue
            m = p.allowed()
            if m is None:
                return None
            out = m if out is None else out | m
        return out

    def allows(self, tok):  # as allowed(): every token where no part is alive
        alive = [p for p in self.parts if not p.dead]
        return not alive or any(p.allows(tok) for p in alive)

    def can_end(self):
        return any(not p.dead and p.can_end() for p in self.parts)

    @property
    def dead(self):  # type: ignore[override]
        return all(p.dead for p in self.parts)

    def advance(self, tok, old_len):
        alive = False
        for p in self.parts:
            if not p.dead:
                alive = p.advance(tok, old_len) or alive
        return alive


class _NotNode(_Node):
    """`not A` for a choice, INT or STARTS_WITH: every non-special token, can_end iff A cannot end."""

    def __init__(self, part: _Node):
        self.part = part
        self.looks_ahead = part.looks_ahead

    def state(self, ctx):
        return _NotState(self.part.state(ctx))


class _NotState(_State):
    def __init__(self, inner: _State):
        self.inner = inner

    def allowed(self):
        return None

    def can_end(self):
        return not self.inner.can_end()

    def advance(self, tok, old_len):
        self.inner.advance(tok, old_len)
        return True
