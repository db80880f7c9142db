"""The engine's fused decode path gives the same greedy tokens as the model's own forward (float32), alone and
batched: eager over the growable pool on the CPU, CUDA-graph captured on a GPU (`gpu` tests, skipped without CUDA;
CI has none: `pytest -m gpu` on the GPU machine)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq
from test_step_policy import SPREAD, SPREAD_ITEMS, run_spread

SRC = '''
"Some shared text to start with, {x}[A]" where len(TOKENS(A)) < 12
" and then[B]" where B in [" yes", " no"]
"{x} more[C]" where len(TOKENS(C)) < 20
'''


async def run_all(backend, n=6):
    q = lmq.Query(SRC, model=backend)
    return [r.variables for r in await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))]


def llama(device: str, hidden: int, layers: int, heads: int):
    """A random Llama (seed 0) of the default tokenizer's vocabulary, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, num_key_value_heads=2, max_position_embeddings=4096, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads)
    return LlamaForCausalLM(config).to(device).eval()


def ahead_and_plain(model, tokenizer):
    """Two backends of one model: one whose GPU steps pick on the device and run ahead, one whose device
    makes no picks (the host picks every token from the logits)."""
    ahead = lmq.HFBackend.from_model(model, tokenizer, name="ahead")
    plain = lmq.HFBackend.from_model(model, tokenizer, name="plain")
    plain.runner.set_greedy_masks(None)
    return ahead, plain


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_fused_decode_matches_the_model_forward(tokenizer, device):
    model = llama(device, 512, 4, 8) if device == "cuda" else llama(device, 128, 2, 4)
    fused = lmq.HFBackend.from_model(model, tokenizer, name="fused")
    assert fused.runner.fused
    plain = lmq.HFBackend.from_model(model, tokenizer, name="plain")
    plain.runner.fused = False
    alone = await run_all(plain, 1)
    assert await run_all(fused) == await run_all(plain)
    assert await run_all(fused, 1) == alone
    # the fused path decoded (every hole had more than one token to pick)
    assert fused.stats().tokens_decoded > 0
    # a repeated query finds each hole's prompt in the trie but its last token, a one-token prefill that
    # runs as a fused step
    steps = []
    fused.on_step(steps.append)
    prefilled = fused.stats().tokens_prefilled
    assert await run_all(fused, 1) == alone
    assert fused.stats().tokens_prefilled - prefilled == 3
    assert [s.new_tokens for s in steps if s.kind == "prefill"] == [1, 1, 1]


RUN_AHEAD = '''
"Once upon a time, {x}[A]" where len(TOKENS(A)) < 24
" so[B]" where STOPS_AT(B, ".") and len(TOKENS(B)) < 16
" Is it true?[C]" where C in [" yes", " no"]
"{x}[D]" where len(TOKENS(D)) < 10
" In one line:[E]" where REGEX(E, r"[^\\n]{1,80}") and len(TOKENS(E)) < 12
'''


@pytest.mark.gpu
async def test_run_ahead_steps_change_no_token(tokenizer):
    """On a GPU, greedy steps without a constraint mask run the next step ahead on the device's own pick;
    the host takes it only when its own pick and the batch agree. Concurrent queries that join, stop
    (STOPS_AT) and pick under constraints mid-way (a REGEX's picks checked against it, `picks.Checked`) give
    the same tokens as without running ahead, and most steps were taken from a run-ahead."""
    ahead, plain = ahead_and_plain(llama("cuda", 512, 4, 8), tokenizer)
    q_ahead, q_plain = lmq.Query(RUN_AHEAD, model=ahead), lmq.Query(RUN_AHEAD, model=plain)

    async def late(q, i):
        await asyncio.sleep(0.002 * (i % 3))  # arrive at different steps
        return (await q.run({"x": "word " * i})).variables

    for n in (1, 5):
        want = await asyncio.gather(*(late(q_plain, i) for i in range(n)))
        assert await asyncio.gather(*(late(q_ahead, i) for i in range(n))) == want
    decoder = ahead.runner._decoder[0]
    assert decoder.took_ahead > 0 and decoder.took_ahead >= decoder.ran_ahead // 2
    assert plain.runner._decoder[0].ran_ahead == 0


@pytest.mark.gpu
async def test_rows_that_leave_while_a_step_runs_ahead_change_no_token(tokenizer, monkeypatch):
    """40 holes of 3-22 tokens (fewer where one stops) at once: rows leave at many steps, and stay in the
    batch (fed any token) while the device runs a step ahead; the tokens are those without running ahead,
    and steps were taken from a run-ahead with rows that left in them."""
    ahead, plain = ahead_and_plain(llama("cuda", 512, 4, 8), tokenizer)
    want = [r.variables for r in await asyncio.gather(*(lmq.Query(SPREAD, model=plain).run(x) for x in SPREAD_ITEMS))]
    got, steps = await run_spread(ahead, monkeypatch)
    assert got == want
    decoder = ahead.runner._decoder[0]
    assert max(left for left, _ in steps) >= 2 and decoder.took_ahead >= decoder.ran_ahead // 2
    assert ahead.scheduler.pool.rows == 0 and ahead.trie.pinned_nodes() == 0


SAMPLED = '''sample(n=3, temperature=0.9, seed=5)
"Tell me about {x}:[A]" where len(TOKENS(A)) < 10
" so[B]" where B in [" yes", " no"]
'''
GREEDY = '"Tell me about {x}:[A]" where len(TOKENS(A)) < 14'


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_sampled_rows_beside_greedy_rows_draw_what_they_draw_alone(tokenizer, device):
    """Seeded sampling rows and greedy rows (which run steps ahead on the device while they are alone) in
    one batch, float32: every query gets the values it gets alone; the steps sampled their rows together.
    (No top_p here: a random model's flat distribution puts thousands of near-ties at a nucleus's edge, where
    the last bits of a logit, which the cache may change, decide which tokens are in it. For the same reason
    the LM head is scaled up to a trained model's peaked distributions: on a GPU cuBLAS picks its GEMM kernels
    by the number of rows, so a row's logits may differ in their last bits batched and alone, and on a random
    model's flat distribution, where a token's share of the cumulative mass is ~1e-5, that moves a sample.)"""
    model = llama(device, 256, 2, 4)
    model.lm_head.weight.data *= 10
    backend = lmq.HFBackend.from_model(model, tokenizer, name="mixed")
    assert backend.runner.fused
    sampled, greedy = lmq.Query(SAMPLED, model=backend), lmq.Query(GREEDY, model=backend)
    words = ["cats", "the sea", "old maps", "tea"]
    alone = [[r.variables for r in await sampled.run({"x": w})] for w in words]
    alone += [(await greedy.run({"x": w})).variables for w in words]
    steps = []
    backend.on_step(steps.append)
    together = await asyncio.gather(*(sampled.run({"x": w}) for w in words), *(greedy.run({"x": w}) for w in words))
    assert [[r.variables for r in rs] for rs in together[:4]] + [r.variables for r in together[4:]] == alone
    assert len({tuple(r.variables.items()) for rs in together[:4] for r in rs}) > 4  # the draws differ
    assert max(s.batch_size for s in steps if s.kind == "decode") > 8


@pytest.mark.gpu
async def test_sampled_steps_run_ahead_and_sample_as_the_host_does(tokenizer):
    """On a GPU, a step samples its rows on the device too (under the device's masks, without a nucleus)
    and runs the next step ahead on those samples, at each row's next uniform. Against a backend whose
    device makes no picks (the host samples every row from the logits): the same values, float32, for
    sampled and greedy queries arriving at different steps; most steps were taken from a run-ahead."""
    ahead, plain = ahead_and_plain(llama("cuda", 256, 2, 4), tokenizer)
    src = 'sample(n=2, temperature=0.7, seed=3)\n"Once upon a time, {x}[A]" where len(TOKENS(A)) < 20\n'

    async def late(backend, i):
        await asyncio.sleep(0.002 * (i % 3))  # arrive at different steps
        if i % 4 == 3:
            return (await lmq.Query(GREEDY, model=backend).run({"x": "word " * i})).variables
        return [r.variables for r in await lmq.Query(src, model=backend).run({"x": "word " * i})]

    want = await asyncio.gather(*(late(plain, i) for i in range(8)))
    assert await asyncio.gather(*(late(ahead, i) for i in range(8))) == want
    decoder = ahead.runner._decoder[0]
    assert any(sampling for _, _, sampling in decoder.graphs)
    assert decoder.took_ahead > 0 and decoder.took_ahead >= decoder.ran_ahead // 2


@pytest.mark.gpu
async def test_steps_run_ahead_pick_within_characters_under_the_masks_the_host_moves_to(tokenizer, monkeypatch):
    """Sampled REGEX values (checked picks): a row's mask changes where a token begins or ends a UTF-8
    character; the device moves it as the host does (`Proposals.after`), so a step run ahead samples under
    the next one. Against a backend whose device makes no picks: the same values, float32; most steps were
    taken from a run-ahead, some with rows inside a character."""
    from lmq_backend.engine.fused import FusedDecoder

    ahead, plain = ahead_and_plain(llama("cuda", 256, 2, 4), tokenizer)
    src = 'sample(temperature=1.0, seed=4)\n"{x}:[S]" where REGEX(S, r"[^\\n]{1,200}") and len(TOKENS(S)) < 32\n'
    inputs = [{"x": f"Line {i}" + " and more" * (i % 3)} for i in range(64)]
    want = [r.variables for r in await asyncio.gather(*(lmq.Query(src, model=plain).run(x) for x in inputs))]
    taken, take = [], FusedDecoder._take_ahead

    def record(self, *args):
        ok = take(self, *args)
        if ok:
            taken.append(set(self.picks.table()[-1][:self.picks.rows]))  # the masks it picked under
        return ok
    monkeypatch.setattr(FusedDecoder, "_take_ahead", record)
    got = [r.variables for r in await asyncio.gather(*(lmq.Query(src, model=ahead).run(x) for x in inputs))]
    assert got == want
    decoder = ahead.runner._decoder[0]
    assert decoder.took_ahead >= decoder.ran_ahead // 2 > 0
    inside = [m for family in ahead.masks.proposals.families.values() for m in family[1:]]  # continuing 1-3 bytes
    within = {k for k, g in enumerate(ahead.masks.greedy) if any(g is m for m in inside)}
    assert any(masks & within for masks in taken)


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each of the engine's Triton kernels holds (on the current GPU)."""
    from lmq_kernels.triton.ops import _rmsnorm_kernel, _rope_append_kernel, _silu_mul_kernel
    from lmq_kernels.triton.decode_attention import _decode_stage1
    from lmq_kernels.triton.masked_argmax import _combine_kernel, _masked_argmax_kernel
    from lmq_kernels.triton.prefill_attention import _prefill_kernel
    from lmq_kernels.triton.sample_rows import _first_crossing, _split_search, _split_sums

    jitted = [_rmsnorm_kernel, _silu_mul_kernel, _rope_append_kernel, _prefill_kernel, _decode_stage1,
              _masked_argmax_kernel, _combine_kernel, _split_sums, _split_search, _first_crossing]
    device = torch.cuda.current_device()
    return {fn.__name__: len(fn.device_caches[device][0]) for fn in jitted}  # (triton 3.x: kernel cache first)


@pytest.mark.gpu
async def test_new_prompt_lengths_and_batch_sizes_compile_no_kernel_again(tokenizer):
    """Triton compiles a kernel again (seconds, a stall of every query) when an int argument or a pointer's
    16-byte alignment changes: prompts of every length and prefills of 1-6 rows use the kernels the first
    queries compiled."""
    backend = lmq.HFBackend.from_model(llama("cuda", 256, 2, 4), tokenizer, name="variants")
    q = lmq.Query('"{x} and[A]" where len(TOKENS(A)) < 4', model=backend)
    await asyncio.gather(*(q.run({"x": f"warm {i}"}) for i in range(3)))  # prefill and decode of a few rows
    before = compiled_variants()
    for rows in range(1, 7):  # every prefill length from 1 to 40 new tokens, odd and even, 1 to 6 rows at once
        await asyncio.gather(*(q.run({"x": f"r{rows} " + "w " * (rows * 7 + i)}) for i in range(rows)))
    await q.run({"x": "long " * 1500})
    await asyncio.gather(*(q.run({"x": f"after {i}"}) for i in range(5)))
    sampled = lmq.Query('sample(n=3, temperature=0.8, seed=1)\n"{x} and[A]" where len(TOKENS(A)) < 4', model=backend)
    await sampled.run({"x": "warm"})
    before.update({k: v for k, v in compiled_variants().items() if k.startswith(("_split", "_first"))})
    await asyncio.gather(*(sampled.run({"x": "s " * i}) for i in range(1, 6)))
    assert compiled_variants() == before
