"""The fused prefill (`FusedDecoder.prefill`: the decode step's layer loop over many new tokens per row) against
the Hugging Face forward of each whole row from scratch.

CPU (float32, torch ops): tiny Llama / Qwen2 / Qwen3 models; rows whose cached K/V are already in the pool,
left-padded new parts of different lengths, at a slot offset; last-token logits and every K/V column must
match, and nothing outside the rows' new columns may be written. The engine gives the same query results
with the fused prefill on and off.

GPU (`gpu` tests, skipped without CUDA): bf16 logits against HF, and a 2,050-token prompt
on a Llama-3.2-1B-shaped float32 model gives HF `generate`'s greedy tokens through the whole engine.
"""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from support.fused import llama_1b_shaped, make_pool, tiny_llama, tiny_qwen2, tiny_qwen3
from support.hole_states import Record

import lmq_backend as lmq
from lmq_backend.engine import compat
from lmq_backend.engine.fused import FusedDecoder
from support.caches import paged_view



@torch.inference_mode()
def hf_whole(model, ids):
    """HF's forward of one whole row from scratch: (last logits [V], per layer (K, V) [H_kv, n, D])."""
    dev = next(model.parameters()).device
    n = len(ids)
    logits, cache = compat.forward(model, torch.tensor([ids], device=dev), None, torch.arange(n, device=dev)[None],
                                   compat.make_cache(None))
    return logits[0, -1], [(k[0], v[0]) for k, v in compat.cache_layers(cache)]


def run_prefill(model, rows, *, slot=0, end=None, capacity=64, slots=None, atol=1e-4, kv_atol=1e-5, pool=None,
                dec=None):
    """rows: (whole token list, cached count). The cached K/V come from HF's whole-row forward, the rest from
    the fused prefill; both are compared with HF's whole-row forward. Returns (fused, HF) logits [B, V].
    `pool`, `dec`: a dense pool and a decoder over it to use (else new ones, without CUDA graphs)."""
    slots = slots or slot + len(rows)
    pool = make_pool(model, slots, capacity) if pool is None else pool
    end = end or max(len(ids) for ids, _ in rows) + 2
    first = min(end - len(ids) for ids, _ in rows)
    pool[:, :, slot:slot + len(rows), :, first:end] = 0   # the pool's invariant: finite from the first column
    refs = []
    for b, (ids, cached) in enumerate(rows):
        logits, kv = hf_whole(model, ids)
        refs.append((logits, kv))
        for l, (k, v) in enumerate(kv):
            pool[l, 0, slot + b, :, end - len(ids):end - len(ids) + cached] = k[:, :cached]
            pool[l, 1, slot + b, :, end - len(ids):end - len(ids) + cached] = v[:, :cached]
    before = pool.clone()
    dec = dec or FusedDecoder(model, *paged_view(pool), max_batch=slots, use_graphs=False)
    got = dec.prefill([(ids[cached:], cached) for ids, cached in rows], slot, end).float()
    want = torch.stack([logits for logits, _ in refs]).float()
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    written = torch.zeros(pool.shape[2], pool.shape[4], dtype=torch.bool)
    for b, ((ids, cached), (_, kv)) in enumerate(zip(rows, refs)):
        lo = end - len(ids) + cached
        written[slot + b, lo:end] = True
        for l, (k, v) in enumerate(kv):
            torch.testing.assert_close(pool[l, 0, slot + b, :, lo:end].float(), k[:, cached:].float(), atol=kv_atol, rtol=0)
            torch.testing.assert_close(pool[l, 1, slot + b, :, lo:end].float(), v[:, cached:].float(), atol=kv_atol, rtol=0)
    # every other column of every slot (padding, cached parts, other rows, past `end`) is as it was
    keep = ~written.to(pool.device)[None, None, :, None, :, None].expand_as(pool)
    assert torch.equal(pool[keep].nan_to_num(7.0), before[keep].nan_to_num(7.0))
    return got, want


def _ids(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = {
    "one row, nothing cached": [(_ids(9, 1), 0)],
    "one row after a cache hit": [(_ids(9, 2), 4)],
    "equal rows": [(_ids(8, 3), 3), (_ids(8, 4), 3)],
    "equal new parts, different cached": [(_ids(10, 5), 6), (_ids(6, 6), 2)],
    "left-padded, ragged": [(_ids(7, 7), 0), (_ids(9, 8), 6), (_ids(14, 9), 2), (_ids(2, 10), 1)],
}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_qwen3], ids=["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cpu_prefill_matches_hf(make, case):
    run_prefill(make(), CASES[case])


def test_cpu_prefill_at_a_slot_offset_and_llama3_rope():
    model = tiny_llama(seed=6, rope_scaling=True)
    run_prefill(model, CASES["left-padded, ragged"], slot=2, slots=7, end=40, capacity=48)


def test_cpu_prefill_rejects_what_does_not_fit():
    model = tiny_llama()
    dec = FusedDecoder(model, *paged_view(make_pool(model, 2, 16)), max_batch=2, use_graphs=False)
    with pytest.raises(ValueError):
        dec.prefill([([1, 2], 0), ([3], 0)], 1, 10)   # slots 1 and 2 of a 2-slot pool
    with pytest.raises(ValueError):
        dec.prefill([([1, 2, 3], 0)], 0, 17)          # past the pool's columns
    with pytest.raises(ValueError):
        dec.prefill([([], 4)], 0, 10)                 # nothing new


SRC = '''
"Some shared text to start with, {x}[A]" where len(TOKENS(A)) < 10
" and then[B]" where B in [" yes", " no"]
"{x} more[C]" where len(TOKENS(C)) < 12
'''


async def test_engine_same_results_with_the_fused_prefill(tokenizer):
    """The engine's prefills through the fused layer loop (the default) give the same query results as
    through the model's forward, batched and alone, with trie hits (the queries share their start)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, num_key_value_heads=2, max_position_embeddings=4096, hidden_size=128,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(config).eval()
    fused = lmq.HFBackend.from_model(model, tokenizer, name="fused-prefill")
    assert fused.runner.fused_prefill  # the default, on the CPU too
    plain = lmq.HFBackend.from_model(model, tokenizer, name="model-prefill")
    plain.runner.fused_prefill = False

    async def run_all(backend, n):
        q = lmq.Query(SRC, model=backend)
        return [r.variables for r in await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))]

    for n in (1, 5):
        assert await run_all(fused, n) == await run_all(plain, n)
    assert fused.stats().tokens_prefilled == plain.stats().tokens_prefilled > 0


# ------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
def test_cuda_bf16_prefill_close_to_hf():
    """bf16 fused prefill vs bf16 HF, both against HF's float32 forward: within 1.5x HF bf16's own error
    (+ 0.01) on the logits."""
    model = llama_1b_shaped(layers=4, dtype=torch.float32)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    rows = [(_ids(300, 11), 120), (_ids(181, 12), 0), (_ids(250, 13), 249)]
    errs_hf, errs_f = [], []
    for ids, cached in rows:
        ref, _ = hf_whole(model, ids)
        got16, _ = run_prefill(model16, [(ids, cached)], capacity=512, atol=10, kv_atol=10)
        hf16, _ = hf_whole(model16, ids)
        errs_hf.append((hf16.float() - ref.float()).abs().max().item())
        errs_f.append((got16[0] - ref.float()).abs().max().item())
    got16, _ = run_prefill(model16, rows, capacity=512, atol=10, kv_atol=10)   # batched, padded
    errs_f.append(max((got16[b] - hf_whole(model, ids)[0].float()).abs().max().item() for b, (ids, _) in enumerate(rows)))
    print(f"bf16 max |logit - fp32 HF|: HF {max(errs_hf):.4f}, fused prefill {max(errs_f):.4f}")
    assert max(errs_f) <= 1.5 * max(errs_hf) + 0.01


@pytest.mark.gpu
def test_cuda_fp32_prefill_matches_hf():
    model = llama_1b_shaped(layers=4, dtype=torch.float32)
    run_prefill(model, [(_ids(300, 21), 120), (_ids(181, 22), 0), (_ids(250, 23), 249)], capacity=512,
                atol=2e-3, kv_atol=2e-3)


@pytest.mark.gpu
def test_cuda_small_prefills_replay_captured_graphs():
    """Small prefills replay a CUDA graph per bucket of rows and new tokens: float32 logits and K/V match HF's
    whole-row forward at a bucket's first prefill (its capture) and at a later one with other rows, slots, new
    lengths, cached prefixes and end (a replay), nothing else in the pool is written; a prefill of more new
    tokens than a bucket holds runs eagerly, just as right."""
    from lmq_backend.engine.fused.prefill import GRAPH_TOKENS

    model = llama_1b_shaped(layers=4, dtype=torch.float32)
    pool = make_pool(model, 8, 1400)
    dec = FusedDecoder(model, *paged_view(pool), max_batch=8, use_graphs=True)
    kw = dict(pool=pool, dec=dec, capacity=1400, atol=2e-3, kv_atol=2e-3)
    run_prefill(model, [(_ids(1120, 41), 1100), (_ids(1115, 42), 1100), (_ids(40, 43), 10)], slot=0, end=1130, **kw)
    assert dec.prefill_buckets == {(4, 32)}
    run_prefill(model, [(_ids(630, 44), 600), (_ids(26, 45), 0), (_ids(200, 46), 183)], slot=4, end=700, **kw)
    run_prefill(model, [(_ids(9, 47), 0)], slot=2, end=9, **kw)
    assert dec.prefill_buckets == {(4, 32), (1, 16)}
    run_prefill(model, [(_ids(300, 48), 300 - GRAPH_TOKENS - 1)], slot=1, end=310, **kw)
    assert dec.prefill_buckets == {(4, 32), (1, 16)}


@pytest.mark.gpu
async def test_cuda_long_prompt_greedy_identical_to_generate(tokenizer):
    """A 2,050-token prompt and 32 greedy tokens through the engine (fused prefill after a trie hit, captured
    decode steps) on a Llama-3.2-1B-shaped float32 model: HF `generate`'s tokens."""
    from lmq_backend.engine.picks import Greedy

    model = llama_1b_shaped(layers=16, dtype=torch.float32, vocab=49152)
    text = tokenizer.decode(_ids(2100, 31))
    backend = lmq.HFBackend.from_model(model, tokenizer, name="long")
    assert backend.runner.fused_prefill
    prompt = backend.vocab.encode(text)[:2050]
    text = tokenizer.decode(prompt)
    prompt = backend.vocab.encode(text)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device="cuda"), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long, device="cuda"), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False, pad_token_id=0)
    want = out[0, len(prompt):].tolist()

    async def greedy(prompt_text: str, n: int) -> list[int]:
        seq = backend.sequence("long", max_len=len(prompt) + 64)
        try:
            await backend.extend(seq, prompt_text)
            hole = Record(n)
            await backend.generate(seq, hole, Greedy())
            return hole.tokens
        finally:
            backend.release(seq)

    await greedy(text[: len(text) // 2], 1)                      # the trie now holds half of the prompt
    prefilled = backend.stats().tokens_prefilled
    assert await greedy(text, 32) == want                         # a fused prefill after a trie hit
    assert len(prompt) // 3 < backend.stats().tokens_prefilled - prefilled < len(prompt) * 2 // 3
    assert await greedy(text, 32) == want                         # all of it cached
