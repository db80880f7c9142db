"""`HoleState`: one generation of a hole, driven by the backend token by token.

What the backend calls, per token of the value (`HFBackend.generate`):

    state = hole_constraint.start()           # a fresh state; a HoleConstraint is reusable
    loop:
        mask = state.allowed()                # bool[vocab.size]: the tokens that validly extend the value;
                                              # None: every non-special token. Special tokens and EOS are
                                              # never in a mask: ending is what can_end() says.
        end_ok = state.can_end()              # the value satisfies the constraint now (the hole may end)
        ok = state.allows(token)              # allowed()[token], without the whole mask where cheaper;
                                              # asked only where state.checks_tokens (both optional: a
                                              # state without them is asked for its masks). A state that
                                              # checks tokens constrains text: inside a UTF-8 character it
                                              # allows only tokens that keep it well-formed (the engine
                                              # proposes its picks among those: backend/hole_loop.py)
        stop = state.advance(token)           # append a token from allowed(); a `Stop` when a stop rule
                                              # (STOPS_AT, STOPS_BEFORE, len(TOKENS(X)) < n) fired
    value = stop.text if stop else state.text

- allowed() returns an array the caller may modify, or a read-only one that states share (a constraint's
  memoized mask: copy it to modify); after a stop, or once the token limit is reached, it is all False. It is
  computed once per token (advance() invalidates it). Under a constraint on the text of lmq's own masks
  (options, INT, STARTS_WITH, ...; not llguidance's) and a token limit, it holds only the tokens after which the
  value can still end within the tokens the limit leaves (each tried, where at most LOOKAHEAD_MAX are allowed; a
  search of the masks after it, longest tokens first, of at most LOOKAHEAD_STATES states a mask):
  `X in [" apple pie", " pear"] and len(TOKENS(X)) < 4` never takes `" a"` where no two tokens spell
  `"pple pie"`, and `len(TOKENS(X)) < 2` takes a one-token option.
- A stop rule that ends the value where the rest of the constraint does not let it end (a token limit in the
  middle of an option, `STOPS_AT` before a REGEX is matched) gives a `Stop` that says so (`broken`): the
  backend refuses that value with an error, a beam drops it; never a value that breaks its constraint.
- advance() of a special or out-of-range token, or after a stop, raises LMQRuntimeError.
- A free hole's state (`free`: no constraint on the text, only stop rules and a token limit) takes tokens
  without a check before each: allowed() is None and can_end() True whatever it has taken. Where it watches
  no text either (`watches_text` False: no stop rule), only its token limit `max_tokens` ends it, and its
  tokens may come several at once (`extend`).
- Values are bytes inside (`value_bytes`); `text` decodes them with errors="replace". `tokens`,
  `n_tokens`: the appended ids.
"""
from __future__ import annotations

from itertools import accumulate, islice
from typing import Any, NoReturn

import numpy as np

from ...errors import LMQRuntimeError
from ...text.vocab import VocabIndex
from .nodes import _Ctx, _FreeNode, _Node
from .stops import Stop, _StopString

LOOKAHEAD_MAX = 256  # the most tokens a mask under a token limit is narrowed among by trying each
LOOKAHEAD_STATES = 4096  # the most states that search tries a mask (beyond: a token is kept, as untried)


class HoleConstraint:
    """The compiled constraint of one hole; `start()` gives a fresh `HoleState` (cheap, reusable)."""

    def __init__(self, node: _Node, vocab: VocabIndex, stops: list[_StopString], max_tokens: int | None):
        self.node, self.vocab, self.stops, self.max_tokens = node, vocab, stops, max_tokens
        self.unconstrained = isinstance(node, _FreeNode) and not stops and max_tokens is None
        self.free = isinstance(node, _FreeNode)
        # advance()'s check of a token, per token: bytes index as ints, ~5x faster than the numpy array
        self._special = vocab.special.astype(np.uint8).tobytes()

    def start(self) -> "HoleState":
        return HoleState(self)


class HoleState:
    """One generation of a hole: see the module docstring for what the backend calls per token."""

    def __init__(self, hc: HoleConstraint):
        self.hc = hc
        self.ctx = _Ctx()
        self.root = hc.node.state(self.ctx)
        self._allowed: Any = False  # False: not computed yet
        self._stopped: Stop | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.ctx.tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self.ctx.tokens)

    @property
    def value_bytes(self) -> bytes:
        return bytes(self.ctx.value)

    @property
    def text(self) -> str:
        return self.ctx.value.decode("utf-8", errors="replace")

    @property
    def stopped(self) -> Stop | None:
        """The stop rule that fired (the value is its `text`), None while none has."""
        return self._stopped

    def allowed(self) -> np.ndarray | None:
        if self._allowed is False:
            limit = self.hc.max_tokens
            if self._stopped is not None or (limit is not None and len(self.ctx.tokens) >= limit):
                mask = np.zeros(self.hc.vocab.size, dtype=bool)
            else:
                mask = self.root.allowed()
                if self._looks_ahead():
                    mask = _EndingSearch(self.hc).narrow(mask, self.ctx.tokens, limit - len(self.ctx.tokens) - 1)
            self._allowed = mask
        mask = self._allowed
        return mask if mask is None or not mask.flags.writeable else mask.copy()

    def _looks_ahead(self) -> bool:
        """Must the next token leave a value that can end within the token limit, under a constraint on the text
        that is lmq's own mask? (Not llguidance's REGEX / JSON / GRAMMAR: their picks check one token against
        the constraint, `allows`, where the look-ahead would need the whole mask; a value the limit cuts there
        is refused.)"""
        return self.hc.max_tokens is not None and not self.hc.free and self.hc.node.looks_ahead

    @property
    def checks_tokens(self) -> bool:
        """Whether `allows` is far cheaper than `allowed` (see `_Node.checks_tokens`)."""
        return self.hc.node.checks_tokens

    def allows(self, token_id: int) -> bool:
        """Whether allowed() holds the (non-special) token, without computing the mask where the constraint
        can tell more cheaply (llguidance's: one token ~0.6 us against 0.01-0.44 ms a mask)."""
        if self._allowed is False:
            limit = self.hc.max_tokens
            if self._stopped is None and (limit is None or len(self.ctx.tokens) < limit):
                if not self.root.allows(token_id):
                    return False
                if not self._looks_ahead():
                    return True
            self.allowed()
        mask = self._allowed
        return mask is None or bool(mask[token_id])

    def can_end(self) -> bool:
        return self.root.can_end()

    @property
    def free(self) -> bool:
        """Is the text free (see the module docstring)?"""
        return self.hc.free

    @property
    def watches_text(self) -> bool:
        """Does a stop rule read the value as each token comes?"""
        return bool(self.hc.stops)

    @property
    def max_tokens(self) -> int | None:
        """The most tokens the value may hold (`len(TOKENS(X)) < n`), None: no limit."""
        return self.hc.max_tokens

    def extend(self, tokens: list[int]) -> Stop | None:
        """advance() of each token in turn: the last one's answer. A free state that watches no text takes
        them at once."""
        hc, ctx = self.hc, self.ctx
        limit = hc.max_tokens
        if not hc.free or hc.stops or self._stopped is not None or (
                limit is not None and len(ctx.tokens) + len(tokens) > limit):
            stop = None
            for token in tokens:
                stop = self.advance(token)
            return stop
        special = hc._special
        if tokens and (min(tokens) < 0 or max(tokens) >= len(special) or any(map(special.__getitem__, tokens))):
            _not_a_value(next(t for t in tokens if not 0 <= t < len(special) or special[t]))
        pieces = list(map(hc.vocab.token_bytes.__getitem__, tokens))
        value = ctx.value
        ctx.ends.extend(islice(accumulate(map(len, pieces), initial=len(value)), 1, None))
        value += b"".join(pieces)
        ctx.tokens.extend(tokens)
        self._allowed = False
        if limit is not None and len(ctx.tokens) >= limit:
            self._stopped = self._make_stop(len(value))
        return self._stopped

    def advance(self, token_id: int) -> Stop | None:
        if self._stopped is not None:
            raise LMQRuntimeError("advance() after the hole stopped")
        token_id = int(token_id)
        hc = self.hc
        special = hc._special
        if not 0 <= token_id < len(special) or special[token_id]:
            _not_a_value(token_id)
        ctx = self.ctx
        value = ctx.value  # a bytearray: += below extends ctx.value itself
        old_len = len(value)
        value += hc.vocab.token_bytes[token_id]
        ctx.ends.append(len(value))
        ctx.tokens.append(token_id)
        self._allowed = False
        self.root.advance(token_id, old_len)
        end: int | None = None
        fired = None
        for rule in hc.stops:
            e = rule.end(value, old_len)
            if e is not None and (end is None or e < end):
                end, fired = e, rule
        if end is None and hc.max_tokens is not None and len(ctx.tokens) >= hc.max_tokens:
            end = len(value)
        if end is None:
            return None
        self._stopped = self._make_stop(end, fired)
        return self._stopped

    def _make_stop(self, end: int, fired=None) -> Stop:
        """The value a stop rule (`fired`, a stop string; None: the token limit) ended at byte `end`."""
        value = self.ctx.value
        if end == len(value):  # (every token kept, no tail: the state holds the value as it ends)
            ok = self.hc.free or self.root.can_end()
            return Stop(text=value.decode("utf-8", errors="replace"), keep=len(self.ctx.ends), tail="",
                        broken="" if ok else self._rule(fired))
        keep = 0
        for i, e in enumerate(self.ctx.ends):
            if e > end:
                break
            # a kept token must end on a character boundary, so that the tail is a whole string
            if e == len(value) or e == end or value[e] & 0xC0 != 0x80:
                keep = i + 1
        start = self.ctx.ends[keep - 1] if keep else 0
        tail = bytes(value[start:end]).decode("utf-8", errors="replace")
        # the value's own ids (as the backend takes them: the kept tokens, the tail tokenized) on a fresh state
        ok = self.hc.free or _EndingSearch(self.hc).ends_within([*self.ctx.tokens[:keep],
                                                                 *self.hc.vocab.encode_continuation(tail)], 0)
        return Stop(text=bytes(value[:end]).decode("utf-8", errors="replace"), keep=keep, tail=tail,
                    broken="" if ok else self._rule(fired))

    def _rule(self, fired) -> str:
        """The stop rule that fired, as `Stop.broken` names it (`fired` None: the token limit)."""
        return str(fired) if fired is not None else f"the token limit ({self.hc.max_tokens} tokens)"


class _EndingSearch:
    """Which tokens of a mask leave a value that can end within the tokens a limit leaves: for each, a depth-first
    search of the masks after it (a fresh state replayed by the tokens, longest tokens first, values seen
    remembered), of at most LOOKAHEAD_STATES states; a token whose search runs out of states is kept."""

    def __init__(self, hc: HoleConstraint):
        self.hc, self.states = hc, 0
        self.known: dict[tuple[bytes, int], bool] = {}
        self.token_bytes = hc.vocab.token_bytes

    def narrow(self, mask: np.ndarray | None, tokens: list[int], more: int) -> np.ndarray | None:
        """The tokens of `mask` after which (appended to `tokens`) the value can end within `more` more tokens;
        `mask` itself where it has more than LOOKAHEAD_MAX tokens (or is None)."""
        if mask is None:
            return mask
        candidates = np.flatnonzero(mask)
        if len(candidates) > LOOKAHEAD_MAX:
            return mask
        out = np.zeros(self.hc.vocab.size, dtype=bool)
        for token in candidates.tolist():
            out[token] = self.ends_within([*tokens, token], more)
        return out

    def ends_within(self, tokens: list[int], more: int) -> bool:
        """Can the value of `tokens` end within `more` more tokens (0: as it is)?"""
        self.states += 1
        if self.states > LOOKAHEAD_STATES:
            return True
        state, value = self._replayed(tokens)
        if state is None:
            return False
        if state.can_end():
            return True
        if more <= 0:
            return False
        key = (value, more)
        if key not in self.known:
            mask = state.allowed()
            if mask is None:
                return True
            candidates = sorted(np.flatnonzero(mask).tolist(), key=lambda t: -len(self.token_bytes[t]))
            self.known[key] = any(self.ends_within([*tokens, t], more - 1) for t in candidates[:LOOKAHEAD_MAX])
        return self.known[key]

    def _replayed(self, tokens: list[int]) -> tuple[Any, bytes]:
        """A fresh state advanced by `tokens`, and the value's bytes (None for the state where one breaks it)."""
        ctx = _Ctx()
        state = self.hc.node.state(ctx)
        for token in tokens:
            old_len = len(ctx.value)
            ctx.value += self.token_bytes[token]
            ctx.ends.append(len(ctx.value))
            ctx.tokens.append(token)
            if not state.advance(token, old_len):
                return None, b""
        return state, bytes(ctx.value)


def _not_a_value(token: int) -> NoReturn:
    raise LMQRuntimeError(f"token {token} cannot be part of a value (special or out of range)")
