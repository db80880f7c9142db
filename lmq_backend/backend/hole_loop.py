"""One hole's token loop (`HoleLoop`), as `HFBackend.generate` runs it: before each pick, the constraint's
checks (which tokens may extend the value, may it end here, is the prompt at max_len); the pick (the
device's greedy pick where the step made one, the step's sample of the row's draw where it sampled it, else
the sampler's); the constraint's advance.

`feed` is the continuation of the row's decode steps: the scheduler calls it inside each step with the
row's new logits and feeds the token it returns in the next step, so a token costs no wake-up of the
query's task (~half the host time of a token at 1,000 concurrent queries); the task wakes once, when the
hole is done (or a check fails, or the row is preempted).
"""
from __future__ import annotations

import torch

from ..errors import LMQRuntimeError
from ..engine.picks import Draw, sample
from ..runtime.decoders import Greedy, Sampler, Sampling


class HoleLoop:
    def __init__(self, backend, seq, state, sampler: Sampler):
        """Plans the first pick at once (its checks need no logits), so that the prefill giving its logits
        can sample it with the prefill's other rows (`draw`); `row` is the prefill's."""
        self.backend, self.seq, self.state, self.sampler, self.row = backend, seq, state, sampler, None
        self.prompt_len = len(seq.ids)
        self.generated: list[int] = []
        self.stop = None
        self.decoded = 0        # decode steps fed to the row (statistics)
        self._greedy = type(sampler) is Greedy
        self._sampling = type(sampler) is Sampling
        self.ahead: int | Draw | None = None
        self.planned = self._plan()

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

    def _plan(self) -> bool:
        """The checks before the next pick: False if the hole ends without one; raises if it cannot end."""
        b, state = self.backend, self.state
        allowed, can_end = state.allowed(), state.can_end()
        extendable, extends = b._extendable_under(allowed)
        if not extends:
            if can_end:
                return False  # closed: no token can extend the value, so no forward is needed
            raise LMQRuntimeError(f"the constraint cannot be satisfied after {state.text!r}")
        if b._ends_at_max_len(self.seq, self.prompt_len + len(self.generated), can_end):
            return False
        if can_end:
            pick = b._pick_all
        else:  # the mask of an unconstrained step is on the device already
            pick = b._extendable_on_device if allowed is None else torch.from_numpy(extendable)
        self.pick, self.can_end, self.extendable = pick, can_end, extendable
        # how the step may pick for the row: under a greedy mask of the device's, or by this draw
        if self._greedy:  # under a mask of the device's, or the row's own: then a draw at temperature 0, which
            # the step picks with its other rows' at once (`engine.picks.sample`), not a masked argmax a row
            k = b._greedy_mask(pick)
            self.ahead = k if k is not None else Draw(0.0, 1.0, 0.0, pick)
        else:
            self.ahead = self.sampler.draw(pick) if self._sampling else None
        return True

    def _pick(self, logits: torch.Tensor | None, i: int) -> tuple[int, int | Draw | None] | None:
        ahead = self.ahead
        token = self.row.device_pick(ahead) if ahead is not None else None
        if token is None:
            token = int(sample(logits[i][None], [ahead])[0]) if isinstance(ahead, Draw) else \
                self.sampler.select(logits[i], self.pick)
        if self.can_end and not self.extendable[token]:
            return None  # a token outside the value (EOS, or one the constraint excludes) ends the hole
        self.generated.append(token)
        self.stop = self.state.advance(token)
        if self.stop is not None or not self._plan():
            return None
        return token, self.ahead

    def value(self, computed: int) -> tuple[str, list[int], int]:
        """(value text, its token ids, how many of the generated ids have K/V in the row) once done;
        `computed`: the generated tokens the row holds K/V for."""
        if self.stop is None:
            return self.state.text, self.generated, computed
        stop = self.stop
        ids = self.generated[: stop.keep] + self.backend.vocab.encode_continuation(stop.tail)
        return stop.text, ids, min(computed, stop.keep)
