"""Beam decoders (runtime/beam.py) checked by hand: a fake backend whose next-token probabilities are a
table, built so that greedy decoding, `beam`, `beam_var`, `var` and `best_k` each give different results;
the expected beams are worked out by hand in the comments, independently of the code.
"""
from __future__ import annotations

import asyncio
import math

import pytest

import lmq_backend as lmq
from lmq_backend.backend.protocol import Backend, NextTokens, Sequence
from lmq_backend.text.vocab_cache import vocab_index
from lmq_backend.errors import LMQLengthError, LMQRuntimeError


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

    async def extend(self, seq, text, literal=()):
        seq.ids += self._vocab.encode(text)
        seq.text += text
        if len(seq.ids) > seq.max_len:
            raise LMQLengthError(f"the prompt needs {len(seq.ids)} tokens, more than max_len={seq.max_len}")

    async def generate(self, seq, state, sampler):
        raise AssertionError("a beam decoder does not call generate")

    async def score(self, seq, options):
        raise AssertionError("not used")

    def release(self, seq):
        self.open.discard(id(seq))

    async def next_tokens(self, seq, tokens, k, allowed, can_end):
        self.calls += 1
        await asyncio.sleep(0)
        if len(seq.ids) + len(tokens) >= seq.max_len:  # the contract: ending is free there, if allowed
            if can_end:
                return NextTokens([], [], 0.0)
            raise LMQLengthError("past max_len")
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


def test_a_beam_past_max_len_ends_there(table):
    # max_len=5 tokens: "Q:" is 2, "|" 1. s2: bd .495, a+END .405 (at Y: 4 tokens). s3: bdw and bdx end X,
    # and "Q:bdw|" is 6 tokens: those beams end there; a|p .2025, a|q .162 go on. s4: 5 tokens, Y may end:
    # ending is free. Greedy (n=1) takes b, d, w and cannot go on.
    assert beams(run("beam(n=2, max_len=5)", table)) == [("a", "p", .2025), ("a", "q", .162)]
    with pytest.raises(LMQLengthError, match="max_len=5"):
        run("beam(n=1, max_len=5)", table)
    assert table.open == set()
