"""The scheduler's choices between steps. While rows decode, waiting prefills join them only once that is worth
a step (`admission.join_delay`): a prefill stalls every running row, so one query arriving alone waits for
others to come with it (until a few recent prefill steps' durations after the last), a group of them joins at
once. Rows that left stay in the batch while the device runs a step ahead (moving them would discard it). The
results are those of the queries alone either way.

Time is the scheduler's clock made to count steps (`StepClock`): each decode step takes TICK seconds and
nothing else does, so the waits are counted in steps, whatever the load on the machine."""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

import lmq_backend as lmq
from lmq_backend.cache.prefix_cache import Pin
from lmq_backend.cache.trie import PrefixTrie
from lmq_backend.engine import admission
from lmq_backend.engine import scheduler as scheduler_module
from lmq_backend.engine.admission import JOIN_SHARE, PATIENCE
from lmq_backend.engine.fused import bucket_for
from lmq_backend.engine.rows import PrefillRequest
from lmq_backend.engine.runner import PrefillRow
from support.caches import node_slots

BUSY = '"Count to many:[A]" where len(TOKENS(A)) < 90'
LATE = '"Late {i}:[B]" where len(TOKENS(B)) < 4'


def test_join_delay():
    assert admission.join_delay(1, seats=64, running=0, prefill_seconds=0.5, since_prefill=0.0) == 0  # no stall
    # 2 rows join 2 * JOIN_SHARE running ones at once, not one more: these wait PATIENCE prefills' time
    assert admission.join_delay(2, seats=64, running=2 * JOIN_SHARE, prefill_seconds=0.5, since_prefill=0.0) == 0
    late = admission.join_delay(2, seats=64, running=2 * JOIN_SHARE + 1, prefill_seconds=0.5, since_prefill=0.2)
    assert late == pytest.approx(PATIENCE * 0.5 - 0.2)
    assert admission.join_delay(2, seats=1, running=JOIN_SHARE + 1, prefill_seconds=0.5, since_prefill=0.2) == \
        pytest.approx(late)                                                    # the seats count
    assert admission.join_delay(1, seats=64, running=100, prefill_seconds=0.5, since_prefill=9.0) == 0


TICK = 2.0 ** -8  # seconds a decode step takes on the StepClock (a power of two: sums of ticks are exact)


class StepClock:
    """The scheduler's `time.perf_counter`, advanced by TICK whenever the backend's runner runs a decode step."""

    def __init__(self, monkeypatch, backend):
        self.now = 0.0
        monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        decode = backend.runner.decode

        def timed(*args, **kwargs):
            self.now += TICK
            return decode(*args, **kwargs)
        monkeypatch.setattr(backend.runner, "decode", timed)


async def run_late(backend, clock: StepClock, late: int, patience_ticks: int) -> tuple[list[dict], list[tuple]]:
    """2 * JOIN_SHARE busy queries decode; then `late` queries arrive at once, PATIENCE recent prefill steps'
    durations being `patience_ticks` decode steps. Returns the late ones' variables and the steps from their
    arrival on, as (kind, ticks since the arrival)."""
    steps: list[tuple] = []
    backend.on_step(lambda s: steps.append((s.kind, clock.now, s.batch_size)))
    busy = [asyncio.ensure_future(lmq.Query(BUSY, model=backend).run({})) for _ in range(2 * JOIN_SHARE)]
    while not steps or steps[-1][::2] != ("decode", len(busy)):  # every busy row decodes
        await asyncio.sleep(0)
    backend.scheduler._prefill_seconds = patience_ticks * TICK / PATIENCE
    arrived, steps[:] = clock.now, []
    backend.scheduler._prefilled = arrived  # (as if a prefill step had just ended)
    results = await asyncio.gather(*(lmq.Query(LATE, model=backend).run({"i": i}) for i in range(late)))
    await asyncio.gather(*busy)
    return [r.variables for r in results], [(k, (t - arrived) / TICK) for k, t, _ in steps]


async def test_a_query_arriving_alone_waits_for_others_and_a_group_joins_at_once(make_backend, monkeypatch):
    backend = make_backend("llama", cache_budget=0)
    alone = [(await lmq.Query(LATE, model=backend).run({"i": i})).variables for i in range(2)]
    clock = StepClock(monkeypatch, backend)
    values, steps = await run_late(backend, clock, 1, patience_ticks=5)
    assert values == alone[:1]
    first = next(i for i, (k, _) in enumerate(steps) if k == "prefill")
    assert steps[first][1] == 5       # the rows decoded 5 steps meanwhile (the patience), not one more,
    assert first in (5, 6)            # (a step under way at the arrival is reported after it)
    assert len(steps) - first > 8     # and it joined them (they had not ended)
    values, steps = await run_late(backend, clock, 2, patience_ticks=10 ** 6)  # 2 rows join 2 * JOIN_SHARE: not
    # worth waiting for
    assert values == alone
    assert [k for k, _ in steps[:2]].count("prefill") == 1  # (a step may have been under way)
    assert backend.scheduler.pool.rows == 0 and not backend.scheduler.waiting


SPREAD = '"Item {i}:[A]" where len(TOKENS(A)) < n and STOPS_AT(A, "x")'
SPREAD_ITEMS = [{"i": i, "n": 3 + i % 20} for i in range(40)]


async def run_spread(backend, monkeypatch) -> tuple[list[dict], list[tuple[int, int]]]:
    """The SPREAD_ITEMS at once (holes of 3-22 tokens, fewer where one stops: rows leave at many steps): their
    variables, and per decode step (rows that left fed: token -1, rows)."""
    steps, decode = [], backend.runner.decode

    def record(pool, rows, tokens, *args, **kwargs):
        steps.append((tokens.count(-1), len(tokens)))
        return decode(pool, rows, tokens, *args, **kwargs)
    monkeypatch.setattr(backend.runner, "decode", record)
    got = await asyncio.gather(*(lmq.Query(SPREAD, model=backend).run(x) for x in SPREAD_ITEMS))
    return [r.variables for r in got], steps


async def test_rows_that_left_stay_while_a_step_runs_ahead(make_backend, monkeypatch):
    """As if the device always ran a step ahead, in steps of power-of-two buckets (a GPU's CUDA graphs): holes
    of different lengths end at different steps, their rows stay in the batch (fed any token) until a prefill
    comes or the live rows fit a smaller bucket; the others' tokens are those alone, and every row and slot is
    back at the end. (The same on a GPU, running ahead for real: `test_fused_engine.py`.)"""
    reference = make_backend("llama", cache_budget=0)
    expected = [(await lmq.Query(SPREAD, model=reference).run(x)).variables for x in SPREAD_ITEMS]
    backend = make_backend("llama")
    runner = type(backend.runner)
    monkeypatch.setattr(runner, "ahead_pending", property(lambda self: True))
    monkeypatch.setattr(runner, "step_rows", lambda self, n: bucket_for(n, self.max_batch))
    got, steps = await run_spread(backend, monkeypatch)
    assert got == expected
    assert any(left * 4 > rows for left, rows in steps)  # rows that left stayed in steps, never a bucket's worth
    m = backend.runner.max_batch
    assert all(bucket_for(rows - left, m) == bucket_for(rows, m) for left, rows in steps)
    s = backend.scheduler
    assert s.pool.rows == 0 and not s.rows and backend.trie.pinned_nodes() == 0
    backend.store.check(node_slots(backend.trie), [])


def _waiting(ids: list[int], cached: int, node=None) -> admission.Waiting:
    """A looked-up request: `cached` of its ids found (its pin on `node`), the rest to prefill."""
    w = admission.Waiting(PrefillRequest(Pin(node), ids, len(ids)), future=None)
    w.row = PrefillRow(np.zeros(cached, dtype=np.int32), cached, ids[cached:])
    return w


def test_shares_new_prefix_by_pin_and_by_ids():
    """A request shares a chosen one's new prefix where their new tokens start alike (SHARED_PREFIX_MIN of them)
    after the same cached prefix: the same trie node both pin, or the same ids."""
    trie = PrefixTrie(10**6)
    node = trie.insert(trie.root, [1, 2, 3, 4], np.arange(4))
    new = [9] * (admission.SHARED_PREFIX_MIN + 4)
    chosen = _waiting([1, 2, 3, 4, *new], 4, node)
    assert admission.shares_new_prefix(_waiting([1, 2, 3, 4, *new], 4, node), chosen)  # the same node
    assert admission.shares_new_prefix(_waiting([1, 2, 3, 4, *new], 4), chosen)  # no pin: the same ids
    assert not admission.shares_new_prefix(_waiting([5, 6, 7, 8, *new], 4), chosen)  # another cached prefix
    assert not admission.shares_new_prefix(_waiting([1, 2, 3, 4, 8, *new], 4, node), chosen)  # other new tokens
