"""Batch invariance on a CPU: with lmq's kernels everywhere (`LMQ_CPU_KERNELS=1`) a row's arithmetic does not
depend on what shares its batch, so every hole's first logits are the same bits whether the queries run one
by one or all at once with random arrivals (the trie on in both), and a seeded sampled query gives the same
values. Under calibration (the default) each op's kernel is chosen per class of batch shape, torch's or lmq's,
and a row's logits may move in their last bits with its batch (greedy tokens do not: see test_reference);
README, sampling."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lmq_backend as lmq
from lmq_backend.backend import hole_loop
from lmq_backend.backend.hf import HFBackend
from lmq_kernels import cpu

SRC = '''sample(temperature=1.0, seed=3)
"Item {x}: words[A]" where len(TOKENS(A)) < 8
" then more:[B]" where REGEX(B, r"[a-z ]{1,30}") and len(TOKENS(B)) < 8
" free:[C]" where len(TOKENS(C)) < 6'''


def inputs(i: int) -> dict:
    return {"x": "word " * (i % 5) + str(i)}


@pytest.fixture(scope="module")
def model():
    """Head dimension 64 (lmq's attention kernels take 64, 128, 256), small otherwise."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                        max_position_embeddings=4096)).eval()


@pytest.mark.cpu_kernels
async def test_a_rows_logits_do_not_depend_on_its_batch_with_lmqs_kernels(tokenizer, model, monkeypatch):
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert cpu.available(), cpu.build_error()
    first: dict[tuple[str, str], list[torch.Tensor]] = {}
    start = hole_loop.HoleLoop.start

    def spy(self, logits):
        first.setdefault((self.backend.name, self.seq.text), []).append(logits.clone())
        return start(self, logits)

    monkeypatch.setattr(hole_loop.HoleLoop, "start", spy)
    n = 24
    alone = lmq.Query(SRC, model=HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="alone"))
    expected = [(await alone.run(inputs(i))).variables for i in range(n)]

    together = lmq.Query(SRC, model=HFBackend.from_model(model, tokenizer, cache_budget="64MB", name="together"))
    rng = random.Random(2)

    async def one(i: int):
        for _ in range(rng.randint(0, 30)):
            await asyncio.sleep(0)
        return (await together.run(inputs(i))).variables

    assert await asyncio.gather(*(one(i) for i in range(n))) == expected
    compared = 0
    for (name, text), logits in first.items():
        if name == "together":
            for row in logits:
                assert torch.equal(row, first[("alone", text)][0]), text
                compared += 1
    assert compared >= 3 * n - 2  # every hole of every query (a value may end a query's holes early)
