"""The engine on a GPU: the fused, graph-captured decode path gives the same greedy tokens as the
model's own forward (float32), alone and batched. Skipped without CUDA (CI has none; run on the GPU machine)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import lmq_backend as lmq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SRC = '''
"Some shared text to start with, {x}[A]" where len(TOKENS(A)) < 12
" and then[B]" where B in [" yes", " no"]
"{x} more[C]" where len(TOKENS(C)) < 20
'''


async def run_all(backend, n=6):
    q = lmq.Query(SRC, model=backend)
    return [r.variables for r in await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))]


async def test_fused_decode_matches_the_model_forward(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).cuda().eval()
    fused = lmq.HFBackend.from_model(model, tokenizer, name="fused")
    assert fused.runner.fused
    plain = lmq.HFBackend.from_model(model, tokenizer, name="plain")
    plain.runner.fused = False
    alone = [await run_all(plain, 1)]
    assert await run_all(fused) == await run_all(plain)
    assert (await run_all(fused, 1)) == alone[0]
