"""A step that waits for the device lets the queries' own host work run meanwhile (`Scheduler._device_done`).
On the CPU a step is done when it returns; here the runner's event takes a few event-loop turns a step, as
a GPU's does: results still equal each query's alone, and queries that finish, fail or are cancelled while
a step waits leave the batch consistent (their rows are only marked then, and freed before the next step)."""
from __future__ import annotations

import random

import pytest
import test_batching as batching
import test_batching_failures as failures

from lmq_backend.engine.runner import ModelRunner


class SlowEvent:
    """A device event that is done after `turns` queries."""

    def __init__(self, turns: int):
        self.turns, self.asked = turns, 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > self.turns


@pytest.fixture
def slow_device(monkeypatch):
    rng = random.Random(3)
    events: list[SlowEvent] = []

    def event(self):
        events.append(SlowEvent(rng.randint(0, 8)))
        return events[-1]
    monkeypatch.setattr(ModelRunner, "_event", event)
    yield events
    assert sum(e.asked > 1 for e in events) > len(events) // 2  # most steps did wait


@pytest.mark.parametrize("seed", range(2))
async def test_random_arrivals_while_steps_wait(make_backend, slow_device, seed):
    await batching.test_batched_output_identical_to_alone_with_random_arrivals(make_backend, "llama", seed)


async def test_failures_and_cancellations_while_steps_wait(make_backend, slow_device):
    await failures.test_failing_and_cancelled_queries_leave_the_batch(make_backend)


async def test_soak_while_steps_wait(make_backend, slow_device):
    await failures.test_soak_with_cancellations_and_invalid_queries(make_backend)
