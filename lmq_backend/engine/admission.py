"""The scheduler's admission policy: which waiting prefills a step runs (`select`), and when waiting requests
join running rows (`join_delay`); pure choices over the waiting requests (`Waiting`), which the scheduler
looks up, runs and requeues.

`select` is cache-aware, within the decode batch's seats, the K/V store's free slots and the step's token and
read limits.

The longest cached prefix goes first (its rows compute least); a request whose new tokens begin with a long
prefix that a chosen one will compute waits for the trie instead (the shared part is computed once), and one
whose whole prompt a chosen one computes (`sample(n=...)`'s runs, a repeated call) follows it: it joins the
running batch after that prefill, on the K/V the trie then holds and on the same logits; a request
is admitted while the store has slots for its new tokens and room for the running rows to grow
(`DECODE_RESERVE` a row), else it waits for rows to leave (alone, with no running rows, it is tried anyway: a
failure then says how much it needs). Only the first arrivals are looked up in the trie (`window`): those not
chosen are looked up again next round, so a wider window costs more than it finds at 1,000s waiting.

A prefill stalls every running row for its duration, and a small one costs about what a large one does (one
row's 30 tokens as much as a few decode steps of 256 rows). So while rows decode, the waiting requests join
them only once that is worth a step (`join_delay`): when they bring at
least 1/JOIN_SHARE as many rows as run already, or once PATIENCE times a recent prefill step's duration has
passed since the last one (so prefills stall the running rows for at most 1 / (1 + PATIENCE) of the time:
holes that end one or two a step, at 1,000 concurrent queries, would otherwise each cost a prefill step of
their own). With no rows running, or few, a prefill runs at once.

A prompt with more new tokens than a step takes (`max_tokens`; while rows decode, `max_part`) is prefilled in
parts, alone, each part's K/V the next part's cached prefix (its slots held by the request between parts:
`Waiting.advance`); an out-of-memory error halves its parts, down to MIN_PART tokens (the scheduler requeues it).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from .rows import PrefillRequest
from .runner import PrefillRow

SHARED_PREFIX_MIN = 16  # a new prefix at least this long, shared by waiting requests, is prefilled once
AHEAD = 2               # columns every running row holds slots for: this step's, and one a GPU step runs ahead
DECODE_RESERVE = 16     # free slots per running row kept for its next decode steps when admitting prefills
SELECT_MARGIN = 32      # waiting requests looked up beyond what can be chosen, to choose among
MIN_PART = 256          # an out-of-memory error halves a long prompt's parts down to this many new tokens
JOIN_SHARE = 8          # waiting requests join running rows at once when they are 1/JOIN_SHARE of their number
PATIENCE = 2.0          # ... else this many recent prefill steps' durations after the last one


@dataclass(slots=True, eq=False)
class Waiting:
    """A prefill request waiting for a step, and what is left of it."""

    request: PrefillRequest
    future: asyncio.Future
    row: PrefillRow | None = None   # what is left to prefill (after the parts done: their K/V as cached slots)
    part: int | None = None         # the new tokens this step takes: all (None) or the first `part`
    most: int | None = None         # the most new tokens a part may take (halved by out-of-memory errors)
    started: bool = False           # parts ran: `row.slots` holds slots of its own (ROW), not only the trie's
    leader: Waiting | None = None   # a chosen request of the same whole prompt, whose K/V and logits it takes

    def step_row(self) -> PrefillRow:
        """The row this step prefills: the whole row, or its first `part` new tokens."""
        if self.part is None:
            return self.row
        return PrefillRow(self.row.slots, self.row.cached, self.row.ids[:self.part], self.row.loads)

    @property
    def partial(self) -> bool:
        """Does this step prefill only a part of the row (more parts follow)?"""
        return self.part is not None

    def advance(self, slots: np.ndarray) -> None:
        """The part ran; `slots`: the store slots of its row's tokens (cached and new), the next part's prefix."""
        self.row = PrefillRow(slots, self.row.cached + self.part, self.row.ids[self.part:])
        self.part, self.started = None, True


def select(ready: list[Waiting], seats: int, room: int, running: bool, max_tokens: int,
           read_limit: int | None, max_part: int | None = None, cached: bool = True) -> list[Waiting]:
    """Of the `ready` requests (looked up: `row` set), those to prefill now: at most `seats`, their new tokens
    at most `max_tokens` and the columns their attention reads (cached + new) at most `read_limit` (None: no
    limit) together (a first one alone passes the read limit; a prompt of more new tokens than `max_tokens`,
    its `most` or, while rows are `running`, `max_part` is chosen alone and prefills a part: `Waiting.part`),
    each needing its new tokens + AHEAD + DECODE_RESERVE of the `room` free slots unless it is the only one
    and no rows are `running`. A request whose whole prompt is a chosen one's is not chosen but follows it
    (`Waiting.leader` set: a seat, and room for its next tokens), to join the batch on its K/V and logits.
    `cached`: does the prefix cache keep what a prefill computes (False: none of this waiting, nothing to find)?"""
    ready = list(ready)
    ready.sort(key=lambda w: (not w.started, -w.row.cached))
    chosen: list[Waiting] = []
    tokens = read = 0
    starts: dict[tuple[int, int], list[Waiting]] = {}
    followers = 0
    for w in ready:
        if len(chosen) + followers >= seats:
            break
        # a chosen request whose new tokens start the same way (the same first new token at the same cached
        # length: a dict lookup, then the exact check against those few)
        key = (w.row.cached, w.request.ids[w.row.cached] if w.row.cached < len(w.request.ids) else -1)
        shares = None
        for c in starts.get(key, ()) if cached else ():
            if shares_new_prefix(w, c):
                shares = c
                break
        if shares is not None:  # it waits for the trie; where it is the same whole prompt, it follows (a seat)
            if not w.started and w.request.ids == shares.request.ids and AHEAD + DECODE_RESERVE <= room:
                w.leader = shares
                followers += 1
                room -= AHEAD + DECODE_RESERVE
            continue
        most = min(max_tokens, (running and max_part) or max_tokens, w.most or max_tokens)
        part = most if len(w.row.ids) > most else None  # a long prompt: its next part, alone
        if chosen and (part is not None or tokens + len(w.row.ids) > max_tokens
                       or (read_limit is not None and read + w.row.cached + len(w.row.ids) > read_limit)):
            continue
        new = part or len(w.row.ids)
        need = new + w.row.cached - len(w.row.slots) + AHEAD + DECODE_RESERVE  # (and slots for its loads)
        if need > room and (chosen or running):  # wait for rows to leave (alone, it is tried anyway)
            continue
        w.part = part
        chosen.append(w)
        if part is not None:
            break
        starts.setdefault(key, []).append(w)
        room -= need
        tokens += new
        read += w.row.cached + new
    return chosen


def join_delay(waiting: int, seats: int, running: int, prefill_seconds: float, since_prefill: float) -> float:
    """Seconds until `waiting` requests should be prefilled, joining `running` rows (0: now): at once where no
    rows run, or where they would fill at least running / JOIN_SHARE of the `seats`; else PATIENCE x
    `prefill_seconds` (a recent prefill step's duration) after the last prefill step (`since_prefill` ago)."""
    if not running or min(waiting, seats) * JOIN_SHARE >= running:
        return 0.0
    return max(0.0, PATIENCE * prefill_seconds - since_prefill)


def window(waiting: list[Waiting], most: int, read_limit: int | None) -> list[Waiting]:
    """The requests a step looks up in the cache: the first `most` live waiting requests, fewer where their
    prompts (cached or not: what a prefill reads) pass `read_limit` by SELECT_MARGIN requests: no more could be
    chosen this round (those not chosen are looked up again next round)."""
    out: list[Waiting] = []
    read = over = 0
    for w in waiting:
        if len(out) >= most or over >= SELECT_MARGIN:
            break
        if w.future.done():
            continue
        out.append(w)
        read += len(w.request.ids)
        over += read_limit is not None and read > read_limit
    return out


def shares_new_prefix(w: Waiting, chosen: Waiting) -> bool:
    """Will `chosen` compute a prefix of w's tokens that neither has cached: SHARED_PREFIX_MIN tokens of it, or
    all of w's prompt (so w can wait and then reuse it from the trie)?"""
    ids, other = w.request.ids, chosen.request.ids
    cached = max(w.row.cached, chosen.row.cached)
    k = min(cached + SHARED_PREFIX_MIN, len(ids) - 1, len(other))
    # the new part first: a few tokens, where requests sharing a long cached prefix differ
    if k <= cached or ids[cached:k] != other[cached:k]:
        return False
    # the cached part: the same where both pins hold the same trie node that long (a node is one prefix)
    node = w.request.pin.node
    if node is not None and node is chosen.request.pin.node and node.depth == cached:
        return True
    return ids[:cached] == other[:cached]
