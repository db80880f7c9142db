"""Concurrent queries under failures: failing, cancelled and invalid queries leave the batch and the others
run; a step that fails fails only its queries and the engine goes on; out of memory splits the batch; a soak."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

import lmq_backend as lmq
from test_batching import SRC, inputs, reference


async def test_failing_and_cancelled_queries_leave_the_batch(make_backend):
    backend = make_backend("llama")
    items = list(range(6))
    expected = await reference(make_backend, "llama", items)
    q = lmq.Query(SRC, model=backend)
    bad = lmq.compile('"Shared instructions for every call.[A]" where len(TOKENS(A)) < 3\n"{1/0}[B]"',
                      model=backend)
    slow = lmq.compile('"Shared instructions for every call, long text:[A]" where len(TOKENS(A)) < 200',
                       model=backend)
    slow_task = asyncio.ensure_future(slow())
    good = [asyncio.ensure_future(q.run(inputs(i))) for i in items]
    bad_task = asyncio.ensure_future(bad())
    for _ in range(20):
        await asyncio.sleep(0)
    slow_task.cancel()
    results = await asyncio.gather(*good)
    assert [r.variables for r in results] == expected
    with pytest.raises(lmq.LMQRuntimeError):
        await bad_task
    with pytest.raises(asyncio.CancelledError):
        await slow_task
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0


async def test_calls_that_follow_a_cancelled_call_prefill_their_own(make_backend, monkeypatch):
    """Calls of one prompt follow the one that computes it; where that one is cancelled while its step runs,
    nothing of it is stored, and the others prefill the prompt themselves and get what they get alone."""
    from lmq_backend.engine.runner import ModelRunner

    expected = await reference(make_backend, "llama", [3])
    backend = make_backend("llama")
    q = lmq.Query(SRC, model=backend)
    steps, calls, real = [], [], ModelRunner.prefill
    backend.on_step(steps.append)

    def prefill(self, pool, rows):  # the first step prefills the first call, the others following it
        out = real(self, pool, rows)
        if len(steps) == 0 and not calls[0].done():
            calls[0].cancel()
        return out

    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    calls += [asyncio.ensure_future(q.run(inputs(3))) for _ in range(4)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert [r.variables for r in results[1:]] == expected * 3
    prefills = [s.batch_size for s in steps if s.kind == "prefill"]
    assert prefills[:2] == [1, 1]  # the first alone; then one of the three, the two others following it
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    backend.trie.check()


async def test_a_prefill_failure_fails_only_the_query_it_comes_from(make_backend, monkeypatch):
    """A prefill that raises something unforeseen (a bug, a kernel's error: here, whenever one query's rows are in
    it) is split down to that query, which gets the error; the queries batched with it, and the next ones, run.
    None waits forever (the queries a failing step was prefilling had left the waiting list)."""
    backend = make_backend("llama")
    items = list(range(6))
    expected = await reference(make_backend, "llama", items)
    runner = backend.runner
    real = runner.prefill
    shared = backend.vocab.encode("Shared instructions for every call.")
    bad = backend.vocab.encode("Shared instructions for every call. " + inputs(3)["x"])[len(shared):][:4]  # query 3's
    failed = []

    def broken(pool, rows):
        for row in rows:
            ids = list(row.ids)
            if any(ids[i:i + len(bad)] == bad for i in range(len(ids))):
                failed.append(len(rows))
                raise TypeError("simulated: a prefill's unforeseen failure")
        return real(pool, rows)

    monkeypatch.setattr(runner, "prefill", broken)
    q = lmq.Query(SRC, model=backend)
    results = await asyncio.wait_for(asyncio.gather(*(q.run(inputs(i)) for i in items), return_exceptions=True), 60)
    assert isinstance(results[3], TypeError) and max(failed) > 1 and failed[-1] == 1   # batched, then alone
    assert [r.variables for i, r in enumerate(results) if i != 3] == [e for i, e in enumerate(expected) if i != 3]
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0


async def test_a_decode_step_failure_fails_its_queries_and_the_engine_goes_on(make_backend, monkeypatch):
    """A decode step that raises something unforeseen fails the queries in it (one forward for all its rows),
    and the next queries run."""
    backend = make_backend("llama")
    items = list(range(4))
    expected = await reference(make_backend, "llama", items)
    runner = backend.runner
    real, calls = runner.decode, []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("simulated: a step's unforeseen failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", broken)
    q = lmq.Query(SRC, model=backend)
    results = await asyncio.wait_for(asyncio.gather(*(q.run(inputs(i)) for i in items), return_exceptions=True), 60)
    assert any(isinstance(r, TypeError) for r in results)
    assert all(isinstance(r, TypeError) or r.variables == expected[i] for i, r in enumerate(results))
    assert [r.variables for r in await asyncio.gather(*(q.run(inputs(i)) for i in items))] == expected
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0


@pytest.mark.parametrize("kind", ["prefill", "decode"])
async def test_a_failure_after_a_step_ran_fails_its_queries_and_the_engine_goes_on(make_backend, kind):
    """What a step does after the device ran it (its samples, the on_step callback) may fail too: that
    step's queries get the error (none waits forever), the pool and the trie are left clean, the next
    queries run."""
    backend = make_backend("llama")
    items = list(range(4))
    expected = await reference(make_backend, "llama", items)
    failed = []

    def callback(step):
        if step.kind == kind and not failed:
            failed.append(step)
            raise RuntimeError("simulated: a failing on_step callback")

    backend.on_step(callback)
    q = lmq.Query(SRC, model=backend)
    results = await asyncio.wait_for(asyncio.gather(*(q.run(inputs(i)) for i in items), return_exceptions=True), 60)
    assert failed and any(isinstance(r, RuntimeError) for r in results)
    assert all(isinstance(r, RuntimeError) or r.variables == expected[i] for i, r in enumerate(results))
    assert [r.variables for r in await asyncio.gather(*(q.run(inputs(i)) for i in items))] == expected
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    backend.trie.check()


async def test_out_of_memory_splits_the_batch(make_backend, monkeypatch):
    backend = make_backend("llama")
    items = list(range(8))
    expected = await reference(make_backend, "llama", items)
    runner = backend.runner
    prefill, decode = runner.prefill, runner.decode
    splits = []

    def small_prefill(pool, rows):
        if len(rows) > 2:
            splits.append(len(rows))
            raise torch.OutOfMemoryError("simulated: batch too large")
        return prefill(pool, rows)

    def small_decode(pool, rows, tokens, ahead=None, **kw):
        if len(tokens) > 3:
            splits.append(len(tokens))
            raise torch.OutOfMemoryError("simulated: batch too large")
        return decode(pool, rows, tokens, ahead, **kw)

    monkeypatch.setattr(runner, "prefill", small_prefill)
    monkeypatch.setattr(runner, "decode", small_decode)
    q = lmq.Query(SRC, model=backend)
    results = await asyncio.gather(*(q.run(inputs(i)) for i in items))
    assert [r.variables for r in results] == expected
    assert splits
    assert backend.trie.pinned_nodes() == 0


async def test_soak_with_cancellations_and_invalid_queries(make_backend):
    backend = make_backend("llama", cache_budget=200_000)
    rng = random.Random(7)
    items = list(range(200))
    expected = dict(zip(items, await reference(make_backend, "llama", list(range(12)))
                        + [None] * 188))
    q = lmq.Query(SRC, model=backend)
    invalid = lmq.compile('"Shared instructions.[A]" where A in options', model=backend)

    async def one(i):
        for _ in range(rng.randint(0, 30)):
            await asyncio.sleep(0)
        if i % 17 == 5:
            return await invalid(options=[])  # an empty choice: fails at run time
        return (await q.run(inputs(i % 12))).variables

    tasks = [asyncio.ensure_future(one(i)) for i in items]
    cancelled = set(rng.sample(items, 30))
    for _ in range(40):
        await asyncio.sleep(0)
        for i in list(cancelled):
            if rng.random() < 0.1:
                tasks[i].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for i, r in zip(items, done):
        if i % 17 == 5 and not isinstance(r, asyncio.CancelledError):
            assert isinstance(r, lmq.LMQError)
        elif not isinstance(r, asyncio.CancelledError):
            assert r == expected[i % 12], i
    assert sum(isinstance(r, dict) for r in done) > 100
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    assert backend.trie.bytes_in_use <= 200_000
    backend.trie.check()


async def test_a_failure_in_the_step_loops_bookkeeping_fails_the_queries_and_none_hangs(make_backend, monkeypatch):
    """The step loop's own bookkeeping (here `Batch.compact`, which frees the slots of rows that left) raising once:
    the queries waiting on the engine get the error (none waits forever), and the engine serves the next ones."""
    backend = make_backend("llama")
    scheduler = backend.scheduler
    compact, failed = scheduler.batch.compact, []

    def broken():
        if not failed:
            failed.append(1)
            raise RuntimeError("simulated: bookkeeping bug")
        compact()

    monkeypatch.setattr(scheduler.batch, "compact", broken)
    q = lmq.Query(SRC, model=backend)
    results = await asyncio.wait_for(asyncio.gather(*(q.run(inputs(i)) for i in range(4)), return_exceptions=True),
                                     timeout=60)
    assert any(isinstance(r, RuntimeError) for r in results)
    expected = await reference(make_backend, "llama", [0, 1])
    assert [(await q.run(inputs(i))).variables for i in (0, 1)] == expected
    assert backend.trie.pinned_nodes() == 0 and scheduler.pool.rows == 0


@pytest.mark.parametrize("rows", [1, 16])
async def test_queries_between_holes_do_not_starve_a_tight_kv_budget(make_backend, tiny_models, tokenizer, rows):
    """150 concurrent three-hole queries, 1 or 16 rows at most, over a K/V budget of ~190 slots: the queries waiting
    for their next hole's prefill pin their prompts' paths in the trie, which filled the store until a query's
    prefill or the one decoding row had no slot, and failed ("out of K/V slots prefilling one query alone";
    in a decode step: every query). Those pins are cache only and now go under pressure
    (`Scheduler._release_pins`; with no row running, a prefill short of slots evicts what they let go at
    once, before the next look-ups pin it again): every query completes, as alone."""
    src = ('"Item {x}: words[A]" where len(TOKENS(A)) < 8\n" then some more text:[B]" where len(TOKENS(B)) < 12\n'
           '" free:[C]" where len(TOKENS(C)) < 6')
    inputs_of = [{"x": "word " * (i % 5) + str(i)} for i in range(20)]
    alone = lmq.Query(src, model=make_backend("llama", cache_budget=0))
    expected = [(await alone.run(x)).variables for x in inputs_of]
    backend = lmq.HFBackend.from_model(tiny_models["llama"], tokenizer, cache_budget=100_000, kv_budget="100KB",
                                       max_batch=rows, name="tight-kv")
    assert backend.store.capacity < 200
    q = lmq.Query(src, model=backend)
    results = await asyncio.gather(*(q.run(inputs_of[i % 20]) for i in range(150)))
    assert [r.variables for r in results] == [expected[i % 20] for i in range(150)]
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    backend.trie.check()


async def test_a_query_too_long_for_the_kv_budget_fails_alone(make_backend, tiny_models, tokenizer):
    """A query whose hole outgrows the whole K/V budget while it decodes alone gets the error; the queries
    that were waiting meanwhile run (before, the step's error failed every query waiting on the engine)."""
    backend = lmq.HFBackend.from_model(tiny_models["llama"], tokenizer, cache_budget=0, kv_budget="60KB",
                                       max_batch=1, name="tight-kv-long")
    long = lmq.Query('"Tell a long story:[A]" where len(TOKENS(A)) < 400', model=backend)
    short = lmq.Query('"Item {x}:[A]" where len(TOKENS(A)) < 4', model=backend)
    expected = [(await short.run({"x": str(i)})).variables for i in range(5)]
    results = await asyncio.gather(long.run({}), *(short.run({"x": str(i)}) for i in range(5)), return_exceptions=True)
    assert isinstance(results[0], lmq.LMQBackendError) and "KV budget" in str(results[0])
    assert [r.variables for r in results[1:]] == expected
    assert backend.scheduler.pool.rows == 0
