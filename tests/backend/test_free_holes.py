"""Free holes continued together (`hole_loop.FreeHoles`), greedy and sampled, give the values that each hole's
own loop (`HoleLoop.feed`, a row at a time) gives: holes that end on EOS, on their token limit, on max_len and on
stop rules, many queries at once, the trie on."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq
from lmq_backend.backend import hole_loop
from lmq_backend.backend.hf import HFBackend
from support.tiny import tiny_llama

SRC = '''{decoder}(max_len={max_len}{knobs})
"Item {{x}}:[A]" where len(TOKENS(A)) < 12
" then[B]" where STOPS_AT(B, "e") and len(TOKENS(B)) < 9
" and[C]" where STOPS_BEFORE(C, " ")
'''


@pytest.fixture(scope="module")
def models():
    """Tiny random Llamas whose EOS is picked often enough that some holes end on it: greedy (its logit scaled
    up 3x) and sampled (40x: a random model's distribution is nearly flat over 49,152 tokens)."""
    made = {}
    for decoder, scale in (("argmax", 3.0), ("sample", 40.0)):
        made[decoder] = model = tiny_llama(seed=3)
        with torch.no_grad():
            model.lm_head.weight[2] *= scale  # (id 2: the default tokenizer's EOS)
    return made


async def run_all(backend, max_len: int, n: int, decoder: str, knobs: str) -> list[dict]:
    query = lmq.Query(SRC.format(decoder=decoder, max_len=max_len, knobs=knobs), model=backend)
    results = await asyncio.gather(*(query.run({"x": f"{i} " * (i % 5)}) for i in range(n)))
    return [dict(r.variables, prompt=r.prompt) for r in results]


@pytest.mark.parametrize("max_len", [2048, 30])
@pytest.mark.parametrize("decoder,knobs", [("argmax", ""), ("sample", ", temperature=0.8, seed=5"),
                                           ("sample", ", temperature=1.2, top_p=0.9, seed=9")])
async def test_free_holes_together_give_each_holes_own_values(tokenizer, models, monkeypatch, max_len, decoder,
                                                              knobs):
    grouped = []
    call = hole_loop.FreeHoles.__call__

    def spy(self, logits, picks, members):
        grouped.append(len(members))
        return call(self, logits, picks, members)

    monkeypatch.setattr(hole_loop.FreeHoles, "__call__", spy)
    model = models[decoder]
    together = HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="together")
    alone = HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="alone")
    alone.free_holes = None  # (each hole's own loop)
    n = 24
    expected = await run_all(alone, max_len, n, decoder, knobs)
    assert not grouped
    got = await run_all(together, max_len, n, decoder, knobs)
    assert max(grouped) > 1  # the rows of a step were continued together
    assert got == expected
    ends = [len(tokenizer(r["A"], add_special_tokens=False).input_ids) for r in got]
    assert min(ends) < 11  # some holes ended on EOS (or max_len), before their limit
