"""`beam_sample(n, temperature)` (LMQL's: each beam draws n tokens, the n best distinct proposals stay) and
`distribution` on any prompt line (inline: `"A:[CLS]" distribution CLS in [..]`, or the global clause naming
any hole): the program goes on with the most likely option."""
from __future__ import annotations

import asyncio
import math

import pytest

import lmq_backend as lmq

SAMPLED = 'beam_sample(n=3, temperature={t}, seed={seed})\n    "Tell me: [A]" where len(TOKENS(A)) < 4\n'


async def log_probability(backend, prompt: str, value: str) -> float:
    seq = backend.sequence("ref")
    await backend.extend(seq, prompt)
    try:
        [lps] = await backend.score_tokens(seq, [backend.vocab.encode_continuation(value)])
    finally:
        backend.release(seq)
    return sum(lps)


async def test_beam_sample_scores_repeats_and_ranks(make_backend):
    backend = make_backend("llama")
    first = await lmq.compile(SAMPLED.format(t=2.0, seed=1)).run({}, backend)
    again = await lmq.compile(SAMPLED.format(t=2.0, seed=1)).run({}, backend)
    assert [(r.prompt, r.score) for r in first] == [(r.prompt, r.score) for r in again]  # seeded: repeats
    assert len(first) == 3 and len({r["A"] for r in first}) == 3
    assert [r.score for r in first] == sorted((r.score for r in first), reverse=True)
    for r in first:
        assert r.score == pytest.approx(await log_probability(backend, "Tell me: ", r["A"]), abs=1e-4)
    others = [await lmq.compile(SAMPLED.format(t=2.0, seed=s)).run({}, backend) for s in range(2, 6)]
    assert any({r["A"] for r in rs} != {r["A"] for r in first} for rs in others)  # the draws differ
    greedy = await lmq.compile('argmax\n    "Tell me: [A]" where len(TOKENS(A)) < 4\n').run({}, backend)
    [cold] = await lmq.compile(SAMPLED.format(t=0, seed=1)).run({}, backend)  # temperature 0: the best token
    assert cold.prompt == greedy.prompt
    assert backend.stats().pinned_nodes == 0


OPTIONS = [" yes", " no", " maybe"]
INLINE = f'''
argmax
    "Q: {{q}}\\nA:[CLS]" distribution CLS in {OPTIONS!r}
    "\\nWhy:[WHY]" where len(TOKENS(WHY)) < 4
'''


async def reference_distribution(backend, prompt):
    seq = backend.sequence("ref")
    await backend.extend(seq, prompt)
    try:
        logps = await backend.score(seq, OPTIONS)
    finally:
        backend.release(seq)
    top = max(logps)
    total = sum(math.exp(lp - top) for lp in logps)
    return {o: math.exp(lp - top) / total for o, lp in zip(OPTIONS, logps)}


async def test_an_inline_distribution_scores_and_the_query_goes_on(make_backend):
    backend = make_backend("llama")
    r = await lmq.compile(INLINE).run({"q": "is it?"}, backend)
    expected = await reference_distribution(backend, "Q: is it?\nA:")
    assert r.distribution == pytest.approx(expected, abs=1e-5) and r.distributions == {"CLS": r.distribution}
    assert r["CLS"] == max(expected, key=expected.get)
    flat = await lmq.compile(f'"Q: is it?\\nA:{r["CLS"]}\\nWhy:[WHY]" where len(TOKENS(WHY)) < 4').run(
        {}, make_backend("llama", cache_budget=0))
    assert r["WHY"] == flat["WHY"]
    global_clause = INLINE.replace(f" distribution CLS in {OPTIONS!r}", "") + f"distribution CLS in {OPTIONS!r}\n"
    assert (await lmq.compile(global_clause).run({"q": "is it?"}, backend)).prompt == r.prompt


async def test_distributions_batched_uncached_and_under_beams(make_backend):
    q = lmq.compile(INLINE)
    questions = [{"q": x} for x in ["a?", "is it?", "why not?"]]
    alone = [await q.run(x, make_backend("llama", cache_budget=0)) for x in questions]
    backend = make_backend("llama")
    batched = await asyncio.gather(*(q.run(x, backend) for x in questions))
    assert [r.prompt for r in batched] == [r.prompt for r in alone]  # greedy tokens: exact
    for b, a in zip(batched, alone):  # probabilities: to float32's rounding in another batch's shapes
        assert b.distribution == pytest.approx(a.distribution, abs=1e-5)
    beams = await lmq.compile(INLINE.replace("argmax", "beam(n=2)")).run({"q": "a?"}, backend)
    assert all(b["CLS"] == alone[0]["CLS"] for b in beams) and len(beams) == 2
    assert backend.stats().pinned_nodes == 0
