"""bfloat16 through the engine (the GPU default) against an independent transformers reference in bfloat16,
on a context-sensitive model: on the CPU here, and on the GPU where there is one.

Stated tolerance: lmq and the reference round differently (fused kernels and another summation order), so
the greedy tokens may part at a near-tie, and only there: at the first token where they differ, the
reference's own logits for the two tokens must be within `TIE` of each other. A wrong context (a lost
cached column, a shifted position) parts them at tokens the reference prefers by far more."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq
from support.models import special_ids

TIE = 0.25  # bf16 logits of these models are O(10); one bf16 ulp at 8-16 is 0.0625
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NEW = 10
PROMPTS = [f"Input: {w} and {v} again {w}\nOutput:" for w, v in
           [("alpha", "river"), ("stone", "cloud"), ("seven", "green"), ("table", "quiet"), ("north", "apple"),
            ("lamp", "matrix")]]


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model(torch.tensor([ids], device=dev), use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()


async def violations(backend, reference, tokenizer) -> tuple[list[str], int]:
    """Run the prompts alone, then batched; returns (greedy tokens that part from the reference's by more
    than TIE, or where lmq stopped and the reference would not; near-ties where they parted)."""
    stop = special_ids(tokenizer)
    query = lmq.Query('"{p}[A]" where len(TOKENS(A)) < ' + str(NEW + 1), model=backend)
    got: dict[str, list[int]] = {}
    release = backend.release

    def spy(seq):  # the ids lmq ran on, by prompt
        got[seq.text[:seq.text.index("Output:") + len("Output:")]] = list(seq.ids)
        release(seq)

    backend.release = spy
    bad: list[str] = []
    parted = 0
    for batched in (False, True):
        got.clear()
        if batched:
            await asyncio.gather(*(query(p=p) for p in PROMPTS))
        else:
            for p in PROMPTS:
                await query(p=p)
        for p in PROMPTS:
            prompt = backend.vocab.encode(p)
            out = got[p][len(prompt):]
            for k in range(NEW):
                logits = reference_logits(reference, prompt + out[:k])
                masked = logits.clone()
                masked[sorted(stop)] = float("-inf")
                want = int(masked.argmax())
                if k == len(out):  # lmq stopped early: only where the reference picks a stop token
                    if int(logits.argmax()) not in stop:
                        bad.append(f"{p!r}: lmq stopped after {k} tokens")
                    break
                if out[k] != want:
                    gap = float(logits[want] - logits[out[k]])
                    if gap > TIE:
                        bad.append(f"{p!r}: token {k}: lmq {out[k]}, reference {want} by {gap:.3f}")
                    parted += 1
                    break
    del backend.release
    return bad, parted


def models(zoo, family: str, device: str):
    engine = zoo.fresh(family).to(device=device, dtype=torch.bfloat16)
    reference = zoo.fresh(family).to(device=device, dtype=torch.bfloat16)  # never seen by lmq
    return engine, reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_bf16_greedy_tokens_equal_the_reference_but_at_near_ties(zoo, tokenizer, family, device):
    engine, reference = models(zoo, family, device)
    backend = lmq.HFBackend.from_model(engine, tokenizer, cache_budget="64MB", name=f"bf16-{family}")
    bad, parted = await violations(backend, reference, tokenizer)
    assert bad == []
    # 12 runs (alone, batched): most may part at a near-tie (on the GPU, fused kernels against cuBLAS part
    # 5 of 12), but not nearly all, which would say the logits no longer separate tokens at all
    assert parted <= 3 * len(PROMPTS) // 2, "more near-ties than bf16 rounding explains"


@pytest.mark.parametrize("fault", ["cached_k", "decode_position"])
async def test_the_bf16_comparison_catches_a_broken_engine(zoo, tokenizer, monkeypatch, fault):
    from test_fault_injection import inject_fault

    engine, reference = models(zoo, "llama", "cpu")
    backend = lmq.HFBackend.from_model(engine, tokenizer, cache_budget="64MB", name="bf16-broken")
    fired = inject_fault(monkeypatch, backend, fault, at=0)
    bad, _ = await violations(backend, reference, tokenizer)
    assert fired and bad, f"a {fault} fault went unnoticed in bfloat16"
