"""End-to-end query on the GPU: a 2,050-token prompt, then 32 greedy tokens, through
lmq (fused prefill into the KV pool + fused, CUDA-graph captured decode steps) against HF `generate`; and the
same engine with its prefills through the model's own forward.
Random weights of a Llama-3.2-1B shape in bf16; speed does not depend on weight values.

    python benchmarks/bench_gpu_query.py --tokenizer DIR [--shape llama-1b] [--runs 5]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402
from lmq_backend.runtime.constraints import Stop  # noqa: E402
from lmq_backend.runtime.decoders import Greedy  # noqa: E402

PROMPT, NEW = 2050, 32


class ExactlyN:
    """A hole of exactly n tokens (any text token): the HoleState contract of lmq_backend.runtime.constraints."""

    def __init__(self, n: int):
        self.n, self.n_tokens, self.text = n, 0, ""

    def allowed(self):
        return None

    def can_end(self) -> bool:
        return False

    def advance(self, token_id: int):
        self.n_tokens += 1
        return Stop(text="", keep=self.n_tokens, tail="") if self.n_tokens == self.n else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(W.random_config(args.shape), dtype=torch.bfloat16).cuda().eval()
    backend = lmq.HFBackend.from_model(model, tokenizer, cache_budget="16GB", name=args.shape)
    text = W.w1_shots(200)
    ids = tokenizer.encode(text, add_special_tokens=False)[: PROMPT - 8]
    base = tokenizer.decode(ids)
    async def query(prompt: str) -> str:
        # The engine's protocol, as a query's hole uses it; random weights rarely pick EOS, but to time
        # exactly NEW tokens (as HF's min_new_tokens does) the hole may not end before.
        seq = backend.sequence("e2e", max_len=PROMPT + 2 * NEW)
        try:
            await backend.extend(seq, prompt)
            return await backend.generate(seq, ExactlyN(NEW), Greedy())
        finally:
            backend.release(seq)

    def lmq_call(prompt: str) -> tuple[float, int]:
        before = backend.stats().tokens_decoded
        torch.cuda.synchronize()
        t = time.perf_counter()
        asyncio.run(query(prompt))
        torch.cuda.synchronize()
        return time.perf_counter() - t, backend.stats().tokens_decoded - before

    def lmq_runs(tag: str) -> tuple[list, list]:
        lmq_call(f"warm-up {tag} {base}")  # Triton JIT and CUDA-graph capture
        cold = [lmq_call(f"Run {tag} {i}. {base}") for i in range(args.runs)]
        warm = [lmq_call(f"Run {tag} {i}. {base}") for i in range(args.runs)]
        return cold, warm

    cold, warm = lmq_runs("a")
    decoder = backend.runner._decoder[0]
    ahead_stats = f"run-ahead steps launched {decoder.ran_ahead}, taken {decoder.took_ahead}"
    masks = backend.runner.greedy_masks
    backend.runner.set_greedy_masks(None)  # the same engine without running ahead (every step waits for the host)
    cold_plain, warm_plain = lmq_runs("b")
    backend.runner.set_greedy_masks(masks)
    fused_prefill = backend.runner.fused_prefill
    backend.runner.fused_prefill = False  # prefills through the model's own forward (the HF path)
    cold_hf_prefill, _ = lmq_runs("c")
    backend.runner.fused_prefill = fused_prefill
    prompt_len = len(backend.vocab.encode(f"Run 0. {base}"))

    hf_ids = torch.tensor([backend.vocab.encode(f"Run 0. {base}")], device="cuda")
    def hf_call() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    hf_call()
    hf = [hf_call() for _ in range(args.runs)]
    med = statistics.median
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape} bf16, random weights, "
          f"fused decode: {backend.runner.fused}")
    print(f"prompt {prompt_len} tokens, {NEW} new tokens (lmq decoded {cold[0][1]} + 1 per call)")
    print(f"{'HF generate':<28} {med(hf) * 1e3:8.1f} ms")
    print(f"{'lmq, new prompt (prefill)':<28} {med(t for t, _ in cold) * 1e3:8.1f} ms   {med(hf) / med(t for t, _ in cold):5.1f}x")
    print(f"{'lmq, cached prompt':<28} {med(t for t, _ in warm) * 1e3:8.1f} ms   {med(hf) / med(t for t, _ in warm):5.1f}x")
    print(f"{'  no run-ahead, new prompt':<28} {med(t for t, _ in cold_plain) * 1e3:8.1f} ms   "
          f"{med(hf) / med(t for t, _ in cold_plain):5.1f}x")
    print(f"{'  no run-ahead, cached':<28} {med(t for t, _ in warm_plain) * 1e3:8.1f} ms   "
          f"{med(hf) / med(t for t, _ in warm_plain):5.1f}x")
    print(f"{'  model-forward prefill, new':<28} {med(t for t, _ in cold_hf_prefill) * 1e3:8.1f} ms   "
          f"{med(hf) / med(t for t, _ in cold_hf_prefill):5.1f}x")
    print(ahead_stats)


if __name__ == "__main__":
    main()
