"""A model's context window (`max_position_embeddings`) bounds every query on it: no position at or past it is
ever computed (GPT-2's learned positions have no row there; RoPE models would extrapolate silently).

On Llama-, Qwen2- and GPT-2-shaped tiny models with a window of 64 positions, batched with ordinary queries:
a prompt longer than the window, a hole that cannot close within it (its constraint needs more tokens) and a
distribution whose options pass it each fail with an LMQLengthError naming the window; a free hole that
reaches it ends there, as at `max_len` (the README's contract: `max_len`, capped by the window, bounds the
whole prompt); `argmax(max_len=...)` above the window is capped by it. The other queries of the batch give
what they give alone, and no row, slot or pin is left held."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lmq_backend as lmq
from support.caches import node_slots

WINDOW = 64


def windowed(family: str):
    """A tiny random model of `family` whose context window is WINDOW positions (the default tokenizer's
    vocabulary)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=WINDOW)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).eval()
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=WINDOW,
                                      bos_token_id=0, eos_token_id=2)).eval()


ORDINARY = '"Say {x}:[A]" where len(TOKENS(A)) < 6'
LONG_PROMPT = '"{x}[A]" where len(TOKENS(A)) < 4'
FREE_HOLE = '"{x}[A]" where len(TOKENS(A)) < 100'
CANNOT_CLOSE = '"{x}[A]" where A in ["' + " zebra" * 80 + '"]'
DISTRIBUTION = '"{x}[A]"\ndistribution A in [" yes", "' + " no" * 40 + '"]'
WORDS = " alpha river stone cloud seven green table quiet north apple"


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
async def test_the_window_bounds_every_query_and_the_others_are_unaffected(tokenizer, family):
    backend = lmq.HFBackend.from_model(windowed(family), tokenizer, cache_budget="64MB", name=f"window-{family}")
    assert backend.max_positions == WINDOW
    ordinary = [{"x": w} for w in WORDS.split()[:6]]
    alone = [(await lmq.Query(ORDINARY, model=backend).run(x)).variables for x in ordinary]

    long_text = WORDS * 8                                   # ~80 tokens
    near = WORDS * 4                                        # ~40 tokens: holes that go on from there
    assert tokens(tokenizer, long_text) > WINDOW and tokens(tokenizer, near) < WINDOW - 8
    lengths, computed = [], []  # released sequences' lengths; prefilled rows' cached + new tokens
    release, prefill = backend.release, backend.runner.prefill

    def spy(seq):
        lengths.append(len(seq.ids))
        release(seq)

    def prefill_spy(pool, rows, *args, **kwargs):
        computed.extend(r.cached + len(r.ids) for r in rows)
        return prefill(pool, rows, *args, **kwargs)

    backend.release, backend.runner.prefill = spy, prefill_spy
    try:
        jobs = [lmq.Query(ORDINARY, model=backend).run(x) for x in ordinary[:3]]
        jobs += [lmq.Query(LONG_PROMPT, model=backend).run({"x": long_text}),
                 lmq.Query(FREE_HOLE, model=backend).run({"x": near}),
                 lmq.Query(CANNOT_CLOSE, model=backend).run({"x": near}),
                 lmq.Query(DISTRIBUTION, model=backend).run({"x": near}),
                 lmq.Query("argmax(max_len=100000)\n" + FREE_HOLE, model=backend).run({"x": near})]
        jobs += [lmq.Query(ORDINARY, model=backend).run(x) for x in ordinary[3:]]
        got = await asyncio.gather(*jobs, return_exceptions=True)
    finally:
        del backend.release, backend.runner.prefill

    ok = got[:3] + got[8:]
    assert [r.variables for r in ok] == alone                # the batch's other queries: as alone
    too_long, free, cannot, dist, capped = got[3:8]
    for error in (too_long, cannot, dist):
        assert isinstance(error, lmq.LMQLengthError), error
        assert str(WINDOW) in str(error) and "max_position_embeddings" in str(error), str(error)
    for r in (free, capped):                                 # a free hole ends at the window
        assert not isinstance(r, BaseException), r
        assert tokens(tokenizer, near) + tokens(tokenizer, r.variables["A"]) >= WINDOW - 2
    # no position at or past the window computed: the too long prompt was never prefilled, no row went past
    assert max(computed) <= WINDOW and [n for n in lengths if n > WINDOW] == [tokens(tokenizer, long_text)]
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0 and not backend.scheduler.waiting
    backend.store.check(node_slots(backend.trie), [])
