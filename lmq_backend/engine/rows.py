"""The scheduler's records: a request for a prefill (`PrefillRequest`), a row of the running batch (`Row`: its
slot in the pool, the picks the last step made for it, its next decode), the running batch (`Batch`: its rows by
slot over the pool's rows) and `Preempted`, what a row's query gets when the scheduler takes the row out to
free K/V slots."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

import numpy as np
import torch

from ..cache.prefix_cache import Pin
from ..cache.segment import Segment
from .picks import Choices, Draw

# A row's continuation: called inside a decode step with the step's logits [B, V] (None: kept on the device) and
# the row's index in them; returns the row's next (token, ahead) to feed, or None (the caller wakes)
Continuation = Callable[[torch.Tensor | None, int], tuple | None]
# The continuations of many rows at once: called inside a decode step with the step's logits (None: kept on the
# device), its greedy picks (`picks(k, i)`, `ModelRunner.picks`; None: the step made none) and the rows that gave
# it, as (index in the logits, `Decode`) pairs. Each row goes on as its `then(logits, i)` would say: where that
# gives the next (token, ahead), the group sets them on the row's `Decode` (the row takes part in the next step);
# it returns the rows that do not go on, as (index, `Decode`, None: its caller wakes | the exception it raised)
ContinuationGroup = Callable[[torch.Tensor | None, Callable | None, list[tuple[int, "Decode"]]], list]


@dataclass(slots=True, eq=False)
class PrefillRequest:
    """One prefill: the logits after `ids`, computed from the longest cached prefix on. The request's `pin` holds
    the cached prefix it reads; once computed, ids[:stored] go to the prefix cache under it (the pin follows).
    `draw`: the sampled pick to make from the logits; `choices`: a beam's choices to take from them (a step
    makes its rows' at once). `cached`: the tokens the last lookup found in the cache, `looked_up` when
    (time.perf_counter()); `staged`: the disk tier's segments read for it before it was queued
    (`PrefixCache.stage`)."""

    pin: Pin
    ids: list[int]
    stored: int
    draw: Draw | None = None
    choices: Choices | None = None
    cached: int = 0
    looked_up: float = 0.0
    staged: list[Segment] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Decode:
    """A row's next decode: the `token` to feed, how the step may pick the token after it (`ahead`: a greedy
    mask of the runner's, a sampling draw, or None), the `future` its caller awaits and its `then`
    continuation (None: the caller takes the logits), which a step calls through its `group`, with the other
    rows' of that group, where it has one."""

    token: int
    ahead: int | Draw | None
    future: asyncio.Future
    then: Continuation | None = None
    group: ContinuationGroup | None = None


class Preempted(Exception):
    """The row was taken out of the running batch to free K/V slots for older rows: prefill its tokens
    again and go on (`HFBackend.generate` does)."""


@dataclass(eq=False)
class Row:
    """A sequence in the running batch; `slot` is its row in the pool and may change between steps."""

    slot: int
    joined: int = 0       # order of joining the batch: the latest rows are preempted first
    live: bool = True
    # After a prefill or a decode step: the step's greedy picks `picks(k, i)` (the pick of its logits' row i under
    # the runner's greedy mask k, `ModelRunner.set_greedy_masks`; None: it made none) and the row's `index` i.
    picks: Callable[[int, int], int] | None = None
    index: int = 0
    drawn: int | None = None  # after a step: its sample of the row's draw (see `device_pick`)
    chosen: tuple | None = None  # after a prefill: the choices its request asked for (`picks.choose`)
    pending: Decode | None = None  # the decode its query asked for, until a step runs it

    def device_pick(self, ahead: int | Draw) -> int | None:
        """The step's pick for the row's last logits, if it made one: under the runner's greedy mask `ahead`
        (an int), or the sample of the row's draw (a `Draw`, the one the row gave the step)."""
        if isinstance(ahead, Draw):
            return self.drawn
        picks = self.picks
        return None if picks is None else picks(ahead, self.index)


_LIVE, _PENDING = attrgetter("live"), attrgetter("pending")


class Batch:
    """The running rows by slot over the pool's rows (`rows[i].slot == i`). A row that leaves is marked (`live`
    False); its slot is freed at once where no live row follows it (`free_tail`), else by `compact`, which
    moves the last live rows into the gaps (slots stay dense). When the scheduler frees them is its choice."""

    def __init__(self, pool):
        self.pool = pool
        self.rows: list[Row] = []

    def live(self) -> int:
        """The rows that have not left."""
        return sum(map(_LIVE, self.rows))

    def pending(self) -> int:
        """The rows with a decode to run."""
        return len(self.rows) - list(map(_PENDING, self.rows)).count(None)

    def join(self, rows: list[Row]) -> None:
        """New rows, at the slots the pool gave them (the runner may give them in another order)."""
        self.rows.extend(rows)
        for row in rows:
            self.rows[row.slot] = row

    def free_tail(self) -> None:
        """Free the slots of the rows that left and that no live row follows."""
        while self.rows and not self.rows[-1].live:
            self.rows.pop()
            self.pool.remove_row(self.pool.rows - 1)

    def compact(self) -> None:
        """Free the slots of every row that left: the last live rows move into them."""
        rows = self.rows
        for slot in range(len(rows) - 1, -1, -1):
            if not rows[slot].live:  # every slot after it holds a live row now
                moved = self.pool.remove_row(slot)
                rows[slot] = rows[-1]
                rows.pop()
                if moved is not None:
                    rows[slot].slot = slot

    def drop_unjoined(self, held: list[np.ndarray] = ()) -> None:
        """Remove the pool's rows past the batch's (a failed prefill's), with the slots they took. `held`: the
        slots a request keeps of the tokens its row begins with (a long prompt's parts done: its prefix, then
        slots of its own, the last one among them), which stay."""
        while self.pool.rows > len(self.rows):
            slot = self.pool.rows - 1
            taken = self.pool.row_slots(slot)
            keep = next((len(h) for h in held if len(h) <= len(taken) and taken[len(h) - 1] == h[-1]), 0)
            self.pool.remove_row(slot, keep)

    def clear(self) -> None:
        """Every row leaves; the pool frees every slot."""
        for row in self.rows:
            row.live, row.pending = False, None
        self.rows.clear()
        self.pool.clear()
