"""Beam decoders: `beam(n)`, `beam_var(n)` and `var(b, n)`, over the whole query program.

A beam is a query run at a hole: the values of the holes before it, the hole's tokens so far, the
constraint's state, and its score: the sum of the log-probabilities of every token the decoder chose,
under the model's full distribution (a mask selects tokens, it does not renormalise them), ending a value
counting as choosing the most likely token that cannot extend it (as greedy decoding ends a hole).
Prompt text is given, not chosen: it adds nothing. Scores only fall as beams grow, so a beam search can
stop once no live beam can beat the finished ones.

- `beam(n)`: one beam search over the query: at every step each live beam proposes its `n` best
  choices (a next token or ending the value), the `n` best of all proposals stay live, beams may be at
  different holes. A beam whose program ends is finished; the `n` best finished beams are kept. n=1 is
  greedy decoding (`argmax`).
- `beam_sample(n, temperature)`: `beam(n)` where each live beam proposes the distinct choices among `n`
  draws from its distribution at `temperature` (LMQL's: each beam repeated n times, one token sampled each,
  duplicates merged); the `n` best proposals by score stay live. A draw is over the tokens that extend the
  value and, where it may end, ending it (weighed as its most likely ending token, as scores weigh it);
  `seed` makes the draws repeat.
- `beam_var(n)`: beams pooled by variable: all beams fill their next hole together, and a beam that
  ended its value waits for the others, so that values compete only with values of the same variable.
  Once the hole's search is decided (`n` values that no live beam can beat), the `n` best go on.
- `var(b, n)`: variable-level search: each of the `n` kept beams searches the hole on its own with `b`
  beams; the `n` best of all the values found go on. (LMQL's `var` searches a hole by sampling unless
  told `subdecoder="beam"`; lmq's is that deterministic form.)
- `best_k(k, budget, kappa, beta, gamma, max_heap_size, top_k_continuations)`: LMQL's best-first search
  over a heap of beams at any hole (`_best_k` says how); every beam that finished is a result.

A beam goes from one hole to the next by replaying the program with its values (LMQL replays too): the
Python between holes runs again for every beam at every hole, so it should only read inputs and values.
Each step, every live beam asks the backend for its next choices at once (`Backend.next_tokens`,
gathered): the scheduler batches them, and their prefixes are shared in the prefix trie. The call
returns the `n` best results, best first, each with its `score`.
"""
from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from typing import Any

from ..backend.protocol import Backend, NextTokens, Sequence
from ..errors import LMQLengthError, LMQRuntimeError, LMQUnsatisfiedError
from ..language import ast
from ..language.codegen import Program
from .constraints import HoleConstraint, HoleState
from .decoders import DecoderSpec, Greedy
from .interpreter import Result, Run


@dataclass(frozen=True, slots=True)
class Filled:
    """A hole's value as a beam chose it: its token ids in the sequence and its text."""

    ids: tuple[int, ...]
    text: str


class _AtHole(BaseException):
    """A replay reached the first hole it has no value for (a BaseException: the query's own `try` does not
    catch it)."""


@dataclass
class _Replay(Run):
    """A run that takes its first holes' values from `values` and stops at the next hole (`stopped`)."""

    values: tuple[Filled, ...] = ()
    consumed: int = 0
    stopped: tuple[Sequence, HoleConstraint] | None = None

    async def _fill(self, seq: Sequence, hole: ast.Hole, constraint: HoleConstraint) -> str:
        if self.consumed < len(self.values):
            value = self.values[self.consumed]
            self.consumed += 1
            self.backend.append(seq, list(value.ids), value.text)
            return value.text
        self.stopped = (self.backend.fork(seq), constraint)
        raise _AtHole()


@dataclass(eq=False)
class _Beam:
    """A query run at a hole (see the module docstring). `seq`: the prompt up to the hole; it holds the
    cached prefix of `seq.ids + tokens` on the backend."""

    values: tuple[Filled, ...]
    score: float
    seq: Sequence
    constraint: HoleConstraint
    state: HoleState
    tokens: list[int] = field(default_factory=list)
    state_taken: bool = False  # a child took `state` (and advanced it): later children replay the tokens
    made: int = 0  # choices made so far (tokens and endings), for best_k's length normalisation


@dataclass(eq=False)
class _Value:
    """A beam whose hole ended: the values so far (this one included) and the score."""

    values: tuple[Filled, ...]
    score: float
    made: int = 0


class BeamSearch:
    """One call of a query under a beam decoder: `await BeamSearch(...).run()` -> results, best first."""

    def __init__(self, program: Program, backend: Backend, env: dict[str, Any], spec: DecoderSpec, template: str):
        self.program, self.backend, self.env, self.spec, self.template = program, backend, env, spec, template
        self.held: set[_Beam] = set()  # beams holding a sequence (a cached prefix) on the backend
        self.error: Exception | None = None
        self.random = random.Random(spec.seed)  # beam_sample's draws

    async def run(self) -> list[Result]:
        try:
            start = await self._replay(_Value((), 0.0))
            if self.spec.name in ("beam", "beam_sample"):
                done = await self._beam([start] if isinstance(start, _Beam) else [], self._keep([], start))
            elif self.spec.name == "best_k":
                done = await self._best_k(start)
            else:
                done = await self._by_variable(start)
        finally:
            for beam in self.held:
                self.backend.release(beam.seq)
            self.held.clear()
        if not done:
            raise self.error or LMQRuntimeError("no beam completed the query")
        return done

    # ----- the searches ---------------------------------------------------------------------------------

    async def _beam(self, live: list[_Beam], done: list[Result]) -> list[Result]:
        n = self.spec.n
        while live:
            proposals = await self._propose(live, n)
            parents, live = live, []
            for score, beam, choice in proposals:
                if len(done) >= n and score <= done[-1].score:
                    break
                if len(live) >= n and not isinstance(choice, str):
                    continue  # only an ending may still finish a beam among the n best
                child = self._take(beam, choice, score)
                if isinstance(child, _Value):
                    child = await self._replay(child)
                if isinstance(child, Result):
                    done = self._keep(done, child)
                elif child is not None and len(live) < n:
                    live.append(child)
                elif child is not None:
                    self._drop(child)
            for beam in parents:
                self._drop(beam)
            if len(done) >= n and (not live or live[0].score <= done[-1].score):
                break
        for beam in live:
            self._drop(beam)
        return done

    async def _by_variable(self, start: _Beam | Result) -> list[Result]:
        n = self.spec.n
        done = self._keep([], start)
        live = [start] if isinstance(start, _Beam) else []
        while live:
            if self.spec.name == "beam_var":
                values = await self._search_hole(live, n)
            else:  # var: each beam searches the hole on its own with b beams
                found = await asyncio.gather(*(self._search_hole([b], self.spec.b) for b in live))
                values = sorted((v for vs in found for v in vs), key=lambda v: -v.score)
            live = []
            for value in values[:n]:
                nxt = await self._replay(value)
                if isinstance(nxt, Result):
                    done = self._keep(done, nxt)
                elif nxt is not None:
                    live.append(nxt)
        return done

    async def _search_hole(self, live: list[_Beam], width: int) -> list[_Value]:
        """Beam search of `width` inside the hole the beams are at: the best values found, best first."""
        ended: list[_Value] = []
        while live:
            proposals = await self._propose(live, width)
            parents, live = live, []
            for score, beam, choice in proposals:
                if len(ended) >= width and score <= ended[width - 1].score:
                    break
                if len(live) >= width and not isinstance(choice, str):
                    continue
                child = self._take(beam, choice, score)
                if child is None:
                    continue
                if isinstance(child, _Value):
                    ended = sorted([*ended, child], key=lambda v: -v.score)
                elif len(live) < width:
                    live.append(child)
                else:
                    self._drop(child)
            for beam in parents:
                self._drop(beam)
            if len(ended) >= width and (not live or live[0].score <= ended[width - 1].score):
                break
        for beam in live:
            self._drop(beam)
        return ended[:width]

    async def _best_k(self, start: _Beam | Result) -> list[Result]:
        """LMQL's best-first search: each step expands the `k` best entries of a heap (by the score over
        the choices made ** 0.7, less kappa * age ** beta), keeps their choices at least `gamma` likely;
        `budget` expansions (more until a beam finishes); every finished beam is a result."""
        o = self.spec.best_k
        done = self._keep([], start, limit=None)
        heap: list[tuple[_Beam, int]] = [(start, -1)] if isinstance(start, _Beam) else []
        t = spent = 0

        def priority(entry: tuple[_Beam, int]) -> float:
            beam, born = entry
            return beam.score / max(beam.made, 1) ** 0.7 - o.kappa * (t - born) ** o.beta

        while heap and (spent < o.budget or not done):
            heap.sort(key=priority, reverse=True)
            chosen, heap = heap[: o.k], heap[o.k:]
            for score, beam, choice in await self._propose([b for b, _ in chosen], o.top_k_continuations):
                child = self._take(beam, choice, score)
                if isinstance(child, _Value):
                    child = await self._replay(child)
                if isinstance(child, Result):
                    done = self._keep(done, child, limit=None)
                elif child is not None and math.exp(score - beam.score) >= o.gamma:
                    heap.append((child, t))
                elif child is not None:
                    self._drop(child)
            for beam, _ in chosen:
                self._drop(beam)
            heap.sort(key=priority, reverse=True)
            for beam, _ in heap[o.max_heap_size:]:
                self._drop(beam)
            del heap[o.max_heap_size:]
            t, spent = t + 1, spent + len(chosen)
        for beam, _ in heap:
            self._drop(beam)
        if not done and self.error is None:
            self.error = LMQRuntimeError(f"best_k finished no beam: its heap ran out (a choice less likely than "
                                         f"gamma={o.gamma} is not kept)")
        return done

    # ----- steps ---------------------------------------------------------------------------------------

    async def _propose(self, live: list[_Beam], k: int) -> list[tuple[float, _Beam, int | str]]:
        """Each beam's `k` best choices (beam_sample: the distinct ones of `k` draws), all beams' together,
        best first: a token id, or the value's text (end the value here)."""
        sampled = self.spec.name == "beam_sample"
        asked = self.backend.vocab.size if sampled else k  # a draw needs every token's probability
        choices = await asyncio.gather(*(self._next(beam, asked) for beam in live))
        proposals = []
        for order, (beam, nt) in enumerate(zip(live, choices)):
            if nt is None:
                continue
            mine = [(beam.score + lp, order, rank, token) for rank, (token, lp) in enumerate(zip(nt.ids, nt.logprobs))]
            if nt.end is not None:
                mine.append((beam.score + nt.end, order, -1, beam.state.text))
            mine.sort(key=lambda c: (-c[0], c[2]))
            proposals += self._draws(mine, k) if sampled else mine[:k]
        proposals.sort(key=lambda c: (-c[0], c[1], c[2]))
        return [(score, live[order], choice) for score, order, _, choice in proposals]

    def _draws(self, choices: list[tuple], n: int) -> list[tuple]:
        """The distinct choices among `n` draws from `choices` (best first, scored as the beam's score plus their
        log-probability) at the decoder's temperature (0: the best one)."""
        t = self.spec.temperature
        if t == 0 or len(choices) == 1:
            return choices[:1]
        top = choices[0][0]
        # drawn in the order of the token ids (ending first), not of the scores: tokens of equal or nearly equal
        # probability come in another order from another batch's shapes, and a draw must not depend on it
        canonical = sorted(choices, key=lambda c: -1 if isinstance(c[3], str) else c[3])
        weights = [math.exp((c[0] - top) / t) for c in canonical]
        picked = {id(c): c for c in self.random.choices(canonical, weights, k=n)}
        return sorted(picked.values(), key=lambda c: (-c[0], c[2]))

    async def _next(self, beam: _Beam, k: int) -> NextTokens | None:
        try:
            nt = await self.backend.next_tokens(beam.seq, beam.tokens, k, beam.state.allowed(), beam.state.can_end())
        except LMQLengthError as e:
            self.error = e
            return None
        if not nt.ids and nt.end is None:
            self.error = LMQUnsatisfiedError.after(beam.state.text)
            return None
        return nt

    def _take(self, beam: _Beam, choice: int | str, score: float) -> _Beam | _Value | None:
        """The beam after its choice (a token, or the text it ends its value with): still in its hole (a
        `_Beam` of its own), or its value (`_Value`); None where a stop rule ended the value where its
        constraint does not let it end (`Stop.broken`)."""
        if isinstance(choice, str):
            return self._value(beam, beam.tokens, choice, score)
        if beam.state_taken:
            state = beam.constraint.start()
            for t in beam.tokens:
                state.advance(t)
        else:
            state, beam.state_taken = beam.state, True
        stop = state.advance(choice)
        tokens = [*beam.tokens, choice]
        if stop is not None and stop.broken:  # (a value its constraint refuses: this beam ends here)
            self.error = LMQUnsatisfiedError.cut(stop.broken, stop.text)
            return None
        if stop is not None:
            ids = tokens[: stop.keep] + self.backend.vocab.encode_continuation(stop.tail)
            return self._value(beam, ids, stop.text, score)
        child = _Beam(beam.values, score, self.backend.fork(beam.seq), beam.constraint, state, tokens,
                      made=beam.made + 1)
        self.held.add(child)
        return child

    @staticmethod
    def _value(beam: _Beam, ids: list[int], text: str, score: float) -> _Value:
        return _Value((*beam.values, Filled(tuple(ids), text)), score, beam.made + 1)

    async def _replay(self, value: _Value) -> _Beam | Result | None:
        """Run the program with the value's holes filled, to its next hole (a beam) or its end (a result);
        None if its prompt outgrows max_len (that beam ends there, the others go on)."""
        run = _Replay(program=self.program, backend=self.backend, env=dict(self.env), sampler=Greedy(),
                      template=self.template, max_len=self.spec.max_len, values=value.values)
        try:
            result = await run.execute()
        except LMQLengthError as e:
            self.error = e
            return None
        except _AtHole:
            seq, constraint = run.stopped
            beam = _Beam(value.values, value.score, seq, constraint, constraint.start(), made=value.made)
            self.held.add(beam)
            return beam
        result.score = value.score
        return result

    def _drop(self, beam: _Beam) -> None:
        if beam in self.held:
            self.held.remove(beam)
            self.backend.release(beam.seq)

    def _keep(self, done: list[Result], new: Any, limit: int | None = -1) -> list[Result]:
        """`done` with `new` if it is a result, the best `limit` (default: n; None: all), best first."""
        if not isinstance(new, Result):
            return done
        return sorted([*done, new], key=lambda r: -r.score)[: self.spec.n if limit == -1 else limit]
