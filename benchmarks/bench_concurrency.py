"""N concurrent few-shot queries: throughput, K/V memory at peak against the K/V of the
unique tokens, against plain HF `generate` on one left-padded batch of the same texts.

Workload: one compiled query, a ~1,060-token shared few-shot prefix, each call's own ~25-token review, then
a hole of up to 16 free tokens. All N calls run at once (`asyncio.gather`), after a warm-up with the same N.

    GPU: python benchmarks/bench_concurrency.py --tokenizer DIR --shape llama-1b --n 64 256 1024
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 4096 --kv-budget 8GB
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 1024 --sample    (sampled, T = 0.8)
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 1024 --sample --top-p 0.9   (and a nucleus)
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 1024 --where 'REGEX(S, r" [a-z ,.]{1,80}")'
                                                (the hole under a constraint of its own besides the length)
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 1024 --sample --where 'STOPS_AT(S, "x")'
                                                (holes that end at different steps: rows leave and join)
    CPU: python benchmarks/bench_concurrency.py --device cpu --n 16 128      (the default model, float32)
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402

QUERY = '''{decoder}
    "{{shots}}Review: {{review}}\\nSummary:[S]" where len(TOKENS(S)) < 17{where}
'''


def reviews(n: int, start: int = 0) -> list[str]:
    """n calls' reviews, numbered from `start` (each row of a run its own numbers: a repeated N must not
    find its calls' whole prompts in the trie), the numbers all 6 digits wide (the default tokenizer spells
    a digit a token: a call at N=1,024 would otherwise carry one or two more tokens than at 64)."""
    base = W.w1_reviews(20)
    return [f"{base[i % len(base)]} (visit {i:06d})" for i in range(start, start + n)]


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


async def run_n(query, shots: str, texts: list[str]) -> float:
    t = time.perf_counter()
    results = await asyncio.gather(*(query(shots=shots, review=r) for r in texts))
    assert len(results) == len(texts)
    return time.perf_counter() - t


def hf_generate(model, tokenizer, prompts: list[str], device, chunk: int, sample: bool = False) -> float:
    """Plain transformers: left-padded batches of `chunk` prompts, 16 new tokens each (greedy, or sampled at
    temperature 0.8)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    t = time.perf_counter()
    for i in range(0, len(prompts), chunk):
        enc = tokenizer(prompts[i:i + chunk], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id,
                           **(dict(do_sample=True, temperature=0.8, top_k=0) if sample else dict(do_sample=False)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def run_ahead(backend) -> tuple[int, int]:
    """(run-ahead steps launched, taken) by the backend's fused GPU decoder so far; (0, 0) without one."""
    decoder = getattr(backend.runner, "_decoder", None)
    return (decoder[0].ran_ahead, decoder[0].took_ahead) if decoder else (0, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", help="folder with the default model's tokenizer (GPU runs, random weights)")
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--kv-budget", default=None)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--hf", action="store_true", help="also time HF generate on the same texts")
    ap.add_argument("--hf-chunk", type=int, default=256)
    ap.add_argument("--sample", action="store_true", help="sample(temperature=0.8) instead of argmax")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --sample: the nucleus (1: none)")
    ap.add_argument("--where", default="", help="a constraint on S besides its length (REGEX, INT, S in [...])")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    if device.type == "cuda":
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(W.random_config(args.shape), dtype=torch.bfloat16).cuda().eval()
        name = args.shape
    else:
        from lmq_backend.backend.default_model import default_model_dir

        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
        name = "smollm2-135m (default, fp32)"
    plain = W.plain_model(model) if args.hf else None
    rss0 = rss_gb()
    backend = lmq.HFBackend.from_model(model, tokenizer, cache_budget="40GB", name=name, max_batch=args.max_batch,
                                       kv_budget=args.kv_budget)
    lmq.register_backend("bench", backend)
    nucleus = f", top_p={args.top_p}" if args.top_p < 1 else ""
    query = lmq.compile(QUERY.format(decoder=f"sample(temperature=0.8{nucleus})" if args.sample else "argmax",
                                     where=f" and {args.where}" if args.where else "") + 'from "bench"\n')
    shots = W.w1_shots(40)
    store = backend.store
    per_token = store.bytes_per_token
    print(f"# {name} on {device}, {'sampled' + nucleus if args.sample else 'greedy'}{', where ' + args.where if args.where else ''}, "
          f"max_batch {args.max_batch}, store {store.capacity * per_token / 1e9:.1f} GB "
          f"({store.capacity} slots)")
    print("| N | time | queries/s | K/V at peak | K/V of unique tokens | ratio | HF generate q/s | RSS growth |")
    print("|---|---|---|---|---|---|---|---|")
    start = 0
    for n in args.n:
        texts = reviews(2 * n, start)
        start += 2 * n
        store.peak_used = store.used_slots
        before = store.used_slots
        asyncio.run(run_n(query, shots, texts[:n]))         # warm-up: same N, fills the trie with the prefix
        ahead, steps = run_ahead(backend), []
        backend.on_step(steps.append)
        seconds = asyncio.run(run_n(query, shots, texts[n:]))
        backend.on_step(None)
        ahead = [b - a for a, b in zip(ahead, run_ahead(backend))]
        # every token that was live: the prefix once, each call's review and answer (the trie keeps them)
        prefix = len(tokenizer.encode(shots)) if not before else 0
        own = sum(len(tokenizer.encode(f"Review: {r}\nSummary:")) + 16 for r in texts)
        unique = (prefix + own) * per_token
        store.peak_used -= before
        peak = store.peak_used * per_token
        hf = ""
        if args.hf:
            prompts = [f"{shots}Review: {r}\nSummary:" for r in texts]
            hf = f"{n / hf_generate(plain, tokenizer, prompts, device, args.hf_chunk, args.sample):.0f}"
        print(f"| {n} | {seconds:.2f} s | {n / seconds:.0f} | {peak / 1e9:.3f} GB | {unique / 1e9:.3f} GB | "
              f"{peak / unique:.2f} | {hf} | {rss_gb() - rss0:.2f} GB |", flush=True)
        prefills = [s.batch_size for s in steps if s.kind == "prefill"]  # (the timed round's steps)
        print(f"#   {len(steps) - len(prefills)} decode steps, {len(prefills)} prefill steps (rows: at most "
              f"{max(prefills, default=0)}, median {sorted(prefills)[len(prefills) // 2] if prefills else 0})"
              + (f"; run-ahead steps launched {ahead[0]}, taken {ahead[1]}" if ahead[0] else ""), flush=True)
    s = backend.stats()
    print(f"# hit rate {s.token_hit_rate:.3f}, trie {s.bytes_in_use / 1e9:.2f} GB in {s.nodes} nodes, "
          f"evictions {s.evictions}")


if __name__ == "__main__":
    main()
