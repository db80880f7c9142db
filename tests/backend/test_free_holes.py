"""Free greedy holes continued together (`hole_loop.FreeHoles`) give the values that each hole's own loop
(`HoleLoop.feed`, a row at a time) gives: holes that end on EOS, on their token limit, on max_len and on stop
rules, many queries at once, the trie on."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq
from lmq_backend.backend import hole_loop
from lmq_backend.backend.hf import HFBackend
from support.tiny import tiny_llama

SRC = '''argmax(max_len={max_len})
"Item {{x}}:[A]" where len(TOKENS(A)) < 12
" then[B]" where STOPS_AT(B, "e") and len(TOKENS(B)) < 9
" and[C]" where STOPS_BEFORE(C, " ")
'''


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama whose EOS is the greedy pick often enough that some holes end on it."""
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.lm_head.weight[2] *= 3.0  # (id 2: the default tokenizer's EOS)
    return model


async def run_all(backend, max_len: int, n: int) -> list[dict]:
    query = lmq.Query(SRC.format(max_len=max_len), model=backend)
    results = await asyncio.gather(*(query.run({"x": f"{i} " * (i % 5)}) for i in range(n)))
    return [dict(r.variables, prompt=r.prompt) for r in results]


@pytest.mark.parametrize("max_len", [2048, 30])
async def test_free_holes_together_give_each_holes_own_values(tokenizer, model, monkeypatch, max_len):
    grouped = []
    call = hole_loop.FreeHoles.__call__

    def spy(self, logits, picks, members):
        grouped.append(len(members))
        return call(self, logits, picks, members)

    monkeypatch.setattr(hole_loop.FreeHoles, "__call__", spy)
    together = HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="together")
    alone = HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="alone")
    alone.free_holes = None  # (each hole's own loop)
    n = 24
    expected = await run_all(alone, max_len, n)
    assert not grouped
    got = await run_all(together, max_len, n)
    assert max(grouped) > 1  # the rows of a step were continued together
    assert got == expected
    ends = [len(tokenizer(r["A"], add_special_tokens=False).input_ids) for r in got]
    assert min(ends) < 11  # some holes ended on EOS (or max_len), before their limit
