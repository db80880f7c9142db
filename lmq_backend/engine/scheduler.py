"""The scheduler: turns the model work of concurrent queries into batched forwards.

A query's hole asks for a prefill (`await scheduler.prefill(request)`), then for one decode step per
token (`await scheduler.decode(row, token)`), then leaves (`scheduler.release(row)`). One background
task runs the steps (`step`: schedule -> run -> post-process):

    loop:
        wait until there is work
        schedule: prefills, if they wait and are worth stalling the running rows for (looked up in the
                  prefix cache, a cache-aware set chosen); else a decode, if every running row has its
                  next token (room made for the rows' next columns)
        run:      one batched forward (prefill: rows of different cached and new lengths, left-padded;
                  decode: one token a row)
        post-process: the prefilled rows join the running batch (continuous batching) and what they
                  computed goes to the prefix cache; each row's pick is made, its continuation fed

Rows join and leave between steps. Which waiting prefills a step runs is `admission.py`'s choice: a
prefill that waits behind another one sharing a long uncached prefix is held back a round, so the shared
part is computed once and then found in the trie; prefills are admitted while the decode batch has seats
(`runner.max_batch` rows) and the K/V store has slots for their new tokens and room for the running rows
to grow (`DECODE_RESERVE` a row, counting what evicting unpinned trie leaves frees); the rest wait. A prompt
of more new tokens than a step takes is prefilled in parts, the running rows stepping between them. An
out-of-memory error, or a store that runs short, splits the batch and retries the halves (a long prompt's
parts, down to `admission.MIN_PART` tokens); a row that does not fit waits for running rows to leave. Any
other failure of a prefill splits it too, down to the query whose prefill fails alone: that query gets the
error, the others run. When the running rows' next decode columns need more slots than the store can give,
the rows that joined last are preempted (vLLM's recompute preemption): they leave the batch, their queries
get `Preempted` and prefill their tokens again, from the trie where it still holds them, and go on. Before
either, the cache pins of queries waiting for a prefill go (cache only: their prefill looks it up again).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..cache.kv_store import KVStore, OutOfSlots
from ..cache.prefix_cache import PrefixCache
from ..cache.stats import StepInfo
from ..errors import LMQBackendError
from . import admission, collector
from .admission import AHEAD, DECODE_RESERVE, Waiting
from .picks import Draw, per_row
from .rows import Batch, Continuation, ContinuationGroup, Decode, PrefillRequest, Preempted, Row
from .runner import ModelRunner, PrefillRow


@dataclass
class Scheduler:
    runner: ModelRunner
    store: KVStore
    cache: PrefixCache
    max_prefill_tokens: int = 16384
    max_part_tokens: int | None = None  # a longer prompt's new tokens are prefilled in parts; None: the runner's
    # columns a prefill's attention reads (cached + new tokens of every row), where its attention gathers
    # them; None: the runner's `prefill_read_limit`
    max_prefill_read: int | None = None
    on_step: Callable[[StepInfo], None] | None = None
    waiting: list[Waiting] = field(default_factory=list)

    def __post_init__(self):
        self.pool = self.runner.new_pool(self.store)
        self.batch = Batch(self.pool)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._bound: asyncio.AbstractEventLoop | None = None
        self._joined = 0
        self.preemptions = 0
        self._stepping = False  # a step is running (it may await the device: see `_device_done`)
        self._after_part = False  # the last step prefilled a part of a long prompt: rows decode before its next
        self._prefill_seconds = 0.0  # a recent prefill step's duration (a moving average: `_joins_now`)
        self._prefilled = 0.0        # when the last one ended (time.perf_counter())
        self._join_timer: asyncio.TimerHandle | None = None  # wakes the loop when waiting prefills are due
        self._followers: list[Waiting] = []  # waiting requests that follow one this step prefills (`_follow`)
        self.closed = False  # (`close`)

    # ----- the queries' side ----------------------------------------------------------------------------

    async def prefill(self, request: PrefillRequest, first: bool = False) -> tuple[torch.Tensor, Row]:
        """The logits after the request's tokens, and its row in the running batch. `first`: queue it
        ahead of the others (a preempted row resuming)."""
        loop = self._loop()
        future = loop.create_future()
        self.waiting.insert(0 if first else len(self.waiting), Waiting(request, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._drop([w for w in self.waiting if w.future is future])
            self.waiting = [w for w in self.waiting if w.future is not future]
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result()[1])
            raise

    async def decode(self, row: Row, token: int, ahead: int | Draw | None = None,
                     then: Continuation | None = None, group: ContinuationGroup | None = None
                     ) -> torch.Tensor | None:
        """The logits after feeding `token` to the row. `ahead`: the greedy mask (see
        `ModelRunner.set_greedy_masks`) the row's next pick will likely use, so that the GPU may run the
        following step ahead on the device's own picks while the host checks its constraint; or the draw
        its next pick is sampled with.

        `then(logits, i)`: the row's continuation, called inside the step with the step's logits [B, V] and
        the row's index in them: it returns the next (token, ahead) to feed, and the row takes part in the
        next step without waking its caller; or None, and the call returns the row's logits. An exception it
        raises is raised here. Where every row of a step gives a continuation and an `ahead` mask, the
        logits stay on the device (None): a continuation then picks with `row.device_pick`, and the call
        returns None. `group`: a function that continues many rows' `then` at once (`rows.ContinuationGroup`): a
        step calls it once for all its rows that gave it, in place of each one's `then`."""
        assert row.live, "decode on a row that left the batch"
        future = self._loop().create_future()
        row.pending = Decode(token, ahead, future, then, group)
        self._wake.set()
        return await future

    def release(self, row: Row) -> None:
        """The row leaves the batch (its hole is done, or its query failed or was cancelled). Its slot is
        freed at once if no live row follows it; otherwise before the next step (`Batch.compact`), so that rows
        leaving together (a batch of classifications) free their slots without moving each other's K/V. (In a
        step its row stays put; while the device runs a step ahead, see `_schedule`.)"""
        if not row.live:
            return
        row.live, row.pending = False, None
        if not self._stepping and not self.runner.ahead_pending:
            self.batch.free_tail()
        if self._wake is not None:
            self._wake.set()

    def segment(self, row: Row, start: int, end: int) -> np.ndarray:
        """The store slots of the row's tokens [start, end) (a copy)."""
        return self.pool.segment(row.slot, start, end)

    def length(self, row: Row) -> int:
        """The tokens the row holds K/V for."""
        return self.pool.length(row.slot)

    @property
    def rows(self) -> list[Row]:
        """The running rows, by slot (`Batch`)."""
        return self.batch.rows

    # ----- the loop -------------------------------------------------------------------------------------

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, with the step task running in it (started on demand; it ends when idle)."""
        if self.closed:
            raise LMQBackendError("the backend was closed")
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            if task.get_loop() is not loop:
                raise LMQBackendError("a backend serves one event loop at a time")
            return loop
        if self._bound is not loop:  # a new event loop: whatever ran in an old one is gone
            self._reset_rows()
            self._wake, self._bound, self._join_timer = asyncio.Event(), loop, None
        self._task = loop.create_task(self._run(), name="lmq-scheduler")
        collector.busy()  # (while the task lives, the cyclic collector's young generation is collected less often)
        self._task.add_done_callback(self._ended)
        return loop

    def _ended(self, task: asyncio.Task) -> None:
        """The step task ended (idle, closed, or cancelled with its loop): it is dropped (cancelled with its loop,
        it holds a traceback through `_run` back to self)."""
        collector.idle()
        if self._task is task:
            self._task = None

    def close(self) -> None:
        """The backend was closed: the queries waiting on the engine fail, the rows leave, the step task stops,
        and later calls are refused (the runner and the store give their memory back: `Engine.close`)."""
        self.closed = True
        self._fail_all(LMQBackendError("the backend was closed"))
        self._reset_rows()
        task, self._task = self._task, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        if self._join_timer is not None:
            self._join_timer.cancel()

    def _reset_rows(self) -> None:
        self.batch.clear()
        self._drop(self.waiting)
        self.waiting.clear()

    async def _run(self) -> None:
        while self.waiting or self.rows:
            await self._wake.wait()
            self._wake.clear()
            # let every query that is ready submit, and cancellations land, before the step (rows that go on
            # through their continuations never leave this task: without it, they would starve the loop)
            await asyncio.sleep(0)
            if await self.step() and (self.waiting or self._ready()):
                self._wake.set()

    async def step(self) -> bool:
        """One step: schedule -> run -> post-process. False if there was nothing to run. A failure anywhere
        fails the queries waiting on the engine (none is left hanging), not the scheduler."""
        self._stepping = True
        try:
            chosen, decode = self._schedule()
            if chosen:
                await self._prefill(chosen)
            elif decode:
                await self._decode_step(self._make_room())
            return bool(chosen) or decode
        except Exception as e:  # noqa: BLE001 - a failed step fails its queries, not the scheduler
            self._fail_all(e)
            return True
        finally:
            self._stepping = False

    # ----- schedule -------------------------------------------------------------------------------------

    def _schedule(self) -> tuple[list[Waiting], bool]:
        """This step's work: the prefills to run (taken off `waiting`), or none and whether the running rows
        decode (every one has its next token)."""
        live = self.batch.live()
        ready = self._ready(live)
        # prefills first (rows join the batch as early as they can, when worth a step); a prefill that
        # cannot be admitted now (no seat, no slots) waits, and the running rows decode meanwhile (after a
        # part of a long prompt, the running rows take a step before its next part)
        prefill = not (self._after_part and ready) and bool(self.waiting) and self._joins_now(live)
        self._after_part = False
        # Rows that left stay in the batch for decode steps while the device runs one ahead: moving the rows
        # would discard it (holes that end at random lengths leave every step at 1,000s of rows), and a step
        # computes its bucket's rows anyway (`ModelRunner.step_rows`). A prefill (which discards it anyway),
        # or the live rows fitting a smaller step, move them out.
        if prefill or not ready or not self.runner.ahead_pending or (
                self.runner.step_rows(live) < self.runner.step_rows(len(self.rows))):
            self.batch.compact()
        chosen = self._take_prefills() if prefill else []
        return chosen, not chosen and ready

    def _ready(self, live: int | None = None) -> bool:
        """Does every running row (`live` of them, if counted already) have its next token (a decode step can
        run)?"""
        live = self.batch.live() if live is None else live
        return live > 0 and self.batch.pending() == live

    def _joins_now(self, live: int) -> bool:
        """Should the waiting requests be prefilled now, stalling the running rows (`admission.join_delay`)? If
        not, the rows decode meanwhile, and a timer wakes the loop when they should (in case no step does)."""
        delay = admission.join_delay(len(self.waiting), self.runner.max_batch - live, live, self._prefill_seconds,
                                     time.perf_counter() - self._prefilled)
        if delay <= 0:
            return True
        if self._join_timer is None or self._join_timer.when() <= self._bound.time():  # (none pending)
            self._join_timer = self._bound.call_later(delay, self._wake.set)
        return False

    def _take_prefills(self) -> list[Waiting]:
        """The prefills to run now, off `waiting` (the done ones dropped where some are chosen): the first arrivals
        looked up in the prefix cache, a cache-aware set of them within the seats, slots and limits
        (`admission.select`)."""
        seats = self.runner.max_batch - len(self.rows)  # rows the decode batch may still take (compacted: all live)
        chosen, self._followers = [], []
        if seats > 0:
            read_limit = self.max_prefill_read if self.max_prefill_read is not None else self.runner.prefill_read_limit
            ready = admission.window(self.waiting, seats + admission.SELECT_MARGIN, read_limit)
            for w in ready:
                w.part = w.leader = None
                if not w.started:  # (a prompt prefilled in parts keeps its row: the parts done are its cached prefix)
                    w.row = self._lookup(w.request)
            room = self.store.available() - DECODE_RESERVE * len(self.rows)
            part = self.max_part_tokens if self.max_part_tokens is not None else self.runner.prefill_part
            chosen = admission.select(ready, seats, room, bool(self.rows), self.max_prefill_tokens, read_limit, part,
                                      self.cache.budget_bytes > 0)
            self._followers = [w for w in ready if w.leader is not None]
        if not chosen:  # (the done ones are dropped when some are chosen: a pass over every waiting request)
            return chosen
        chosen_set, kept, done = set(map(id, chosen)), [], []
        for w in self.waiting:  # the done ones are dropped, the chosen ones leave
            if w.future.done() or id(w) not in chosen_set:
                (done if w.future.done() else kept).append(w)
        self._drop(done)
        self.waiting = kept
        return chosen

    def _lookup(self, request: PrefillRequest) -> PrefillRow:
        """The request's cached prefix (its pin moved there), and the row to prefill: the rest of its ids (the
        last one at least: its logits are the answer)."""
        slots, request.cached, loads = self.cache.lookup(request.pin, request.ids, len(request.ids) - 1,
                                                         request.staged)
        request.looked_up = time.perf_counter()
        return PrefillRow(slots, request.cached, request.ids[request.cached:], loads)

    def _make_room(self) -> list[Row]:
        """The rows of a decode step, each with slots for its next columns: the latest rows are preempted where
        the store cannot give them (a row alone that does not fit fails)."""
        self.pool.make_room(self.pool.rows, 0, extra=AHEAD)
        self._preempt(self.pool.reserve_width(AHEAD))
        return list(self.rows)

    def _preempt(self, width: int) -> None:
        """Preempt the latest rows until the store can give each of the others `width` slots for its next
        columns (evicting unpinned cache leaves counts). A row alone that does not fit fails, alone (the
        queries waiting for a prefill wait on)."""
        if len(self.rows) * width > self.store.available():
            self.batch.compact()  # rows that left first
        while len(self.rows) * width > self.store.available():
            if self._release_pins():
                continue
            victim = max(self.rows, key=lambda r: r.joined)
            future = victim.pending.future
            if not future.done():
                future.set_exception(Preempted() if len(self.rows) > 1 else LMQBackendError(
                    f"out of K/V slots: one query alone needs more than the KV budget holds "
                    f"({self.store.capacity - 1} slots); raise kv_budget="))
            self.preemptions += len(self.rows) > 1
            self.release(victim)
            self.batch.compact()

    def _release_pins(self, evict: int = 0) -> bool:
        """Drop the cache pins of the requests waiting for a prefill (none of it started): what they kept for
        their next prefill, which looks its prefix up again. Under memory pressure those pages may go before a
        running row is preempted or a query fails (a query between holes pins its prompt's path). With `evict`:
        that many slots are freed at once, before the next look-ups pin the same pages again. True if any pin
        was dropped."""
        released = False
        for w in self.waiting:
            if not w.started and self.cache.release(w.request.pin):
                released = True
        if released and evict and self.store.reclaim is not None:
            self.store.reclaim(evict + AHEAD)
        return released

    def _drop(self, waiting: list[Waiting]) -> None:
        """Requests that will not be prefilled: free the slots that the parts done of a long prompt hold."""
        for w in waiting:
            if w.started:
                self.store.free_rows(w.row.slots)
                w.started = False

    # ----- run and post-process: prefill ----------------------------------------------------------------

    async def _prefill(self, batch: list[Waiting]) -> None:
        """Run the prefills (a failure splits them and runs the halves), then post-process each that ran."""
        if not batch:
            return
        started = time.perf_counter()
        rows = [w.step_row() for w in batch]
        try:
            logits, slots = self.runner.prefill(self.pool, rows)
        except BaseException as e:
            # the rows this prefill added, with the slots they took (not those of a long prompt's parts done)
            self.batch.drop_unjoined([w.row.slots for w in batch if w.started])
            if not isinstance(e, Exception):  # (the scheduler itself is stopping)
                _fail([w.future for w in batch], e)  # taken off `waiting` already: `_fail_all` would not reach them
                self._drop(batch)
                raise
            if len(batch) > 1:  # out of memory, or a failure one query's rows may cause: halves, retried
                half = len(batch) // 2
                await self._prefill(batch[:half])
                await self._prefill(batch[half:])
                return
            error = self._requeue(batch[0], e)
            if error is not None:  # its own prefill fails alone: that query gets the error
                batch[0].future.set_exception(error)
            return
        for w, row in zip(batch, rows):  # (fewer where a tier failed and the row computed them: `PrefillRow.load`)
            w.request.cached = min(w.request.cached, row.cached)
        if batch[0].partial:
            self._part_done(batch[0], slots[0], started)
        else:
            await self._join(batch, logits, slots, started)

    def _requeue(self, w: Waiting, e: Exception) -> Exception | None:
        """A request whose prefill failed alone with `e`: queued again where waiting may help (None) — out of
        memory with more than MIN_PART new tokens: first, in parts of half as many; out of memory or K/V slots
        while rows run (they will leave and free theirs) or pins of waiting requests could go: last — else
        the error its query gets (what its parts held freed)."""
        new = len(w.step_row().ids)
        if isinstance(e, torch.OutOfMemoryError) and new > admission.MIN_PART:
            w.most = max(admission.MIN_PART, new // 2)
            self.waiting.insert(0, w)
            return None
        short = isinstance(e, (torch.OutOfMemoryError, OutOfSlots))
        if short and (self.rows or self._release_pins(new)):
            self.waiting.append(w)
            return None
        self._drop([w])
        if not short:
            return e
        what = "K/V slots" if isinstance(e, OutOfSlots) else "memory"
        return LMQBackendError(f"out of {what} prefilling one query alone ({new} new tokens): {e}")

    def _part_done(self, w: Waiting, slot: int, started: float) -> None:
        """A part of a long prompt ran (alone): its K/V are the cached prefix of the next part, held by the
        request; the request waits first."""
        keep = w.row.cached + w.part
        held = self.pool.segment(slot, 0, keep)
        self.pool.remove_row(slot, keep)
        new, cached = w.part, w.row.cached
        w.advance(held)
        if w.future.done():
            self._drop([w])
        else:
            self.waiting.insert(0, w)
            self._after_part = True
        self._report("prefill", 1, new, cached, started)

    async def _join(self, batch: list[Waiting], logits: torch.Tensor, slots: list[int], started: float) -> None:
        """The prefilled rows join the running batch: each request's pick made, what it computed stored in the
        prefix cache, its query woken; then the requests that follow them (`_follow`)."""
        try:
            await self._device_done()
            leaders = {id(w): i for i, w in enumerate(batch)}
            followers = [(w, leaders[id(w.leader)]) for w in self._followers
                         if id(w.leader) in leaders and not w.future.done()]
            # the followers' picks (their own draws, on their leader's logits) with the leaders', at once
            asks = [w.request for w in batch] + [w.request for w, _ in followers]
            rows_of = list(range(len(batch))) + [i for _, i in followers]
            drawn = per_row(self.runner.sample, logits, [r.draw for r in asks], rows_of)
            chosen = per_row(self.runner.choose, logits, [r.choices for r in asks], rows_of)
            self._prefilled = time.perf_counter()
            self._prefill_seconds = (self._prefill_seconds + self._prefilled - started) / 2
            self._report("prefill", len(batch), sum(len(w.row.ids) for w in batch),
                         sum(w.row.cached for w in batch), started)
        except Exception as e:  # noqa: BLE001 - (an on_step callback, a device error) the batch's queries fail
            self.batch.drop_unjoined()
            _fail([w.future for w in batch], e)
            return
        picks = self.runner.picks
        rows = [Row(slot=slot, joined=self._joined + i, picks=picks, index=i, drawn=drawn.get(i),
                    chosen=chosen.get(i)) for i, slot in enumerate(slots)]
        self._joined += len(rows)
        self.batch.join(rows)
        for w, row, row_logits in zip(batch, rows, logits):
            if w.future.done():  # cancelled while the device ran the step: its query has cleaned up (its
                self.release(row)  # pins are gone), so nothing of it is stored
                continue
            try:
                self._store(w.request, row)
            except BaseException as e:  # noqa: BLE001 - the failure belongs to that query alone
                self.release(row)
                w.future.set_exception(e)
                continue
            w.future.set_result((row_logits, row))
        if followers:
            self._follow([(w, i, drawn.get(k), chosen.get(k)) for k, (w, i) in enumerate(followers, len(batch))],
                         logits, picks)

    def _follow(self, followers: list[tuple[Waiting, int, int | None, tuple | None]], logits: torch.Tensor,
                picks) -> None:
        """Waiting requests whose whole prompt a request of this step computed (`Waiting.leader`: its row `i` of
        the step's `logits`) join the batch without a prefill of their own: on the K/V the trie now holds (their
        pins moved there) and the leader's logits, with their own picks (`drawn`, `chosen`). Where the trie does
        not hold it all (the leader's were not stored: cancelled, no room) or the store has no slots for a row's
        next columns, the request stays waiting and is prefilled as any other."""
        joined = set()
        self.pool.make_room(self.pool.rows + len(followers), max(len(w.request.ids) for w, *_ in followers), AHEAD)
        for w, i, drawn, chosen in followers:
            if w.future.done():  # (cancelled: its query has left `waiting`)
                continue
            ids = w.request.ids
            slots = self.cache.find(w.request.pin, ids)
            if slots is None:
                continue
            slot = self.pool.add_rows([len(ids)])[0]
            try:
                self.pool.set_row(slot, slots, 0)
            except OutOfSlots:
                self.pool.remove_row(slot)
                continue
            row = Row(slot=slot, joined=self._joined, picks=picks, index=i, drawn=drawn, chosen=chosen)
            self._joined += 1
            self.batch.join([row])
            w.request.cached = len(ids)
            joined.add(id(w))
            w.future.set_result((logits[i], row))
        if joined:
            self.waiting = [w for w in self.waiting if id(w) not in joined]

    def _store(self, request: PrefillRequest, row: Row) -> None:
        """What the request computed (or loaded into slots of its own) of ids[:stored] goes to the prefix cache,
        under its pin; the cache hears how long the request's new tokens took from its lookup on."""
        self.cache.observe_prefill(len(request.ids) - request.cached, time.perf_counter() - request.looked_up)
        pinned = request.pin.depth
        if pinned < request.stored:
            self.cache.extend(request.pin, request.ids[pinned:request.stored],
                              self.pool.segment(row.slot, pinned, request.stored))

    # ----- run and post-process: decode -----------------------------------------------------------------

    async def _decode_step(self, rows: list[Row]) -> None:
        """One token for each running row, then each row's pick: its continuation fed (it goes on in the next
        step) or its caller woken."""
        if not rows:  # (a row alone that did not fit failed)
            return
        started = time.perf_counter()
        work = [row.pending for row in rows]  # None: a row that left (still in the batch: see `_schedule`)
        tokens: list[int] = []
        ahead: list[int | Draw | None] = []
        # the logits go to the host only for a row the device may not pick for (or may redo: Checked) or returns them
        want, draws, live = False, False, 0
        for w in work:
            if w is None:  # (-1: any, the token of a step run ahead)
                tokens.append(-1)
                ahead.append(0)
                continue
            a = w.ahead
            tokens.append(w.token)
            ahead.append(a)
            live += 1
            if a.__class__ is not int or w.then is None:
                want = True
                draws = draws or isinstance(a, Draw)
        self.pool.reserve(AHEAD)
        logits = self._decode(slice(0, len(rows)), tokens, ahead, want)
        picks = self.runner.picks
        cached = sum(self.pool.length(row.slot) for row in rows) if self.on_step is not None else 0
        self.pool.end += 1
        for row in rows:
            row.pending = None
        try:
            await self._device_done()
            drawn = per_row(self.runner.sample, logits, [a if isinstance(a, Draw) else None for a in ahead]) \
                if draws else {}
            self._report("decode", live, live, cached, started)
        except Exception as e:  # noqa: BLE001 - (an on_step callback, a device error) the step's queries fail
            _fail([w.future for w in work if w is not None], e)  # (off the rows: `_fail_all` would not reach them)
            return
        groups: dict[ContinuationGroup, list[tuple[int, Decode]]] = {}
        for i, (row, w) in enumerate(zip(rows, work)):
            row.picks, row.index, row.drawn = picks, i, drawn.get(i) if drawn else None
            if w is None or w.future.done():  # (a row that left) cancelled
                continue
            group = w.group
            if group is not None:  # continued with the other rows of its group, below (going on, unless it says)
                members = groups.get(group)
                if members is None:
                    members = groups[group] = []
                members.append((i, w))
                row.pending = w
                continue
            if w.then is not None:
                try:
                    step = w.then(logits, i)
                except Exception as e:  # noqa: BLE001 - the failure belongs to that query alone
                    w.future.set_exception(e)
                    continue
                if step is not None:  # the row goes on in the next step, its caller still waiting
                    w.token, w.ahead = step
                    row.pending = w
                    continue
            w.future.set_result(None if logits is None else logits[i])
        for group, members in groups.items():
            try:
                ended = group(logits, picks, members)
            except Exception as e:  # noqa: BLE001 - the failure belongs to that group's queries alone
                ended = [(i, w, e) for i, w in members]
            for i, w, error in ended:
                rows[i].pending = None
                if error is None:
                    w.future.set_result(None if logits is None else logits[i])
                else:
                    w.future.set_exception(error)

    def _decode(self, rows: slice, tokens: list[int], ahead: list[int | Draw | None] | None = None,
                want_logits: bool = True) -> torch.Tensor | None:
        try:
            return self.runner.decode(self.pool, rows, tokens, ahead, want_logits=want_logits)
        except torch.OutOfMemoryError:
            n = rows.stop - rows.start
            if n == 1:
                raise
            mid = rows.start + n // 2
            return torch.cat([self._decode(slice(rows.start, mid), tokens[: n // 2]),
                              self._decode(slice(mid, rows.stop), tokens[n // 2:])])

    async def _device_done(self) -> None:
        """Let the other tasks (the queries' own host work: tokenizing, building results) run until the device
        has done the step just queued (`ModelRunner.ready`; at once on the CPU, where a step is done when it
        returns). Queries that call `release` meanwhile only mark their rows (`Batch.compact` frees them)."""
        event = self.runner.ready
        while event is not None and not event.query():
            await asyncio.sleep(0)

    def _fail_all(self, error: Exception) -> None:
        """A step failed unexpectedly: every query waiting on the engine gets the error."""
        _fail([w.future for w in self.waiting] + [r.pending.future for r in self.rows if r.pending is not None],
              error)
        self._drop(self.waiting)
        self.waiting.clear()
        for row in self.rows:
            row.pending = None

    def _report(self, kind: str, batch: int, new: int, cached: int, started: float) -> None:
        if self.on_step is not None:
            self.on_step(StepInfo(kind, batch, new, cached, time.perf_counter() - started))


def _fail(futures: list[asyncio.Future], error: BaseException) -> None:
    for future in futures:
        if future is not None and not future.done():
            future.set_exception(error)
