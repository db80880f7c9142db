"""One hole's token loop (`HoleLoop`), as `HFBackend.generate` runs it: before each pick, the constraint's
checks (which tokens may extend the value, may it end here, is the prompt at max_len); the pick (the
device's greedy pick where the step made one, the step's sample of the row's draw where it sampled it, else
the sampler's); the constraint's advance. A sampler with decoding knobs (`engine.picks.Knobs`), greedy too,
picks by draws that carry them: the step's batched pick applies them (`engine.picks.sample`), never a GPU
step's own picks; the sampler is told each token picked (`Sampler.took`) for the next picks' penalties.

`feed` is the continuation of the row's decode steps: the scheduler calls it inside each step with the
row's new logits and feeds the token it returns in the next step, so a token costs no wake-up of the
query's task (at 1,000s of concurrent queries, much of a token's host time); the task wakes once, when the
hole is done (or a check fails, or the row is preempted).

A hole under a constraint whose mask is dear (llguidance's REGEX / JSON / GRAMMAR: a mask costs far more than
checking a token) does not compute it before each pick: the step picks as for an unconstrained token, and the
hole checks that one token against the constraint; only where the constraint forbids it, the mask and the pick
again, from the logits (`_checked`). Greedy, the token is the same either way (the first maximal logit of a larger
set, if allowed, is the first of the smaller). Sampled (without a nucleus), a token drawn from the larger set
and kept because it is allowed is a draw from the constrained distribution, and so is the new draw under the
mask after one that was not (rejection sampling): the values' distribution is the same, the draws not (a
seed's values differ from those of a mask before every pick). Where the value may end, no mask either way:
a token outside it ends the hole, allowed or not.

The unconstrained pick is one among the tokens that may extend a value, or, inside a UTF-8 character that
expects k more bytes, among those that keep the text well-formed (`VocabIndex.utf8_continuing(k)`): there a
pick among all tokens is refused almost always (most of a random model's refused draws came there), and a
refused pick draws again on the host, which discards a step the device ran ahead. Either set holds every
token the constraint allows (llguidance's expressions are over text: `test_proposal.py` checks it), which is
what makes the checked pick the constrained one. These sets are device masks (`masks.py`), one family for
values that could end where the character began and one for those that could not, so that a GPU step run
ahead moves each row to its next mask as this loop will.

A free hole (no constraint on its text: only a token limit, max_len and stop rules end it; greedy or sampled,
without knobs, not streamed) plans the same pick before every token: its decode steps are continued by
`FreeHoles`, one loop over the step's rows of such holes (the scheduler's `group`), which takes each row's pick
from the step's greedy picks or its sample of the row's draw, ends the holes that end and sets the others' next
tokens (and a sampled row's next draw) on their rows' decodes. A hole whose state watches no text
(no stop rule) gives its state the tokens only when it leaves that loop (`HoleState.extend`, `_caught_up`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..engine.picks import Checked, Draw, Greedy, Sampler, Sampling, sample
from ..engine.rows import Decode
from ..errors import LMQUnsatisfiedError
from .protocol import HoleState, Sequence

if TYPE_CHECKING:
    from .hf import HFBackend


class HoleLoop:
    __slots__ = ("backend", "seq", "state", "sampler", "row", "masks", "prompt_len", "generated", "stop", "decoded",
                 "_greedy", "_draws", "_checks", "_unchecked_held", "_unchecked", "_pending", "_could_end", "ahead",
                 "planned", "pick", "can_end", "extendable", "_taken", "group", "_watches", "_room")

    def __init__(self, backend: HFBackend, seq: Sequence, state: HoleState, sampler: Sampler):
        """Plans the first pick at once (its checks need no logits), so that the prefill giving its logits
        can sample it with the prefill's other rows (`draw`); `row` is the prefill's."""
        self.backend, self.seq, self.state, self.sampler, self.row = backend, seq, state, sampler, None
        self.masks = backend.masks
        self.prompt_len = len(seq.ids)
        self.generated: list[int] = []
        self.stop = None
        self.decoded = 0        # decode steps fed to the row (statistics)
        # a sampler with decoding knobs picks by draws (`Draw.knobs`: the step applies them), greedy too
        knobs = sampler.knobs is not None
        self._greedy = type(sampler) is Greedy and not knobs
        self._draws = type(sampler) is Sampling or (type(sampler) is Greedy and knobs)
        # a constraint whose mask costs far more than checking a token, greedy or sampled without a nucleus
        # (a nucleus of the larger set is not one of the smaller; nor is a top-k): see `_checked`. (Optional in
        # a state: one without it gives its masks.)
        self._checks = getattr(state, "checks_tokens", False) and not knobs and (
            self._greedy or (self._draws and sampler.top_p >= 1.0))
        sampler.start(seq.ids)
        self._unchecked_held = True  # did the last unconstrained pick satisfy the constraint? (`_checked`)
        self._unchecked = False      # is the next pick made without the constraint (then checked)?
        self._pending = 0            # UTF-8 continuation bytes the value's last character still expects
        self._could_end = False      # could the value end where its last character began? (`Proposals.mask`)
        self.ahead: int | Draw | None = None
        self.planned = self._plan()
        self._taken = 0  # the generated tokens the state has taken (see `_caught_up`)
        # a free hole, greedy or sampled without knobs: its decode steps are continued by the backend's
        # `FreeHoles`, with the other rows'
        self.group: FreeHoles | None = None
        if getattr(state, "free", False) and seq.on_token is None and (
                (self._greedy and type(self.ahead) is int)
                or (type(sampler) is Sampling and not knobs and isinstance(self.ahead, Draw))):
            self.group = backend.free_holes
            self._watches = getattr(state, "watches_text", True) or not hasattr(state, "extend")
            # the tokens the value may hold: max_len (`HFBackend.at_max_len`), and the state's limit where it
            # gives no stop of its own sooner (`FreeHoles`)
            self._room = seq.max_len - self.prompt_len
            if not self._watches and state.max_tokens is not None:
                self._room = min(self._room, state.max_tokens)

    @property
    def draw(self) -> Draw | None:
        """The draw of the next pick where it is sampled: the prefill that gives its logits samples it."""
        return self.ahead if isinstance(self.ahead, Draw) else None

    def start(self, logits: torch.Tensor) -> tuple[int, int | Draw | None] | None:
        """The first pick, from the prefill's logits: (token to feed, how the step may pick the token after
        it: a greedy mask of the device's, or a sampling draw), or None when the hole is done."""
        if not self.planned:
            return None
        return self._pick(logits[None], 0)

    def feed(self, logits: torch.Tensor | None, i: int) -> tuple[int, int | Draw | None] | None:
        """The pick from row i of a decode step's logits (the scheduler's continuation; None: the step
        kept them on the device, and made this row's pick there): as `start`."""
        self.decoded += 1
        return self._pick(logits, i)

    def resume(self, logits: torch.Tensor) -> tuple[int, int | Draw | None] | None:
        """The pick from the logits of a preempted row's new prefill (its tokens so far): as `start`."""
        return self._pick(logits[None], 0)

    __call__ = feed  # (the scheduler's continuation of the row)

    def _caught_up(self) -> None:
        """Give the state the tokens `FreeHoles` took without it (`HoleState.extend`): its stop, if it gave one."""
        if self._taken < len(self.generated):
            self.stop = self.state.extend(self.generated[self._taken:])
            self._taken = len(self.generated)

    def _plan(self) -> bool:
        """The checks before the next pick: False if the hole ends without one; raises if it cannot end."""
        masks, state = self.masks, self.state
        can_end = state.can_end()
        self._unchecked = self._checks and (can_end or self._unchecked_held)
        if self._unchecked:  # the mask only where the unconstrained pick breaks the constraint (`_checked`)
            allowed, extendable, extends, under = None, None, True, None
        else:
            allowed = state.allowed()
            extendable, extends, under = masks.under(allowed)
        if not extends:
            if can_end:
                return False  # closed: no token can extend the value, so no forward is needed
            raise LMQUnsatisfiedError.after(state.text)
        if self.backend.at_max_len(self.seq, self.prompt_len + len(self.generated), can_end):
            return False
        if not self._pending:
            self._could_end = can_end
        if can_end:  # (a checked row's "every token" is a mask of its own: `Proposals`)
            pick = masks.proposal(0, True) if self._checks and not self._pending else masks.pickable
        else:  # the proposal's mask is on the device already
            pick = self._proposal() if allowed is None else under
        self.pick, self.can_end, self.extendable = pick, can_end, extendable
        # how the step may pick for the row: under a greedy mask of the device's, or by this draw
        if self._greedy:  # under a mask of the device's, or the row's own: then a draw at temperature 0, which
            # the step picks with its other rows' at once (`engine.picks.sample`), not a masked argmax a row
            k = masks.greedy_mask(pick)
            self.ahead = Checked(k) if self._unchecked else k if k is not None else Draw(0.0, 1.0, 0.0, pick)
        else:
            self.ahead = self.sampler.draw(pick) if self._draws else None
        return True

    def _pick(self, logits: torch.Tensor | None, i: int) -> tuple[int, int | Draw | None] | None:
        self._caught_up()
        ahead = self.ahead
        token = self.row.device_pick(ahead) if ahead is not None else None
        if token is None:
            token = int(sample(logits[i][None], [ahead])[0]) if isinstance(ahead, Draw) else \
                self.sampler.select(logits[i], self.pick)
        if self._unchecked:
            token = self._checked(token, logits, i)
            if token is None:
                return None
        else:
            if self._checks and not self.can_end:  # would the unconstrained pick have held? (then check again;
                # a sampled row asks the greedy one: a guess for the next pick's mode, never for its token)
                unconstrained = self.row.device_pick(self.masks.greedy_mask(self._proposal()))
                self._unchecked_held = unconstrained is not None and bool(self.extendable[unconstrained])
            if self.can_end and not self.extendable[token]:
                return None  # a token outside the value (EOS, or one the constraint excludes) ends the hole
        self.generated.append(token)
        self.sampler.took(token)
        if self._checks:
            self._pending = int(self.backend.vocab.utf8_tables(self._pending)[1][token])
        self.stop = self.state.advance(token)
        self._taken += 1
        if self.seq.on_token is not None:
            self.seq.on_token(token)
        if self.stop is not None or not self._plan():
            return None
        return token, self.ahead

    def _proposal(self) -> torch.Tensor:
        """The device's mask a checked pick proposes from where the value may not end (`Proposals.mask`)."""
        return self.masks.proposal(self._pending, self._could_end)

    def _checked(self, token: int, logits: torch.Tensor, i: int) -> int | None:
        """The pick under the row's constraint, from the step's pick without it (None: the hole ends). Where
        the constraint allows that token it is the constrained pick too (greedy: the first maximal logit of a
        larger set of tokens; sampled: a draw kept because it is allowed), and no mask was computed; else the
        mask, and the pick again from the logits (sampled: a new draw, under the mask)."""
        masks, state = self.masks, self.state
        if self.can_end:  # a token outside the value ends the hole, as in `_pick`
            return token if masks.extendable[token] and state.allows(token) else None
        self._unchecked_held = state.allows(token)
        if self._unchecked_held:
            return token
        # mostly broken (a random model's picks under a REGEX): the next picks compute the mask first, and
        # are made with the step's other rows' (`_plan`), until an unconstrained pick holds again (`_pick`)
        extendable, extends, under = masks.under(state.allowed())
        if not extends:  # (what `_plan` says where it computes the mask)
            raise LMQUnsatisfiedError.after(state.text)
        return self.sampler.select(logits[i], torch.from_numpy(extendable) if under is None else under)

    def value(self, computed: int) -> tuple[str, list[int], int]:
        """(value text, its token ids, how many of the generated ids have K/V in the row) once done;
        `computed`: the generated tokens the row holds K/V for."""
        self._caught_up()
        if self.stop is None:
            return self.state.text, self.generated, computed
        stop = self.stop
        if stop.broken:
            raise LMQUnsatisfiedError.cut(stop.broken, stop.text)
        ids = self.generated[: stop.keep] + self.backend.vocab.encode_continuation(stop.tail)
        return stop.text, ids, min(computed, stop.keep)


class FreeHoles:
    """The continuation of the decode steps of free holes (`HoleLoop.group`; one a backend), greedy or sampled
    without knobs: the step's rows of such holes in one loop, each as `HoleLoop.feed` would take it (the pick
    under its plan's greedy mask, or the step's sample of its draw, the plan's mask never changing; a token
    outside the value ends the hole; the token limit, max_len or a stop rule ends it after the token; a sampled
    row's next draw from its sampler), without planning again or, for a state that watches no text, advancing
    it."""

    def __init__(self, extendable):
        """`extendable`: bool [V], the tokens that may extend a value (`PickMasks.extendable`)."""
        self.extendable = bytes(extendable.astype("uint8"))  # (a bytes index: an int, far cheaper than numpy's)

    def __call__(self, logits: torch.Tensor | None, picks, members: list[tuple[int, Decode]]) -> list:
        extendable, ended, fed = self.extendable, [], []
        for member in members:
            i, w = member
            hole = w.then
            ahead = w.ahead
            sampled = ahead.__class__ is Draw
            if sampled:  # the step's sample of the draw
                token = hole.row.drawn
            else:  # greedy: under the row's mask (its hole's, which never changes)
                token = None if picks is None else picks(ahead, i)
            if token is None:  # the step made no pick for the row: its own, from the logits, below
                fed.append(member)
                continue
            hole.decoded += 1
            if not extendable[token]:  # (EOS) ends the hole
                ended.append((i, w, None))
                continue
            generated = hole.generated
            generated.append(token)
            if hole._watches:
                hole._taken += 1
                if (stop := hole.state.advance(token)) is not None:
                    hole.stop = stop
                    ended.append((i, w, None))
                    continue
            if len(generated) >= hole._room:
                ended.append((i, w, None))
            else:
                w.token = token
                if sampled:
                    w.ahead = hole.ahead = hole.sampler.draw(hole.pick)
        return ended + _fed(logits, fed) if fed else ended


def _fed(logits: torch.Tensor | None, members: list[tuple[int, Decode]]) -> list:
    """Each row's hole fed alone (`HoleLoop.feed`), as `FreeHoles` continues them: the rows that end."""
    ended = []
    for i, w in members:
        try:
            step = w.then.feed(logits, i)
        except Exception as e:  # noqa: BLE001 - the failure belongs to that hole's query alone
            ended.append((i, w, e))
            continue
        if step is None:
            ended.append((i, w, None))
        else:
            w.token, w.ahead = step
    return ended
