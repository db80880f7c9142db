"""Concurrent queries share batches: exactness batched vs alone, rows sampled and picked at once, shared
prefixes, the prefill limit, long prompts in parts (failures: test_batching_failures.py)."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

import lmq_backend as lmq
from support.caches import node_slots

SRC = '''
"Shared instructions for every call. {x}[A]" where len(TOKENS(A)) < {n}
if A.startswith(" "):
    " then[B]" where B in [" yes", " no", " maybe not"]
else:
    " else[B]" where STOPS_AT(B, "e") and len(TOKENS(B)) < 4
'''.replace("{n}", "5")


def inputs(i: int) -> dict:
    return {"x": f"item {i} " * (i % 4) + ("é" if i % 3 == 0 else "")}


async def reference(make_backend, kind, items):
    q = lmq.Query(SRC, model=make_backend(kind, cache_budget=0))
    return [(await q.run(inputs(i))).variables for i in items]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("seed", range(3))
async def test_batched_output_identical_to_alone_with_random_arrivals(make_backend, kind, seed):
    rng = random.Random(seed)
    items = list(range(10))
    expected = await reference(make_backend, kind, items)
    backend = make_backend(kind, cache_budget=rng.choice(["64MB", 60_000]))
    backend.scheduler.pool.make_room(rows=12, longest=400, extra=64)
    # the slots handed out first (lowest first) but the store's zero slot, as uninitialised memory may be:
    # never read, never leaks
    backend.store.data[:, :, 1:8192].fill_(float("nan"))
    steps = []
    backend.on_step(steps.append)
    q = lmq.Query(SRC, model=backend)

    async def call(i):
        for _ in range(rng.randint(0, 12)):
            await asyncio.sleep(0)
        return (await q.run(inputs(i))).variables

    assert await asyncio.gather(*(call(i) for i in items)) == expected
    assert max(s.batch_size for s in steps if s.kind == "decode") > 1
    assert max(s.batch_size for s in steps if s.kind == "prefill") > 1
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    backend.trie.check()


async def test_sample_n_runs_as_rows_sharing_the_prefix(make_backend):
    backend = make_backend("llama")
    steps = []
    backend.on_step(steps.append)
    q = lmq.compile('sample(n=4, seed=3)\n    "A long shared prompt for sampling, repeated.[X]" where len(TOKENS(X)) < 6',
                    model=backend)
    results = await q()
    assert len(results) == 4
    decodes = [s for s in steps if s.kind == "decode"]
    assert decodes and max(s.batch_size for s in decodes) == 4
    # The prompt is computed once, in one prefill of one row: the three other runs follow it (their rows join
    # the batch on the K/V the trie then holds and on its logits), with no prefill step of their own.
    prompt = len(backend.vocab.encode("A long shared prompt for sampling, repeated."))
    assert [(s.kind, s.batch_size) for s in steps[:2]] == [("prefill", 1), ("decode", 4)]
    stats = backend.stats()
    assert stats.tokens_requested == 4 * prompt
    assert stats.tokens_prefilled == prompt and stats.tokens_reused == 3 * prompt
    again = await q()
    assert [r.variables for r in again] == [r.variables for r in results]
    # each run draws its own samples: the same as where every run prefills its own prompt (no trie to follow)
    alone = lmq.compile(q.source, model=make_backend("llama", cache_budget=0))
    assert [r.variables for r in await alone()] == [r.variables for r in results]


@pytest.mark.parametrize("budget", ["64MB", 0])
async def test_calls_of_one_prompt_at_once_follow_one_prefill_and_match_alone(make_backend, budget):
    """Concurrent calls whose whole prompt is the same follow the one that computes it (without a trie, all
    prefill at once, as none waits for what no trie keeps); every call's values are what it gets alone."""
    expected = await reference(make_backend, "llama", [1, 2, 5])
    backend = make_backend("llama", cache_budget=budget)
    steps = []
    backend.on_step(steps.append)
    q = lmq.Query(SRC, model=backend)
    items = [1, 1, 1, 2, 2, 5, 1, 2]
    got = await asyncio.gather(*(q.run(inputs(i)) for i in items))
    assert [r.variables for r in got] == [expected[[1, 2, 5].index(i)] for i in items]
    first = [s for s in steps if s.kind == "prefill"][0]
    assert first.batch_size == (3 if budget else len(items))
    assert backend.scheduler.pool.rows == 0 and not backend.scheduler.waiting
    assert backend.trie.pinned_nodes() == 0


def sample_calls(monkeypatch) -> list[int]:
    """How many draws each `ModelRunner.sample` call is given, from here on."""
    from lmq_backend.engine.runner import ModelRunner

    calls, real = [], ModelRunner.sample

    def spy(self, logits, draws):
        calls.append(len(draws))
        return real(self, logits, draws)

    monkeypatch.setattr(ModelRunner, "sample", spy)
    return calls


async def test_a_step_samples_all_its_sampling_rows_at_once(make_backend, monkeypatch):
    """Sampling rows are picked by one `ModelRunner.sample` a step (prefills and decode steps alike), never
    one `Sampling.select` a row; each row's values are what it draws alone (seeded, float32)."""
    from lmq_backend.engine.picks import Sampling

    backend = make_backend("llama")
    q = lmq.compile('sample(n=3, temperature=0.9, seed=11)\n    "Say something about {x}:[X]" where len(TOKENS(X)) < 5',
                    model=backend)
    alone = {x: [r.variables for r in await q(x=x)] for x in ("cats", "dogs", "rain", "tea")}
    calls = sample_calls(monkeypatch)
    monkeypatch.setattr(Sampling, "select", lambda *a: pytest.fail("a sampled pick made a row at a time"))
    together = await asyncio.gather(*(q(x=x) for x in alone))
    assert {x: [r.variables for r in rs] for x, rs in zip(alone, together)} == alone
    assert sum(calls) == 12 * 4 and max(calls) > 3  # 12 rows x 4 picks (the prefill's and three steps')


async def test_a_step_picks_its_constrained_greedy_rows_at_once(make_backend, monkeypatch):
    """Greedy rows under masks of their own (INT, REGEX, a list of choices) are picked by one
    `ModelRunner.sample` a step with the step's other rows, not one `Greedy.select` a row: but for a REGEX
    hole's first pick (checked without its mask, `HoleLoop._checked`: a random model's unconstrained pick
    breaks the REGEX, so that pick is made again from the row's mask, and the hole's next picks compute
    the mask first); each query's values are what it gets alone."""
    from lmq_backend.engine.picks import Greedy

    backend = make_backend("llama")
    q = lmq.compile('"Count {x}:[N] then[R] and[C]" where INT(N) and len(TOKENS(N)) < 4 and '
                    'REGEX(R, r"[a-z]{2,9}") and C in [" one more", " two", " three of them"]', model=backend)
    alone = {x: (await q(x=x)).variables for x in ("cats", "dogs", "rain", "tea", "a long list of things")}
    calls = sample_calls(monkeypatch)
    alone_picks = []
    select = Greedy.select
    monkeypatch.setattr(Greedy, "select", lambda *a: alone_picks.append(1) or select(*a))
    together = await asyncio.gather(*(q(x=x) for x in alone))
    assert {x: r.variables for x, r in zip(alone, together)} == alone
    assert max(calls) == len(alone)
    assert len(alone_picks) <= len(alone)  # one a REGEX hole at most


async def test_shared_new_prefix_is_prefilled_once(make_backend):
    backend = make_backend("llama")
    shots = "Example: the quick brown fox jumps over the lazy dog.\n" * 6
    q = lmq.compile('"{shots}Q: {x}[A]" where len(TOKENS(A)) < 3', model=backend)
    await asyncio.gather(*(q(shots=shots, x=str(i)) for i in range(6)))
    s = backend.stats()
    assert s.tokens_prefilled < len(backend.vocab.encode(shots)) * 1.5
    assert s.tokens_reused > 0


async def test_a_prefill_reads_at_most_its_limit_and_looks_up_only_what_can_fit(make_backend, monkeypatch):
    """`max_prefill_read` bounds the columns (cached + new tokens of every row) of a prefill step's rows (a lone
    row always runs), and a step looks up in the trie only the waiting requests whose prompts fit it, and
    SELECT_MARGIN more; the runner's limit (none for the fused prefill on a GPU, which reads through the
    page tables) leaves the decode batch's seats as the bound. The answers do not change."""
    from lmq_backend.engine import admission

    monkeypatch.setattr(admission, "SELECT_MARGIN", 2)
    window, windows = admission.window, []

    def recorded(waiting, most, read_limit):
        w = window(waiting, most, read_limit)
        windows.append((read_limit, [len(x.request.ids) for x in w]))
        return w
    monkeypatch.setattr(admission, "window", recorded)
    items = list(range(24))
    expected = await reference(make_backend, "llama", items)
    largest = {}
    for limit in (100, None):
        backend = make_backend("llama")
        backend.scheduler.max_prefill_read = limit
        steps = []
        windows.clear()
        backend.on_step(steps.append)
        q = lmq.Query(SRC, model=backend)
        got = await asyncio.gather(*(q.run(inputs(i)) for i in items))
        assert [r.variables for r in got] == expected
        prefills = [s for s in steps if s.kind == "prefill"]
        largest[limit] = max(s.batch_size for s in prefills)
        if limit is not None:
            assert all(s.batch_size == 1 or s.new_tokens + s.cached_tokens <= limit for s in prefills)
            # looked up: those that fit by their prompts' lengths, and two more
            assert all(read_limit == limit and sum(lengths[:-2]) <= limit for read_limit, lengths in windows)
        assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    assert 1 < largest[100] < largest[None]


async def test_map_keeps_input_order_with_bounded_concurrency(make_backend):
    backend = make_backend("llama")
    steps = []
    backend.on_step(steps.append)
    q = lmq.Query(SRC, model=backend)
    items = list(range(9))
    results = await q.map([inputs(i) for i in items], concurrency=3, progress=True)
    assert [r.variables for r in results] == await reference(make_backend, "llama", items)
    assert max(s.batch_size for s in steps) <= 3


LONG = ('"Long instructions for every call: ' + "the quick brown fox jumps over the lazy dog, " * 12
        + '{x}[A]" where len(TOKENS(A)) < 4')


async def test_out_of_memory_prefills_a_long_prompt_in_smaller_parts(make_backend, monkeypatch):
    """A prefill of more than 48 new tokens runs out of memory: the long prompt (~130 tokens) alone is
    prefilled in halved parts instead of failing, with the tokens it gets in one piece."""
    from lmq_backend.engine import admission

    expected = (await lmq.Query(LONG, model=make_backend("llama", cache_budget=0)).run({"x": "ok"})).variables
    backend = make_backend("llama", cache_budget=0)
    monkeypatch.setattr(admission, "MIN_PART", 8)
    prefill, tried = backend.runner.prefill, []

    def small_prefill(pool, rows):
        tried.append(len(rows[0].ids))
        if len(rows[0].ids) > 48:
            raise torch.OutOfMemoryError("simulated: too many new tokens")
        return prefill(pool, rows)

    monkeypatch.setattr(backend.runner, "prefill", small_prefill)
    assert (await lmq.Query(LONG, model=backend).run({"x": "ok"})).variables == expected
    done = [n for n in tried if n <= 48]  # the parts that ran: the whole prompt, none twice
    assert tried[0] > 100 and sum(done) == tried[0] and len(done) >= 3
    assert backend.scheduler.pool.rows == 0
    backend.store.check(node_slots(backend.trie), [])


async def test_a_query_cancelled_between_parts_frees_what_its_parts_hold(make_backend):
    """A long prompt prefilled in parts of 16 tokens, its query cancelled after the first part: the slots of
    the parts done go back to the store, and the engine serves the next query."""
    backend = make_backend("llama")
    backend.scheduler.max_prefill_tokens = 16
    steps = []
    task = asyncio.ensure_future(lmq.Query(LONG, model=backend).run({"x": "ok"}))
    backend.on_step(lambda s: (steps.append(s), task.cancel()))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(s.kind, s.new_tokens) for s in steps] == [("prefill", 16)]
    backend.on_step(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert not backend.scheduler.waiting and backend.scheduler.pool.rows == 0
    backend.store.check(node_slots(backend.trie), [])
    expected = await reference(make_backend, "llama", [1])
    assert [(await lmq.Query(SRC, model=backend).run(inputs(1))).variables] == expected


async def test_a_long_prompt_comes_in_parts_only_while_rows_decode(make_backend):
    """`max_part_tokens`: alone, a long prompt is one prefill; arriving while another query decodes, it comes
    in parts, that query's row stepping between them; the results are those of the query alone."""
    backend = make_backend("llama", cache_budget=0)
    backend.scheduler.max_part_tokens = 32
    expected = (await lmq.Query(LONG, model=backend).run({"x": "ok"})).variables
    steps = []
    backend.on_step(steps.append)
    assert (await lmq.Query(LONG, model=backend).run({"x": "ok"})).variables == expected
    assert [s.new_tokens for s in steps if s.kind == "prefill"] == [steps[0].new_tokens] and steps[0].new_tokens > 100
    steps.clear()
    busy = asyncio.ensure_future(lmq.Query('"Count:[A]" where len(TOKENS(A)) < 40', model=backend).run({}))
    while not any(s.kind == "decode" for s in steps):
        await asyncio.sleep(0)
    assert (await lmq.Query(LONG, model=backend).run({"x": "ok"})).variables == expected
    await busy
    parts = [i for i, s in enumerate(steps) if s.kind == "prefill" and s.new_tokens == 32]
    assert len(parts) >= 3 and all(steps[i + 1].kind == "decode" for i in parts)


async def test_rows_in_one_choice_state_pick_under_one_mask_object(make_backend, monkeypatch):
    """Concurrent `X in [...]` holes: the rows at one place in the options pick under one mask object (a
    constraint's shared mask, its extendable part memoized by the backend), so a step stacks and moves a mask a
    place, not one a row (1,024 rows: 50 MB a step)."""
    from lmq_backend.engine import picks_cpu

    backend = make_backend("llama")
    seen, greedy = [], picks_cpu.greedy

    def spy(logits, masks):
        seen.append((len(masks), len({id(m) for m in masks})))
        return greedy(logits, masks)
    monkeypatch.setattr(picks_cpu, "greedy", spy)
    q = lmq.Query('"Item {i}:[A]" where A in [" alpha beta gamma", " delta epsilon"]', model=backend)
    values = [r.variables["A"] for r in await asyncio.gather(*(q.run({"i": i}) for i in range(16)))]
    assert set(values) <= {" alpha beta gamma", " delta epsilon"}
    busy = [(rows, unique) for rows, unique in seen if rows >= 8]  # (a mask a place: a few, not one a row)
    assert busy and all(unique * 4 <= rows for rows, unique in busy)


async def test_a_part_that_fails_after_its_row_was_added_keeps_the_parts_done(make_backend, monkeypatch):
    """A long prompt in parts of 16 tokens; its second part fails with out of memory after its row took slots
    (as a forward that runs out of memory does): the row is dropped with the slots it took, but not those of
    the part done, which the retried part (halved) reads as its cached prefix."""
    from lmq_backend.engine import admission

    expected = (await lmq.Query(LONG, model=make_backend("llama", cache_budget=0)).run({"x": "ok"})).variables
    backend = make_backend("llama", cache_budget=0)
    backend.scheduler.max_prefill_tokens = 16
    monkeypatch.setattr(admission, "MIN_PART", 8)
    prefill, calls = backend.runner.prefill, []

    def failing_second(pool, rows):
        calls.append(len(rows[0].ids))
        out = prefill(pool, rows)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated: out of memory in the forward")
        return out

    monkeypatch.setattr(backend.runner, "prefill", failing_second)
    assert (await lmq.Query(LONG, model=backend).run({"x": "ok"})).variables == expected
    assert calls[:3] == [16, 16, 8]
    assert backend.scheduler.pool.rows == 0
    backend.store.check(node_slots(backend.trie), [])
