"""While rows decode, waiting prefills join them only once that is worth a step (`admission.join_delay`): a
prefill stalls every running row, so one query arriving alone waits a while for others to come with it (a
recent prefill step's duration), a group of them joins at once; the results are those of the queries alone."""
from __future__ import annotations

import asyncio
import time

import pytest

import lmq_backend as lmq
from lmq_backend.engine import admission
from lmq_backend.engine.admission import JOIN_SHARE, PATIENCE, Waiting

BUSY = '"Count to many:[A]" where len(TOKENS(A)) < 90'
LATE = '"Late {i}:[B]" where len(TOKENS(B)) < 4'


def waiting(since: float, done: bool = False) -> Waiting:
    future = asyncio.get_running_loop().create_future()
    if done:
        future.set_result(None)
    return Waiting(request=None, future=future, since=since)


async def test_join_delay():
    now = 100.0
    few = [waiting(99.9), waiting(99.95)]
    assert admission.join_delay(few, seats=64, running=0, prefill_seconds=0.5, now=now) == 0  # nothing stalls
    # 2 rows join 2 * JOIN_SHARE running ones at once, not one more
    assert admission.join_delay(few, seats=64, running=2 * JOIN_SHARE, prefill_seconds=0.5, now=now) == 0
    late = admission.join_delay(few, seats=64, running=2 * JOIN_SHARE + 1, prefill_seconds=0.5, now=now)
    assert late == pytest.approx(99.9 + PATIENCE * 0.5 - now)                  # the oldest one's patience
    assert admission.join_delay(few, seats=1, running=JOIN_SHARE + 1, prefill_seconds=0.5, now=now) > 0  # seats count
    assert admission.join_delay(few + [waiting(0.0, done=True)], seats=64, running=100, prefill_seconds=0.5,
                                now=now) == pytest.approx(late)                # (a cancelled one does not)
    assert admission.join_delay([waiting(1.0)], seats=64, running=100, prefill_seconds=0.5, now=now) == 0


async def run_late(backend, late: int, patience_seconds: float) -> tuple[list[dict], list[tuple]]:
    """2 * JOIN_SHARE busy queries decode; then `late` queries arrive at once. Returns the late ones' variables
    and the steps from their arrival on, as (kind, time)."""
    steps: list[tuple] = []
    backend.on_step(lambda s: steps.append((s.kind, time.perf_counter())))
    busy = [asyncio.ensure_future(lmq.Query(BUSY, model=backend).run({})) for _ in range(2 * JOIN_SHARE)]
    while sum(k == "decode" for k, _ in steps) < 3:
        await asyncio.sleep(0)
    backend.scheduler._prefill_seconds = patience_seconds / PATIENCE
    arrived, steps[:] = time.perf_counter(), []
    results = await asyncio.gather(*(lmq.Query(LATE, model=backend).run({"i": i}) for i in range(late)))
    await asyncio.gather(*busy)
    return [r.variables for r in results], [(k, t - arrived) for k, t in steps]


async def test_a_query_arriving_alone_waits_for_others_and_a_group_joins_at_once(make_backend):
    backend = make_backend("llama", cache_budget=0)
    alone = [(await lmq.Query(LATE, model=backend).run({"i": i})).variables for i in range(2)]
    values, steps = await run_late(backend, 1, 0.02)
    assert values == alone[:1]
    first = next(i for i, (k, _) in enumerate(steps) if k == "prefill")
    assert first >= 3 and steps[first][1] >= 0.02  # the rows decoded meanwhile, for its patience,
    assert len(steps) - first > 8                   # and it joined them (they had not ended)
    values, steps = await run_late(backend, 2, 60.0)  # 2 rows join 2 * JOIN_SHARE: not worth waiting for
    assert values == alone
    assert [k for k, _ in steps[:2]].count("prefill") == 1  # (a step may have been under way)
    assert backend.scheduler.pool.rows == 0 and not backend.scheduler.waiting
