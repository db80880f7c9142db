"""A soak of the paged engine (issue: paged radix KV): 2,000 queries with random arrivals, cancellations
and invalid queries mixed in, under a K/V budget tight enough to force trie eviction, queued prefills and
preempted decode rows. Every valid query must give the result it gives alone with the cache off; the
store's and the trie's invariants hold at every step; at the end nothing is pinned and every slot is free
or the trie's."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lmq_backend as lmq
from lmq_backend.backend.hf import HFBackend
from lmq_backend.cache.kv_store import token_bytes
from support.caches import node_slots

SRC = '''
"Soak test: shared instructions that every call repeats, long enough to be worth caching in the trie."
"{x}[A]" where len(TOKENS(A)) < n
if A.startswith(" "):
    " then[B]" where B in [" yes", " no", " maybe not"]
else:
    " else[B]" where STOPS_AT(B, "e") and len(TOKENS(B)) < 4
'''
DISTINCT = 24
PER_TOKEN = token_bytes(2, 1, 16, torch.float32)  # the model below: 2 layers, 1 kv head of 16


@pytest.fixture(scope="module")
def model():
    """Smaller than the other tests' tiny Llama (the LM head over the 49,152-token vocabulary is most of a
    step): the soak is about the engine's bookkeeping, not the model."""
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=4096)).eval()


def inputs(i: int) -> dict:
    """Prompts of 1 to ~70 own tokens, holes of 3 to 24 tokens, and of 50 (rows that outgrow the slots
    admission keeps for them)."""
    return {"x": f" item {i}," * (3 * (i % 8)) + ("é" if i % 3 == 0 else ""),
            "n": 50 if i % 6 == 1 else 4 + (i * 7) % 21}


def check(backend: HFBackend) -> None:
    pool = backend.scheduler.pool
    backend.trie.check()
    held = [w.row.slots for w in backend.scheduler.waiting if w.started]  # long prompts' parts done
    backend.store.check(node_slots(backend.trie), [pool.row_slots(s) for s in range(pool.rows)] + held)


def checking(backend: HFBackend, every: int) -> list:
    """The backend's steps from now on (a list that grows), with `check` every `every` steps."""
    steps = []

    def on_step(info):
        steps.append(info)
        if len(steps) % every == 0:
            check(backend)

    backend.on_step(on_step)
    return steps


async def run_cancelling(one, n: int, rng: random.Random, cancelled: int, turns: int, chance: float) -> list:
    """`one(i)` for i < n at once; `cancelled` of them, drawn by `rng`, are cancelled at random turns of the
    event loop (each with `chance` a turn, for `turns` turns). Each one's result, exception or cancellation."""
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    cancel = set(rng.sample(range(n), cancelled))
    for _ in range(turns):
        await asyncio.sleep(0)
        for i in list(cancel):
            if rng.random() < chance:
                tasks[i].cancel()
                cancel.discard(i)
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "in-parts"])
async def test_soak_2000_queries_tight_kv_budget(tokenizer, model, parts):
    """`in-parts`: a step takes at most 24 new tokens, so most prompts are prefilled in parts."""
    alone = HFBackend.from_model(model, tokenizer, cache_budget=0, name="alone")
    q_alone = lmq.Query(SRC, model=alone)
    expected = [(await q_alone.run(inputs(i))).variables for i in range(DISTINCT)]

    # ~25 rows' worth of slots: far fewer than the 256 seats the batch offers
    backend = HFBackend.from_model(model, tokenizer, cache_budget=300 * PER_TOKEN, name="soak",
                                   kv_budget=2000 * PER_TOKEN)
    if parts:
        backend.scheduler.max_prefill_tokens = 24
    steps = checking(backend, every=7)
    q = lmq.Query(SRC, model=backend)
    invalid_runtime = lmq.compile('"Soak test: shared.[A]" where A in options', model=backend)
    too_long = lmq.compile('argmax(max_len=8)\n"{x}[A]" where len(TOKENS(A)) < 4', model=backend)
    rng = random.Random(11)
    n = 2000

    async def one(i: int):
        for _ in range(rng.randint(0, 40)):
            await asyncio.sleep(0)
        if i % 53 == 7:
            return await invalid_runtime(options=[])          # an empty choice: fails at run time
        if i % 61 == 9:
            return await too_long(x="far too long a prompt for max_len " * 3)
        return (await q.run(inputs(i % DISTINCT))).variables

    done = await run_cancelling(one, n, rng, cancelled=200, turns=300, chance=0.02)

    finished = 0
    for i, r in enumerate(done):
        if isinstance(r, asyncio.CancelledError):
            continue
        if i % 53 == 7 or i % 61 == 9:
            assert isinstance(r, lmq.LMQError), (i, r)
        else:
            assert r == expected[i % DISTINCT], (i, r)
            finished += 1
    assert finished > 1500
    # the budget forced trie eviction, and bounded the batch below its 256 seats (prefills waited for
    # slots); preemption: the test below
    assert backend.stats().evictions > 0
    assert 8 < max(s.batch_size for s in steps if s.kind == "decode") < 120
    if parts:
        assert sum(s.kind == "prefill" and s.new_tokens == 24 and s.batch_size == 1 for s in steps) > 100
    # nothing left behind: no pins, no rows, every slot free or the trie's
    check(backend)
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
    trie_slots = sum(len(s) for s in node_slots(backend.trie))
    assert backend.store.used_slots == trie_slots


async def test_decode_rows_preempted_for_slots_resume_exactly(tokenizer, model):
    """Rows admitted while slots last outgrow the store as they decode: the latest rows are preempted,
    prefill their tokens again later and finish with the tokens they give alone."""
    src = '"Preemption: a prompt of some length, item {i}.[A]" where len(TOKENS(A)) < 60'
    alone = lmq.compile(src, model=HFBackend.from_model(model, tokenizer, cache_budget=0, name="alone"))
    expected = [(await alone(i=i)).variables for i in range(10)]
    backend = HFBackend.from_model(model, tokenizer, cache_budget=0, name="tight", kv_budget=400 * PER_TOKEN)
    steps = checking(backend, every=1)
    q = lmq.compile(src, model=backend)
    assert [r.variables for r in await asyncio.gather(*(q(i=i) for i in range(10)))] == expected
    assert backend.scheduler.preemptions > 0
    assert max(s.batch_size for s in steps if s.kind == "decode") > 2
    check(backend)
    assert backend.store.used_slots == 0 and backend.scheduler.pool.rows == 0


SAMPLED = '''sample(temperature=1.0, seed={seed})
"Sampled soak, item {i}:[A]" where REGEX(A, r"[a-z ]{{1,40}}") and len(TOKENS(A)) < {n}
" as JSON:[J]" where JSON(J, {schema!r}) and len(TOKENS(J)) < 30
'''
SCHEMA = '{"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]}}, "required": ["k"], ' \
         '"x-guidance": {"whitespace_flexible": false}}'


async def test_sampled_constrained_soak_values_hold(tokenizer, model):
    """Sampled REGEX and JSON holes (drawn without their masks, redrawn under them where a draw breaks the
    constraint: `HoleLoop._checked`) under random arrivals, cancellations and a K/V budget that preempts
    rows: every value follows its constraint, no query fails, and nothing is left behind. (Their values are
    not compared with the queries run alone: a prefix computed by another prefill can move a logit's last
    bits, and a draw that close to a boundary picks the neighbour; README, sampling.)"""
    import json
    import re

    backend = HFBackend.from_model(model, tokenizer, cache_budget=200 * PER_TOKEN, name="soak-sampled",
                                   kv_budget=200 * PER_TOKEN)
    checking(backend, every=5)
    rng = random.Random(5)

    async def one(i: int):
        for _ in range(rng.randint(0, 30)):
            await asyncio.sleep(0)
        q = lmq.compile(SAMPLED.format(seed=i % 7, i=i % 11, n=[6, 40][i % 2], schema=SCHEMA), model=backend)
        return (await q()).variables

    done = await run_cancelling(one, 300, rng, cancelled=30, turns=100, chance=0.05)
    finished = [r for r in done if not isinstance(r, asyncio.CancelledError)]
    # a JSON value its token limit cuts is refused (the random model's strings run long), never returned
    refused = [r for r in finished if isinstance(r, lmq.LMQUnsatisfiedError)]
    values = [r for r in finished if isinstance(r, dict)]
    assert len(finished) > 250 and len(values) + len(refused) == len(finished) and len(values) > 100, \
        [r for r in finished if not isinstance(r, (dict, lmq.LMQUnsatisfiedError))][:3]
    assert all("hole [J]: the constraint cannot be satisfied: the token limit" in str(e) for e in refused), refused[:3]
    for r in values:
        assert re.fullmatch(r"[a-z ]{1,40}", r["A"]), r
        assert json.loads(r["J"])["k"] in ("a", "b", "c"), r
    assert backend.scheduler.preemptions > 0
    check(backend)
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0
