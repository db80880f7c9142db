"""A checked pick (`backend/hole_loop.py`) proposes from the tokens that may extend a value, or, inside a UTF-8
character, from those that keep it well-formed (`VocabIndex.utf8_continuing`); the pick is the constrained one
only because that set holds every token the constraint allows: checked here for llguidance's REGEX, JSON and
GRAMMAR states within characters of 2, 3 and 4 bytes, and end to end (greedy tokens equal those of masks before
every pick)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import lmq_backend as lmq
from support.constraint_sim import call, compiled
from lmq_backend.backend.masks import Proposals
from lmq_backend.runtime.constraints.hole import HoleState
from lmq_backend.text.token_bytes import utf8_continues


def test_utf8_continues():
    assert utf8_continues(b"\xa9", 1) and utf8_continues(b"\xa9abc\xc3", 1) and utf8_continues(b"\x82\xac", 2)
    assert not utf8_continues(b"a", 1)              # a character where a continuation byte is expected
    assert not utf8_continues(b"\x82\xac", 1)       # one continuation byte too many
    assert not utf8_continues(b"\xa9\xc0", 1)       # C0 starts no character
    assert utf8_continues(b"\xe2\x82", 0) and not utf8_continues(b"\x82", 0)


@pytest.mark.parametrize("constraint", [
    call("REGEX", "X", r"[^\n]{1,60}"),
    call("REGEX", "X", r"(.|\n)*"),
    call("REGEX", "X", r"[é€😀a-z]+"),
    call("JSON", "X", {"type": "object", "properties": {"name": {"type": "string"}}}),
    call("GRAMMAR", "X", 'start: WORD+\nWORD: /[^ ]+/ " "?\n'),
], ids=["line", "any", "some", "json", "grammar"])
def test_what_a_constraint_allows_within_a_character_is_among_the_proposal(vocab, constraint):
    """After a lead byte of 2, 3, 4 bytes (and after some continuation bytes), every token llguidance allows
    keeps the text well-formed: the proposal's set holds the allowed one."""
    hc = compiled(constraint, vocab)
    opening = vocab.encode('{"name": "') if constraint.func == "JSON" else []
    checked = 0
    for char in ("é", "€", "😀"):
        raw = char.encode()
        for cut in range(1, len(raw)):  # the value ends inside the character, `len(raw) - cut` bytes to come
            state = hc.start()
            for t in opening + [int(vocab.ids_of(raw[i:i + 1])[0]) for i in range(cut)]:
                assert state.allows(t), (vocab.token_bytes[t], state.text)
                state.advance(t)
            allowed = state.allowed()
            assert allowed is not None and allowed.any()
            assert not (allowed & ~vocab.utf8_continuing(len(raw) - cut)).any(), (char, cut)
            checked += 1
    assert checked == 6


def test_a_rows_next_mask_on_the_device_is_the_hole_loops(vocab):
    """`Proposals.after` (how a step run ahead on the GPU picks a row's next token) moves a row between the
    masks as the hole loop does: by the UTF-8 bytes a token leaves pending, within the family of whether the
    value could end where the character began; every token (free holes) stays every token."""
    props = Proposals(vocab, ~vocab.special, None, torch.device("cpu"))
    index = {id(m): k for k, m in enumerate(props.masks)}
    assert len(index) == len(props.masks) == 9 and (props.after[0] == 0).all()
    tb = vocab.token_bytes
    ascii_ = [i for i in range(vocab.size) if tb[i] and tb[i].isascii()][:500]
    leaves = [i for i in range(vocab.size) if vocab.utf8_tables(0)[1][i] > 0]    # ends inside a character
    goes_on = np.flatnonzero(vocab.utf8_continuing(1) | vocab.utf8_continuing(2)).tolist()
    rng = np.random.default_rng(0)
    seen = set()
    for could_end in (False, True):
        pending = 0
        for _ in range(3000):
            t = int(rng.choice([ascii_, leaves, goes_on][rng.integers(3)]))
            k = index[id(props.mask(pending, could_end))]
            pending = int(vocab.utf8_tables(pending)[1][t])
            assert props.after[k, t] == index[id(props.mask(pending, could_end))]
            seen.add((k, pending))
    assert {p for _, p in seen} == {0, 1, 2, 3} and len({k for k, _ in seen}) == 8


SRC = '''"{x} in symbols:[S]" where REGEX(S, r"[é€😀ü]{3,8}") and len(TOKENS(S)) < 16'''


async def test_greedy_picks_within_characters_equal_those_under_masks(make_backend, monkeypatch):
    """Values of multi-byte characters, greedy: the tokens equal those of masks before every pick, and picks
    were proposed within characters."""
    inputs = [{"x": f"Line {i}" + " and more" * (i % 3)} for i in range(12)]
    proposals, proposal = [], Proposals.mask

    def count(self, pending, can_end):
        proposals.append(pending)
        return proposal(self, pending, can_end)
    monkeypatch.setattr(Proposals, "mask", count)
    backend = make_backend("llama")
    got = [r.variables for r in await asyncio.gather(*(lmq.Query(SRC, model=backend).run(x) for x in inputs))]
    assert any(proposals) and all(k in (0, 1, 2, 3) for k in proposals)
    monkeypatch.setattr(HoleState, "checks_tokens", property(lambda self: False))  # a mask before every pick
    reference = make_backend("llama", cache_budget=0)
    assert [(await lmq.Query(SRC, model=reference).run(x)).variables for x in inputs] == got
    assert all(set(v["S"]) <= set("é€😀ü") for v in got)
