"""The cyclic collector's young generation is collected less often while an engine has work (`engine/collector.py`),
and the program's thresholds come back after."""
from __future__ import annotations

import asyncio
import gc

import lmq_backend as lmq
from lmq_backend.engine import collector


async def _until_idle(before: tuple[int, ...]) -> None:
    for _ in range(50):  # (the step task's end runs its callbacks a turn of the loop later)
        if gc.get_threshold() == before:
            return
        await asyncio.sleep(0)


async def test_the_collector_is_paced_while_the_engine_has_work_and_restored_after(make_backend):
    before = gc.get_threshold()
    assert 0 < before[0] < collector.BUSY_THRESHOLD
    backend = make_backend()
    seen = []
    backend.on_step(lambda info: seen.append(gc.get_threshold()[0]))
    results = await asyncio.gather(*(lmq.compile('"Hello {n}[X]" where len(TOKENS(X)) < 4', model=backend)(n=n)
                                     for n in range(3)))
    assert len(results) == 3 and seen and set(seen) == {collector.BUSY_THRESHOLD}
    await _until_idle(before)
    assert gc.get_threshold() == before


def test_the_collector_off_or_set_by_the_program_meanwhile_is_left_alone():
    before = gc.get_threshold()
    try:
        gc.set_threshold(0, *before[1:])  # the program turned automatic collection off
        collector.busy()
        assert gc.get_threshold()[0] == 0
        collector.idle()
        assert gc.get_threshold()[0] == 0
        gc.set_threshold(*before)
        collector.busy()
        collector.busy()  # (two engines' loops)
        assert gc.get_threshold()[0] == collector.BUSY_THRESHOLD
        collector.idle()
        assert gc.get_threshold()[0] == collector.BUSY_THRESHOLD
        gc.set_threshold(1234, *before[1:])  # the program's own choice while the engines ran
        collector.idle()
        assert gc.get_threshold()[0] == 1234
    finally:
        gc.set_threshold(*before)
