"""Beam decoders (runtime/beam.py) on a tiny random model: `beam(n=1)` gives `argmax`'s tokens under every
kind of constraint; a beam's score is the model's log-probability of its tokens (independent `score_tokens`
and `score` calls); beams and scores are the same with the cache on or off, for a query alone or many at once,
among greedy queries and with fewer seats than beams; bad arguments are compile errors; `lmq run` prints
each beam; no pin is left in the trie. (tests/runtime/test_beam_by_hand.py checks each decoder's search by hand.)
"""
from __future__ import annotations

import asyncio
import json

import pytest

import lmq_backend as lmq
from lmq_backend.backend import registry
from lmq_backend.cli import main
from lmq_backend.errors import LMQCompileError, LMQNotSupportedError
from lmq_backend.runtime.decoders import DecoderSpec


QUERIES = [
    # (query body, inputs)
    ('"Say: {x}[A]" where len(TOKENS(A)) < 6', {"x": "hello"}),
    ('"Q: {x}\\nA:[A]\\nB:[B]" where STOPS_AT(A, "e") and len(TOKENS(A)) < 8 and len(TOKENS(B)) < 4',
     {"x": "why"}),
    ('"Number: [N]" where INT(N) and len(TOKENS(N)) < 5', {}),
    ('"Pick: [C]" where C in [" apple", " banana split", " cherry"]\n    "then[D]" where len(TOKENS(D)) < 3', {}),
    ('"Items:"\n    for i in range(2):\n        "\\n{i}.[ITEM]" where len(TOKENS(ITEM)) < 3\n'
     '    if ITEM.strip():\n        "!"\n    "[Z]" where len(TOKENS(Z)) < 2', {}),
]


@pytest.mark.parametrize("body,inputs", QUERIES)
def test_beam_one_equals_argmax(make_backend, body, inputs):
    backend = make_backend("llama")
    greedy = asyncio.run(lmq.compile(f"argmax\n    {body}\n", model=backend)(**inputs))
    [beam] = asyncio.run(lmq.compile(f"beam(n=1)\n    {body}\n", model=backend)(**inputs))
    assert (beam.prompt, beam.variables) == (greedy.prompt, greedy.variables)
    assert beam.score < 0 and greedy.score is None
    assert backend.stats().pinned_nodes == 0


def test_score_is_the_values_log_probability(make_backend):
    """A value that stops at its token limit: the score is the sum of its tokens' log-probabilities."""
    backend = make_backend("llama")
    results = asyncio.run(lmq.compile('beam(n=3)\n    "Tell me: [A]" where len(TOKENS(A)) < 4\n', model=backend)())
    assert len(results) == 3 and [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert len({r["A"] for r in results}) == 3

    async def reference(value: str) -> float:
        seq = backend.sequence("ref")
        await backend.extend(seq, "Tell me: ")
        try:
            [lps] = await backend.score_tokens(seq, [backend.vocab.encode_continuation(value)])
        finally:
            backend.release(seq)
        return sum(lps)

    for r in results:
        assert r.score == pytest.approx(asyncio.run(reference(r["A"])), abs=1e-4)


def test_score_under_a_mask_is_the_models_log_probability(make_backend):
    """A mask selects tokens and does not renormalise them: beams over a choice of options are the options
    ranked by their log-probability, as `Backend.score` (the `distribution` clause) gives it. (Options of
    one byte: one token each, no other spelling; beams are token paths, and a beam search of width n
    explores only n of them at each step.)"""
    backend = make_backend("llama")
    options = ["x", "y", "z", "w"]
    q = lmq.compile(f'beam(n=4)\n    "Fruit:[C]" where C in {options!r}\n', model=backend)
    results = asyncio.run(q())

    async def reference() -> list[float]:
        seq = backend.sequence("ref")
        await backend.extend(seq, "Fruit:")
        try:
            return await backend.score(seq, options)
        finally:
            backend.release(seq)

    expected = sorted(zip(asyncio.run(reference()), options), reverse=True)
    assert [r["C"] for r in results] == [o for _, o in expected]
    assert [r.score for r in results] == pytest.approx([lp for lp, _ in expected], abs=1e-4)


BEAM_QUERIES = [
    ('beam(n=3)', '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 5\n    "\\nB:[B]" where len(TOKENS(B)) < 3'),
    ('beam_var(n=3)', '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 5\n    "\\nB:[B]" where len(TOKENS(B)) < 3'),
    ('beam_sample(n=3, temperature=1.5, seed=3)',
     '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 5\n    "\\nB:[B]" where len(TOKENS(B)) < 3'),
    ('best_k(k=2, budget=8, gamma=0)', '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 4\n    "\\nB:[B]" where len(TOKENS(B)) < 3'),
    ('var(b=2, n=3)', '"Q: {x}\\nA:[A]" where STOPS_AT(A, "a") and len(TOKENS(A)) < 5\n    "\\nB:[B]" where INT(B) and len(TOKENS(B)) < 3'),
]


@pytest.mark.parametrize("decoder,body", BEAM_QUERIES)
def test_beams_cache_on_off_batched_alone(make_backend, decoder, body, monkeypatch):
    """The same beams with the cache on or off, batched or alone, among greedy queries; a step takes the
    choices of all the beams it prefills at once (`ModelRunner.choose`), not a top-k a beam."""
    from lmq_backend.engine.runner import ModelRunner

    asked, real = [], ModelRunner.choose
    monkeypatch.setattr(ModelRunner, "choose", staticmethod(lambda logits, asks: asked.append(len(asks))
                                                            or real(logits, asks)))
    inputs = [{"x": w} for w in ("one", "two", "three", "four")]

    def outcome(results):
        return [[(r.prompt, r.variables) for r in rs] for rs in results], [[r.score for r in rs] for rs in results]

    cached = make_backend("llama")
    q = lmq.compile(f"{decoder}\n    {body}\n", model=cached)

    async def together():
        return await asyncio.gather(*(q(**i) for i in inputs))

    steps = []
    cached.on_step(steps.append)
    batched = outcome(asyncio.run(together()))
    cached.on_step(None)
    # the beams of the four queries step together: one forward for more beams than queries, a new token each
    assert any(s.batch_size == s.new_tokens > len(inputs) for s in steps)
    assert max(asked) > len(inputs)
    uncached = make_backend("llama", cache_budget=0)
    alone = outcome([asyncio.run(q.run(i, backend=uncached)) for i in inputs])
    assert batched[0] == alone[0]
    # beams among greedy queries (rows that decode): the same beams, the same greedy values
    greedy = lmq.compile(f"argmax\n    {body}\n", model=cached)

    async def mixed():
        return await asyncio.gather(*(f(**i) for i in inputs for f in (q, greedy)))

    together_with_greedy = asyncio.run(mixed())
    assert outcome(together_with_greedy[::2])[0] == alone[0]
    assert [(r.prompt, r.variables) for r in together_with_greedy[1::2]] == \
        [(r.prompt, r.variables) for r in (asyncio.run(greedy.run(i, backend=uncached)) for i in inputs)]
    assert sum(batched[1], []) == pytest.approx(sum(alone[1], []), abs=1e-4)
    assert cached.stats().pinned_nodes == 0 and cached.stats().tokens_reused > 0


@pytest.mark.parametrize("decoder,message", [
    ("beam(n=0)", "n must be an integer >= 1"),
    ('beam(n="2")', "n must be an integer >= 1"),
    ("beam_var(n=1.5)", "n must be an integer >= 1"),
    ("var(b=0)", "b must be an integer >= 1"),
    ("beam(n=2, max_len=0)", "max_len must be an integer >= 1"),
    ("beam(temperature=0.5)", "unknown argument 'temperature' for decoder beam"),
    ("var(n=2, seed=1)", "unknown argument 'seed' for decoder var"),
    ("best_k(k=0)", "k must be an integer >= 1"),
    ("best_k(gamma=1.5)", "gamma must be a number in \\[0, 1\\]"),
    ("best_k(n=2)", "unknown argument 'n' for decoder best_k"),
    ("top_k(k=2)", "unknown decoder 'top_k'"),
])
def test_bad_beam_arguments(decoder, message):
    with pytest.raises(LMQCompileError, match=message):
        lmq.compile(f'{decoder}\n    "a[X]"\n')


def test_bad_beam_arguments_given_as_text():
    """`@lmq.query(decoder=...)` reads the decoder as text: the same checks."""
    with pytest.raises(LMQCompileError, match="unknown argument"):
        DecoderSpec.parse("beam(n=2, top_p=0.5)")
    with pytest.raises(LMQCompileError, match="n must be an integer >= 1"):
        DecoderSpec.parse("beam_var(n=-1)")
    with pytest.raises(LMQNotSupportedError, match="best_k"):
        DecoderSpec.parse("beam_search(n=2)")
    with pytest.raises(LMQCompileError, match="budget must be an integer >= 1"):
        DecoderSpec.parse("best_k(budget=0)")
    assert (DecoderSpec.parse("beam").n, DecoderSpec.parse("var(b=3)").n) == (4, 3)  # LMQL's defaults


def test_cli_prints_each_beam(make_backend, tmp_path, capsys):
    backend = make_backend("llama")
    registry.register_backend("tiny-beam", backend)
    query = tmp_path / "q.lmq"
    query.write_text('beam(n=2)\n    "Say:[A]" where len(TOKENS(A)) < 3\n')
    try:
        assert main(["run", str(query), "--model", "tiny-beam"]) == 0
        out = capsys.readouterr().out
        assert "=== beam 1 of 2 ===" in out and "=== beam 2 of 2 ===" in out and out.count("score = -") == 2
        assert main(["run", str(query), "--model", "tiny-beam", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert len(doc) == 2 and doc[0]["score"] >= doc[1]["score"] and doc[0]["prompt"].startswith("Say:")
    finally:
        registry._REGISTRY.pop("tiny-beam", None)


def test_decorated_query_with_return_and_distribution(make_backend):
    """`@lmq.query(decoder="beam(...)")` returns the n return values, best first; a `distribution` clause
    is scored for each beam."""
    backend = make_backend("llama")

    @lmq.query(model=backend, decoder="beam(n=3)")
    async def pick(topic):
        '''lmq
        "About {topic}:[A]" where len(TOKENS(A)) < 3
        "Verdict:[V]"
        return A.upper()
        distribution V in [" yes", " no"]
        '''

    values = asyncio.run(pick("tea"))
    assert len(values) == 3 and all(isinstance(v, str) and v == v.upper() for v in values)
    q = lmq.compile('beam(n=3)\n    "About {topic}:[A]" where len(TOKENS(A)) < 3\n    "Verdict:[V]"\n'
                    'distribution V in [" yes", " no"]\n', model=backend)
    results = asyncio.run(q(topic="tea"))
    assert [r["A"].upper() for r in results] == values
    assert all(set(r.distribution) == {" yes", " no"} and r["V"] in (" yes", " no") for r in results)
    assert backend.stats().pinned_nodes == 0


def test_cancelled_beam_query_leaves_no_pin(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('beam(n=4)\n    "Story:[A]" where len(TOKENS(A)) < 40\n', model=backend)
    steps = []
    backend.on_step(steps.append)

    async def cancel_midway():
        task = asyncio.ensure_future(q())
        while len(steps) < 5:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert 5 <= len(steps) < 40 and backend.stats().pinned_nodes == 0
    backend.trie.check()


def test_more_beams_than_seats(tokenizer, tiny_models):
    """Beams never hold a row while they wait for each other: 6 queries of 3 beams among greedy queries,
    on a batch of 4 seats, finish with the beams they have alone."""
    from lmq_backend.backend.hf import HFBackend

    small = HFBackend.from_model(tiny_models["llama"], tokenizer, cache_budget="64MB", max_batch=4)
    body = '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 4\n    "\\nB:[B]" where len(TOKENS(B)) < 3'
    q = lmq.compile(f"beam(n=3)\n    {body}\n", model=small)
    greedy = lmq.compile(f"argmax\n    {body}\n", model=small)
    words = ("one", "two", "three", "four", "five", "six")

    async def crowd():
        return await asyncio.wait_for(asyncio.gather(*(f(x=w) for w in words for f in (q, greedy))), 60)

    together = asyncio.run(crowd())
    alone = [asyncio.run(q(x=w)) for w in words]
    assert [[r.variables for r in rs] for rs in together[::2]] == [[r.variables for r in rs] for rs in alone]
    assert small.stats().pinned_nodes == 0
