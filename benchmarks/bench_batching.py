"""Batching benchmark. Same workloads as bench_prefix_cache.py, concurrent:

  W1: 20 concurrent few-shot classification calls (asyncio.gather): amortized time per call, against the
      same 20 calls one after another through lmq, and HF `generate` on one left-padded batch of the 20 prompts.
  W2: 8 concurrent 6-turn chats: total time, against the 8 chats one after another through lmq, and HF
      `generate` on a left-padded batch of the 8 histories each turn.
  W3: self-consistency: W1's prompt sampled 8 times a call (`sample(n=8)`: a label, then a reason of up to 12
      tokens), calls one after another: time a call, against HF `generate(do_sample=True,
      num_return_sequences=8)` of as many tokens on the same prompt (two calls of it).

    python benchmarks/bench_batching.py                       # CPU, the default model (SmolLM2-135M)
    python benchmarks/bench_batching.py --first-run           # W1's first concurrent run of a new process
    python benchmarks/bench_batching.py --random llama-1b --device cuda --dtype bfloat16   # GPU, random weights
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402

CHATS = 8


def backend_for(args) -> "lmq.HFBackend":
    if args.random is None:
        return lmq.HFBackend(args.model, device=args.device, dtype=args.dtype, cache_budget="8GB")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(W.random_config(args.random), dtype=getattr(torch, args.dtype))
    return lmq.HFBackend.from_model(model.to(args.device), tokenizer, cache_budget="16GB", name=args.random)


def hf_batch_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`model.generate` on one left-padded batch (the baseline a user would write)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def timed(coro_factory) -> float:
    t = time.perf_counter()
    asyncio.run(coro_factory())
    return time.perf_counter() - t


def w1(backend, calls: int, first_run: bool = False, peer: bool = True) -> None:
    shots = W.w1_shots()
    # Each run prefills reviews of its own: the timed ones, the one-after-another ones and the warm-up ones.
    reviews, other_reviews = (W.w1_reviews(calls, seed=s) for s in (1, 2))
    q = lmq.Query(W.W1_QUERY, model=backend)
    asyncio.run(q.run({"shots": shots, "review": "warm-up"}))

    async def sequential():
        for r in other_reviews:
            await q.run({"shots": shots, "review": r})

    async def concurrent():
        return await asyncio.gather(*(q.run({"shots": shots, "review": r}) for r in reviews))

    t_seq = timed(sequential)
    warm_seeds = iter(range(3, 100))

    async def warm_up():  # the batch sizes of the timed run, seen once (CUDA graphs are captured per size)
        warm_reviews = W.w1_reviews(calls, seed=next(warm_seeds))
        await asyncio.gather(*(q.run({"shots": shots, "review": r}) for r in warm_reviews))

    if not first_run:  # (on the CPU: until no new kernel class is measured)
        W.until_calibrated(lambda: asyncio.run(warm_up()))
    measured = len(cpu_choices())
    steps = []
    backend.on_step(steps.append)
    t_con = timed(concurrent)
    backend.on_step(None)
    measured = len(cpu_choices()) - measured
    encode = backend.vocab.encode
    prompts = [encode(shots + "Review: " + r + "\nSentiment:") for r in reviews]
    t_hf = float("nan")
    if peer:
        model = W.plain_model(backend.model)
        t = time.perf_counter()
        hf_batch_generate(model, prompts, 1)
        t_hf = time.perf_counter() - t
    print(f"\nW1, {calls} calls, ~{len(prompts[0])} prompt tokens each (seconds per call, amortized)"
          + (": the process's first concurrent run" if first_run else ""))
    print(f"  lmq concurrent        {t_con / calls:8.4f}   ({t_con / t_seq:.2f}x one after another's time a call; "
          f"{measured} CPU kernel classes measured inside it)")
    print(f"  lmq one after another {t_seq / calls:8.4f}   ({t_seq / t_con:.1f}x slower)")
    print(f"  HF generate, batch    {t_hf / calls:8.4f}   ({t_hf / t_con:.1f}x slower)")
    print(f"  lmq steps: {[(s.kind, s.batch_size, s.new_tokens) for s in steps]}")


def w3(backend, calls: int, peer: bool = True) -> None:
    shots = W.w1_shots()
    q = lmq.Query(W.W3_QUERY, model=backend)
    asyncio.run(q.run({"shots": shots, "review": "warm-up"}))
    reviews = W.w1_reviews(calls, seed=4)
    steps = []

    async def calls_one_after_another():
        for r in reviews:
            steps.clear()
            await q.run({"shots": shots, "review": r})

    backend.on_step(steps.append)
    t_lmq = timed(calls_one_after_another) / calls
    backend.on_step(None)
    new_tokens = 1 + len(backend.vocab.encode(", because")) + W.W3_REASON_TOKENS
    t_hf = float("nan")
    if peer:
        model = W.plain_model(backend.model)
        encode = backend.vocab.encode
        peer_reviews = reviews[:2]  # (it prefills the whole prompt 8 times a call: seconds a call on a CPU)
        t = time.perf_counter()
        for r in peer_reviews:
            ids = torch.tensor([encode(shots + "Review: " + r + "\nSentiment:")], device=model.device)
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                               num_return_sequences=W.W3_SAMPLES, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0)
        t_hf = (time.perf_counter() - t) / len(peer_reviews)
    print(f"\nW3, {calls} self-consistency calls one after another, {W.W3_SAMPLES} samples each (seconds a call)")
    print(f"  lmq                   {t_lmq:8.4f}")
    print(f"  HF generate, {W.W3_SAMPLES} sequences {t_hf:8.4f}   ({t_hf / t_lmq:.1f}x slower; {new_tokens} tokens each)")
    print(f"  lmq steps of the last call: {[(s.kind, s.batch_size, s.new_tokens) for s in steps]}")


def cpu_choices() -> dict:
    from lmq_kernels import cpu

    return cpu.choices()


def w2(backend, rounds: int = 1, peer: bool = True) -> None:
    q = lmq.Query(W.W2_QUERY, model=backend)

    def chats_of(who: str, k: int) -> list[dict]:  # each round its own texts: no round reuses another's cache
        tag = f", round {k}" if k else ""
        return [{"system": W.W2_SYSTEM, "turns": [f"{t} ({who} {c}{tag})" for t in W.W2_TURNS]} for c in range(CHATS)]

    chats = chats_of("traveller", 0)
    asyncio.run(q.run({"system": W.W2_SYSTEM, "turns": ["warm-up"]}))
    warm_runs = iter(range(100))

    async def warm_up():  # the batch sizes of the timed run, seen once (CUDA graphs are captured per size)
        k = next(warm_runs)
        await asyncio.gather(*(q.run({"system": W.W2_SYSTEM, "turns": [f"Hello {c} ({k})!"]}) for c in range(CHATS)))

    W.until_calibrated(lambda: asyncio.run(warm_up()))

    async def sequential(batch):
        for c in batch:
            await q.run(c)

    async def concurrent(batch):
        await asyncio.gather(*(q.run(c) for c in batch))

    # one after another and at once alternate, round by round: each round's ratio compares runs a minute apart
    # at most (a 2-core host's speed drifts by 15% and more between runs)
    seqs, cons, steps, seq_steps = [], [], [], []
    for k in range(rounds):
        backend.on_step(seq_steps.append if k == rounds - 1 else None)
        seqs.append(timed(lambda: sequential(chats_of("visitor", k))))
        backend.on_step(steps.append if k == rounds - 1 else None)
        cons.append(timed(lambda: concurrent(chats_of("traveller", k))))
        backend.on_step(None)
    t_seq, t_con = statistics.median(seqs), statistics.median(cons)
    encode = backend.vocab.encode
    histories = [encode("<|im_start|>system\n" + W.W2_SYSTEM + "<|im_end|>\n") for _ in chats]
    t_hf = float("nan")
    if peer:
        model = W.plain_model(backend.model)
        t = time.perf_counter()
        for turn in range(len(W.W2_TURNS)):
            for c, h in zip(chats, histories):
                h += encode("<|im_start|>user\n" + c["turns"][turn] + "<|im_end|>\n<|im_start|>assistant\n")
            outs = hf_batch_generate(model, histories, W.W2_ANSWER_TOKENS)
            for h, out in zip(histories, outs):
                h += out + encode("<|im_end|>\n")
        t_hf = time.perf_counter() - t
    decodes = [s.batch_size for s in steps if s.kind == "decode"]
    print(f"\nW2, {CHATS} chats x {len(W.W2_TURNS)} turns (total seconds)")
    print(f"  lmq concurrent        {t_con:8.3f}")
    print(f"  lmq one after another {t_seq:8.3f}   (concurrent is {t_seq / t_con:.1f}x the throughput)")
    if rounds > 1:
        print(f"  rounds (medians above): concurrent {', '.join(f'{t:.3f}' for t in cons)}; one after another "
              f"{', '.join(f'{t:.3f}' for t in seqs)}; ratios {', '.join(f'{a / b:.2f}' for a, b in zip(seqs, cons))}")
    print(f"  HF generate, batch    {t_hf:8.3f}   ({t_hf / t_con:.1f}x slower)")
    print(f"  lmq decode steps: {len(decodes)}, mean batch {sum(decodes) / max(len(decodes), 1):.1f}")
    for name, run in (("one after another", seq_steps), ("at once", steps)):  # the last round's steps, by kind
        parts = []
        for kind in ("prefill", "decode"):
            mine = [s for s in run if s.kind == kind]
            seconds = sum(s.seconds for s in mine)
            parts.append(f"{kind} {seconds:.2f} s in {len(mine)} steps ({1e3 * seconds / max(len(mine), 1):.1f} ms a step, "
                         f"{sum(s.new_tokens for s in mine)} tokens)")
        print(f"  {name}: " + "; ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--random", default=None, help="a random-weight model shape instead: smollm2-135m or llama-1b")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --random (default: the default model's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="W2: rounds of one after another and at once, alternating")
    ap.add_argument("--first-run", action="store_true",
                    help="W1 without the warm-up rounds before its concurrent run (the backend's own warm-up only)")
    ap.add_argument("--only", choices=("w1", "w2", "w3"), default=None)
    ap.add_argument("--no-peer", action="store_true", help="skip HF generate (the peer) for a quick run")
    args = ap.parse_args()
    if args.random and args.tokenizer is None:
        from lmq_backend.backend.default_model import default_model_dir

        args.tokenizer = str(default_model_dir())
    t = time.perf_counter()
    backend = backend_for(args)
    made = time.perf_counter() - t
    print(f"backend made in {made:.1f} s (the CPU kernels' warm-up included), load average {os.getloadavg()[0]:.1f}")
    print(f"torch {torch.__version__}, {args.device}, {args.random or args.model}, {args.dtype}, "
          f"fused decode: {backend.runner.fused}"
          + (f", CPU {W.cpu_host()}" if args.device == "cpu" else ""))
    if args.only in (None, "w1"):
        w1(backend, args.calls, args.first_run, not args.no_peer)
    if args.only in (None, "w2"):
        w2(backend, args.rounds, not args.no_peer)
    if args.only in (None, "w3"):
        w3(backend, args.calls // 2, not args.no_peer)


if __name__ == "__main__":
    main()
