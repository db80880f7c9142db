"""A row of the running batch (`Row`: its slot in the pool, and the picks the last step made for it) and
`Preempted`, what a row's query gets when the scheduler takes the row out to free K/V slots."""
from __future__ import annotations

from dataclasses import dataclass

from .picks import Draw


class Preempted(Exception):
    """The row was taken out of the running batch to free K/V slots for older rows: prefill its tokens
    again and go on (`HFBackend.generate` does)."""


@dataclass(eq=False)
class Row:
    """A sequence in the running batch; `slot` is its row in the pool and may change between steps."""

    slot: int
    joined: int = 0       # order of joining the batch: the latest rows are preempted first
    live: bool = True
    # After a prefill, or a fused decode step on the GPU: (picks, i) with picks(k, i) the greedy pick of the
    # row's logits under the runner's greedy mask k, made on the device (`ModelRunner.set_greedy_masks`).
    device_picks: tuple | None = None
    drawn: int | None = None  # after a step: its sample of the row's draw (see `device_pick`)
    chosen: tuple | None = None  # after a prefill: the choices its request asked for (`picks.choose`)

    def device_pick(self, ahead: int | Draw) -> int | None:
        """The step's pick for the row's last logits, if it made one: under the runner's greedy mask `ahead`
        (an int), or the sample of the row's draw (a `Draw`, the one the row gave the step)."""
        if isinstance(ahead, Draw):
            return self.drawn
        if self.device_picks is None:
            return None
        picks, i = self.device_picks
        return picks(ahead, i)
