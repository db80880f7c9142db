"""lmq against an independent transformers reference, on the CPU in float32.

The reference (tests/support/models.py) is a second instance of the same weights, copied before lmq saw the model,
with transformers' own attention, run by a plain forward loop; it replays each query the way lmq tokenizes
it. lmq must pick the same greedy token ids and give the same log-probabilities (within 1e-4), for every
model family, with the cache on and off, alone and batched with random arrival, with the fused decode step
and without. tests/backend/test_fault_injection.py checks that these comparisons fail on a broken engine.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from support.caches import node_slots
from support.models import (FAMILIES, LLAMA_FAMILY, SCRIPT, Script, differences, expected, generate, run_engine,
                            standard_calls, token_log_probs)
from support.skip_policy import kernels_expected


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("cache_budget", [0, "64MB"], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_greedy_tokens_and_distribution_equal_the_reference(zoo, monkeypatch, family, cache_budget, batched):
    """Seven calls of a query with two free holes and a final `distribution`, sharing a few-shot prefix (one
    call repeated): the token ids lmq ran on equal the reference's, the distribution within 1e-4. Alone the
    CPU kernels are the calibration's choice (LMQ_CPU_KERNELS=auto); batched they are forced on, and a
    Llama-family decode step must have run lmq's C attention over several rows."""
    from lmq_backend.engine.fused import cpu_step
    from lmq_kernels import cpu

    kernel_rows: list[int] = []
    if batched:  # the rows of each decode step whose attention lmq's C kernels ran: per op, or inside the
        monkeypatch.setenv("LMQ_CPU_KERNELS", "1")  # one-call C step (a shared model's classes seen before)
        attention, layers = cpu.attention, cpu_step.decode_layers
        monkeypatch.setattr(cpu, "attention",
                            lambda q, *a, **k: attention(q, *a, **k) and not kernel_rows.append(len(q)))
        monkeypatch.setattr(cpu_step, "decode_layers",
                            lambda plan, x, *a: layers(plan, x, *a) and not kernel_rows.append(len(x)))
    backend = zoo.backend(family, cache_budget)
    steps = []
    backend.on_step(steps.append)
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=batched, seed=1)
    assert differences(got, expected(zoo, family)) == []
    # the configuration ran as named
    assert (backend.stats().tokens_reused > 0) == bool(cache_budget)
    decode_rows = max(s.batch_size for s in steps if s.kind == "decode")
    assert decode_rows > 1 if batched else decode_rows == 1
    if batched and family in LLAMA_FAMILY and kernels_expected():
        assert max(kernel_rows, default=0) > 1, "lmq's C attention never ran inside a decode step"


@pytest.mark.parametrize("path", ["unfused", "fused-torch-ops"])
@pytest.mark.parametrize("family", LLAMA_FAMILY)
async def test_other_decode_paths_equal_the_reference(zoo, monkeypatch, family, path):
    """Batched decode steps through the model's own forward (`runner.fused = False`), or through the fused
    step with torch's ops instead of lmq's C kernels (LMQ_CPU_KERNELS=0)."""
    if path == "fused-torch-ops":
        monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    backend = zoo.backend(family, "64MB", fused=path == "fused-torch-ops")
    assert backend.runner.fused == (path == "fused-torch-ops")
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=True, seed=2)
    assert differences(got, expected(zoo, family)) == []


@pytest.mark.parametrize("cache_budget", [0, "64MB"], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_scores_equal_the_reference_log_softmax(zoo, family, cache_budget):
    """`score_tokens` and `score` of several options after prompts sharing a prefix, scored concurrently:
    each token's log-probability within 1e-4 of the reference's log_softmax."""
    backend, model, tok = zoo.backend(family, cache_budget), zoo.reference(family), zoo.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    shots = standard_calls()[0]["shots"]
    prompts = [shots + f"Input: {w}\nOutput:" for w in ("alpha", "river stone", "42 !", "alpha")]
    options = [" yes", " no", " maybe so", " green table of the orbit"]

    async def scores(prompt: str):
        seq = backend.sequence("score")
        await backend.extend(seq, prompt)
        try:
            return (list(seq.ids), await backend.score_tokens(seq, [encode(o) for o in options]),
                    await backend.score(seq, options))
        finally:
            backend.release(seq)

    for prompt, (ids, per_token, sums) in zip(prompts, await asyncio.gather(*map(scores, prompts))):
        assert ids == encode(prompt)
        want = [token_log_probs(model, ids, encode(o)) for o in options]
        for got_option, want_option in zip(per_token, want):
            assert got_option == pytest.approx(want_option, abs=1e-4)
        assert sums == pytest.approx([sum(w) for w in want], abs=1e-4)
    assert (backend.stats().tokens_reused > 0) == bool(cache_budget)


@pytest.mark.parametrize("family", FAMILIES)
async def test_wrapping_a_model_leaves_the_users_calls_unchanged(zoo, family, tmp_path):
    """After `HFBackend.from_model(model)` and queries on it, the user's own `model(...)` (with and without a
    padding mask) and `model.generate(...)` give what an untouched copy gives, and `save_pretrained` saves
    the same weights, which load back into a model that computes the same logits."""
    from lmq_backend.backend.hf import HFBackend

    user, untouched, tok = zoo.fresh(family), zoo.fresh(family), zoo.tokenizer
    backend = HFBackend.from_model(user, tok, cache_budget="64MB")
    await run_engine(backend, SCRIPT, standard_calls()[:3], batched=True)
    ids = torch.tensor([tok.encode("The user's own text, called on the model after lmq wrapped it. " * 3)])
    short, long = tok.encode("a short row"), tok.encode("and a longer row, of several more words than it")
    pad = len(long) - len(short)
    batch = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    @torch.no_grad()
    def calls(model):
        return (model(ids).logits, model(batch, attention_mask=mask).logits[:, pad:],
                model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
                model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0))

    (logits, padded, gen, gen_padded), want = calls(user), calls(untouched)
    assert torch.allclose(logits, want[0], rtol=0, atol=1e-5)
    assert torch.allclose(padded, want[1], rtol=0, atol=1e-5)
    assert torch.equal(gen, want[2]) and torch.equal(gen_padded, want[3])
    user.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, use_kernels=False).eval()
    saved, original = loaded.state_dict(), untouched.state_dict()
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, want[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,key", [("qwen2", "q_proj.bias"), ("qwen3", "embed_tokens.weight")])
async def test_weights_loaded_after_wrapping_reach_every_forward(zoo, family, key):
    """A user loads new weights (`load_state_dict`) into a model lmq already wrapped, then queries it through
    a new backend: the tokens equal the reference's with the same new weights."""
    from lmq_backend.backend.hf import HFBackend

    model, reference, tok = zoo.fresh(family), zoo.fresh(family), zoo.tokenizer
    HFBackend.from_model(model, tok)
    noise = torch.Generator().manual_seed(0)
    state = {k: v + torch.randn(v.shape, generator=noise) * v.std() if k.endswith(key) else v
             for k, v in zoo.state(family)[1].items()}
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for m in (model, reference):
        m.load_state_dict(state)
    got = await run_engine(HFBackend.from_model(model, tok, cache_budget=0), SCRIPT, standard_calls()[:2], batched=False)
    assert differences(got, [SCRIPT.reference(reference, tok, c) for c in standard_calls()[:2]]) == []


# ------------------------------------------------------------------------------------ the default model

DEFAULT_SCRIPT = Script((("text", "{shots}Q: {q}\nA:"), ("hole", "A", 20), ("text", "\nQ: Why?\nA:"), ("hole", "B", 8)))
DEFAULT_SHOTS = ("Q: What is the capital of France?\nA: Paris.\n\nQ: How many legs does a spider have?\nA: Eight.\n\n"
                 "Q: What colour is the sky on a clear day?\nA: Blue.\n\n")
DEFAULT_QUESTIONS = ["What is the largest planet in the solar system?", "Who wrote Romeo and Juliet?",
                     "What do bees make?"]


@pytest.mark.slow
async def test_default_model_equals_an_independent_hf_instance(default_backend):
    """SmolLM2-135M: greedy tokens of three questions after a shared few-shot prefix, cache off and alone,
    then cache on and batched with random arrival, equal those of `generate(do_sample=False)` on a second
    instance loaded from the same folder."""
    from lmq_backend.backend.default_model import default_model_dir
    from lmq_backend.backend.hf import HFBackend

    tok = default_backend.tokenizer
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32, use_kernels=False).eval()
    calls = [dict(shots=DEFAULT_SHOTS, q=q) for q in DEFAULT_QUESTIONS]
    want = [DEFAULT_SCRIPT.reference(reference, tok, c, fill=generate) for c in calls]
    assert all(len(ids) > 20 for ids, _ in want)
    cold = HFBackend.from_model(default_backend.model, tok, cache_budget=0, name="default-cold")
    assert differences(await run_engine(cold, DEFAULT_SCRIPT, calls, batched=False), want) == []
    warm = HFBackend.from_model(default_backend.model, tok, cache_budget="64MB", name="default-warm")
    steps = []
    warm.on_step(steps.append)
    assert differences(await run_engine(warm, DEFAULT_SCRIPT, calls, batched=True, seed=4), want) == []
    assert warm.stats().tokens_reused > 0 and max(s.batch_size for s in steps if s.kind == "decode") > 1


@pytest.mark.parametrize("cache_budget", [0, "64MB"], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_prompts_prefilled_in_parts_equal_the_reference(zoo, family, cache_budget):
    """A step that takes at most 16 new tokens: every prompt (~90 tokens) is prefilled in parts, each part's
    K/V the next one's cached prefix, with the cache on or off, while other calls' rows decode; the tokens
    and the distribution are the reference's, and no slot is left held."""
    backend = zoo.backend(family, cache_budget)
    backend.scheduler.max_prefill_tokens = 16
    steps = []
    backend.on_step(steps.append)
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=True, seed=3)
    assert differences(got, expected(zoo, family)) == []
    prefills = [s for s in steps if s.kind == "prefill"]
    assert max(s.new_tokens for s in prefills) <= 16
    assert sum(s.new_tokens == 16 and s.batch_size == 1 for s in prefills) >= 6  # parts of several calls
    kinds = "".join(s.kind[0] for s in steps)
    assert "pdp" in kinds  # rows decode between the parts of a prompt
    assert backend.trie.pinned_nodes() == 0 and backend.scheduler.pool.rows == 0 and not backend.scheduler.waiting
    backend.store.check(node_slots(backend.trie), [])
