"""The engine's fused decode path gives the same greedy tokens as the model's own forward (float32), alone and
batched: eager over the growable pool on the CPU, CUDA-graph captured on a GPU (skipped without CUDA; CI has
none, run it on the GPU machine)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq

SRC = '''
"Some shared text to start with, {x}[A]" where len(TOKENS(A)) < 12
" and then[B]" where B in [" yes", " no"]
"{x} more[C]" where len(TOKENS(C)) < 20
'''


async def run_all(backend, n=6):
    q = lmq.Query(SRC, model=backend)
    return [r.variables for r in await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
async def test_fused_decode_matches_the_model_forward(tokenizer, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8) \
        if device == "cuda" else dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(vocab_size=49152, num_key_value_heads=2, max_position_embeddings=4096, **size)
    model = LlamaForCausalLM(config).to(device).eval()
    fused = lmq.HFBackend.from_model(model, tokenizer, name="fused")
    assert fused.runner.fused
    plain = lmq.HFBackend.from_model(model, tokenizer, name="plain")
    plain.runner.fused = False
    alone = await run_all(plain, 1)
    assert await run_all(fused) == await run_all(plain)
    assert await run_all(fused, 1) == alone
    # the fused path decoded (every hole had more than one token to pick)
    assert fused.stats().tokens_decoded > 0
