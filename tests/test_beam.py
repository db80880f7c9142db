"""Beam decoders (runtime/beam.py): `beam(n)`, `beam_var(n)`, `var(b, n)`, `best_k(k, budget, ...)`.

- Hand-checked cases on a fake backend whose next-token probabilities are a table, built so that greedy,
  `beam`, `beam_var` and `var` each give different results (the expected beams are worked out by hand in
  the comments, independently of the code).
- On a tiny random model: `beam(n=1)` gives `argmax`'s tokens under every kind of constraint; its score is
  the sum of the model's log-probabilities of the value (an independent `score_tokens` call); the beams
  and scores are the same with the cache on or off, and for a query alone or many at once.
- Bad arguments are compile errors; no pin is left in the trie.
"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

import lmq_backend as lmq
from lmq_backend.backend import registry
from lmq_backend.backend.protocol import Backend, NextTokens, Sequence
from lmq_backend.backend.vocab_cache import vocab_index
from lmq_backend.cli import main
from lmq_backend.errors import LMQCompileError, LMQNotSupportedError, LMQRuntimeError
from lmq_backend.runtime.decoders import DecoderSpec

# ----- a backend whose probabilities are a table ------------------------------------------------------

# context (all text so far) -> {next token's text or "END" (the end-of-sequence token): probability}.
# Letters are single tokens of the default tokenizer. X has at most 3 tokens, Y at most 2.
TABLE = {
    "Q:": {"b": .55, "a": .45},
    "Q:b": {"d": .9, "e": .1},
    "Q:a": {"END": .9, "z": .1},
    "Q:bd": {"w": .5, "x": .45},
    "Q:be": {"w": .9},
    "Q:az": {"END": 1.0},
    "Q:az|": {"p": 1.0},
    "Q:az|p": {"s": 1.0},
    "Q:|": {"p": 1.0},
    "Q:|p": {"s": 1.0},
    "Q:a|": {"p": .5, "q": .4},
    "Q:a|p": {"s": .9},
    "Q:a|q": {"s": .9},
    "Q:bdw|": {"u": .3, "v": .2},
    "Q:bdx|": {"u": .3, "v": .2},
    "Q:bdw|u": {"s": .5},
    "Q:bdw|v": {"s": .5},
    "Q:bdx|u": {"s": .5},
    "Q:bdx|v": {"s": .5},
}
TWO_HOLES = '"Q:[X]|[Y]" where len(TOKENS(X)) < 4 and len(TOKENS(Y)) < 3'


class TableBackend(Backend):
    """Next-token probabilities from TABLE; implements what beam decoders call."""

    name = "table"

    def __init__(self, tokenizer):
        self._vocab = vocab_index(tokenizer, len(tokenizer))
        self.eos = tokenizer.eos_token_id
        self.calls = 0
        self.open: set[int] = set()

    @property
    def vocab(self):
        return self._vocab

    def sequence(self, template, max_len=None):
        seq = Sequence(template, max_len=max_len or 2048)
        self.open.add(id(seq))
        return seq

    def fork(self, seq):
        copy = super().fork(seq)
        self.open.add(id(copy))
        return copy

    async def extend(self, seq, text):
        seq.ids += self._vocab.encode(text)
        seq.text += text

    async def generate(self, seq, state, sampler):
        raise AssertionError("a beam decoder does not call generate")

    async def score(self, seq, options):
        raise AssertionError("not used")

    def release(self, seq):
        self.open.discard(id(seq))

    async def next_tokens(self, seq, tokens, k, allowed, can_end):
        self.calls += 1
        await asyncio.sleep(0)
        context = seq.text + "".join(self._vocab.token_bytes[t].decode() for t in tokens)
        table = TABLE[context]
        ids = {text: self.eos if text == "END" else self._vocab.encode(text)[0] for text in table}
        extends = {t for t in table if t != "END" and (allowed is None or allowed[ids[t]])}
        top = sorted(((math.log(table[t]), ids[t]) for t in extends), reverse=True)[:k]
        # ending: the most likely token that cannot extend the value (END, or one the mask excludes)
        ends = [math.log(p) for t, p in table.items() if t not in extends]
        return NextTokens([i for _, i in top], [lp for lp, _ in top], max(ends) if can_end and ends else None)


@pytest.fixture
def table(tokenizer):
    return TableBackend(tokenizer)


def run(decoder: str, backend, body: str = TWO_HOLES):
    return asyncio.run(lmq.compile(f"{decoder}\n    {body}\n", model=backend)())


def beams(results) -> list[tuple[str, str, float]]:
    return [(r["X"], r["Y"], round(math.exp(r.score), 8)) for r in results]


def test_beam_one_is_greedy_by_hand(table):
    # greedy: X = b (.55) d (.9) w (.5) -> 3 tokens, stops; Y = u (.3) s (.5) -> .55*.9*.5*.3*.5
    assert beams(run("beam(n=1)", table)) == [("bdw", "us", round(.55 * .9 * .5 * .3 * .5, 8))]
    assert table.open == set()  # every sequence released


def test_beam_by_hand(table):
    # n=2. step 1: b .55, a .45. step 2: bd .495, a+END .405 (a is done: the beam moves to Y), be .055 and
    # az .045 are cut. step 3: bdw .2475, bdx .22275 (both end X: 3 tokens), a|p .2025, a|q .162: the two
    # X continuations win, `a` is gone. step 4: bdw|u .07425, bdx|u .066825 (bdw|v .0495, bdx|v .04455 cut).
    # step 5: s ends both Y values (2 tokens).
    assert beams(run("beam(n=2)", table)) == [("bdw", "us", round(.2475 * .3 * .5, 8)),
                                              ("bdx", "us", round(.22275 * .3 * .5, 8))]


def test_beam_var_by_hand(table):
    # n=2, X first, on its own: step 1 b .55, a .45; step 2 bd .495 and be .055 stay live, a+END .405 is a
    # value, az .045 is cut; step 3 bdw .2475 ends X, bdx .22275 cannot beat the 2 values, bew .0495 neither:
    # X values a .405, bdw .2475. Y from both: a|p .2025, a|q .162 (bdw|u .07425 is cut), then s: .18225, .1458.
    assert beams(run("beam_var(n=2)", table)) == [("a", "ps", round(.405 * .5 * .9, 8)),
                                                  ("a", "qs", round(.405 * .4 * .9, 8))]
    # n=1 is greedy per variable: X = bdw (b, d, w), then Y = us
    assert beams(run("beam_var(n=1)", table)) == [("bdw", "us", round(.55 * .9 * .5 * .3 * .5, 8))]


def test_var_by_hand(table):
    # b=2: X searched with 2 beams as in beam_var: a .405, bdw .2475; n=1 keeps a. Y from a with 2 beams: ps, qs.
    assert beams(run("var(b=2, n=1)", table)) == [("a", "ps", round(.405 * .5 * .9, 8))]
    # n=3 keeps both X values; each searches Y on its own with 2 beams: a -> ps .18225, qs .1458;
    # bdw -> us .037125, vs .02475; the 3 best of the 4
    assert beams(run("var(b=2, n=3)", table)) == [("a", "ps", round(.405 * .5 * .9, 8)),
                                                  ("a", "qs", round(.405 * .4 * .9, 8)),
                                                  ("bdw", "us", round(.2475 * .3 * .5, 8))]
    assert table.open == set()


def test_best_k_by_hand(table):
    # best-first, one entry expanded a step, its 2 best choices kept; priority = log p / choices ** 0.7
    # (kappa=0: no ageing). Expanded in turn: root; b (-.598); bd (-.433); bdw| (-.647: X ended, at Y);
    # bdx| (-.696); a (-.799); a| (-.556); a|p (-.740) -> a|ps done (.18225), the budget of 6 is spent but the
    # search goes on until a result; budget 9: then a|q (-.844) -> a|qs (.1458); every finished beam returned
    options = "k=1, top_k_continuations=2, kappa=0"
    assert beams(run(f"best_k({options}, budget=6)", table)) == [("a", "ps", round(.405 * .5 * .9, 8))]
    assert beams(run(f"best_k({options}, budget=9)", table)) == [("a", "ps", round(.405 * .5 * .9, 8)),
                                                                ("a", "qs", round(.405 * .4 * .9, 8))]
    # gamma=0.35 keeps no choice less likely: not e (.1), nor u (.3), v (.2) after bdw| and bdx|, nor z (.1);
    # the heap runs out after a|ps and a|qs (the budget of 30 is not reached)
    assert beams(run(f"best_k({options}, gamma=0.35)", table)) == [("a", "ps", round(.405 * .5 * .9, 8)),
                                                                  ("a", "qs", round(.405 * .4 * .9, 8))]
    # with LMQL's ageing (kappa=1, beta=0.5) the freshest entries win: b, bd, bdw|, bdw|u -> greedy's result
    assert beams(run("best_k(k=1, top_k_continuations=2, budget=3)", table)) == [
        ("bdw", "us", round(.55 * .9 * .5 * .3 * .5, 8))]
    assert table.open == set()
    with pytest.raises(LMQRuntimeError, match="best_k finished no beam: its heap ran out"):
        run("best_k(k=1, gamma=0.95)", table)


def test_constraint_masks_apply_to_beams(table):
    # X in ["a", "az"]: step 1 only a (.45: b is masked); step 2 a+END .405 (a value: the beam goes to Y),
    # az .045; step 3 a|p .2025, a|q .162, az+END .045 (no token extends az: ending is free) is cut;
    # step 4 s: .18225, .1458
    body = '"Q:[X]|[Y]" where X in ["a", "az"] and len(TOKENS(Y)) < 3'
    got = beams(run("beam(n=2)", table, body))
    assert got == [("a", "ps", round(.405 * .5 * .9, 8)), ("a", "qs", round(.405 * .4 * .9, 8))]
    # not "b" in X: at the start, ending X (empty) scores as the most likely token that cannot extend it,
    # b (.55), as greedy decoding ends it; a (.45) goes on. Then: |p .55 (live), a+END .405 (to Y);
    # |ps .55 is done, a|p .2025, a|q .162 live; a|ps .18225 done; a|qs .1458 cannot beat it.
    body = '"Q:[X]|[Y]" where not "b" in X and len(TOKENS(X)) < 4 and len(TOKENS(Y)) < 3'
    assert beams(run("beam(n=2)", table, body)) == [("", "ps", .55), ("a", "ps", round(.405 * .5 * .9, 8))]


# ----- a tiny random model ---------------------------------------------------------------------------

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
    ('best_k(k=2, budget=8, gamma=0)', '"Q: {x}\\nA:[A]" where len(TOKENS(A)) < 4\n    "\\nB:[B]" where len(TOKENS(B)) < 3'),
    ('var(b=2, n=3)', '"Q: {x}\\nA:[A]" where STOPS_AT(A, "a") and len(TOKENS(A)) < 5\n    "\\nB:[B]" where INT(B) and len(TOKENS(B)) < 3'),
]


@pytest.mark.parametrize("decoder,body", BEAM_QUERIES)
def test_beams_cache_on_off_batched_alone(make_backend, decoder, body):
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
