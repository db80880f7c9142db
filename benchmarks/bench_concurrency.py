"""N concurrent few-shot queries: throughput, K/V memory at peak against the K/V of the
unique tokens, against plain HF `generate` on one left-padded batch of the same texts.

Workloads (`--workload`), each call a hole of up to 16 free tokens after its prompt; all N calls at once
(`asyncio.gather`), after a warm-up round of the same N with other texts:
  counter  one compiled query, a ~1,060-token shared few-shot prefix, each call's own ~25-token review (one
           text with a 6-digit counter)
  varied   the same query and prefix, each call's review of its own length and wording (about 12 to 110
           tokens: `workloads.varied_reviews`)
  mix      four queries with prefixes of their own (few-shot summaries, a support system prompt, few-shot
           sentiment, few-shot translation: `workloads.MIX_TEMPLATES`), drawn at random per call, varied reviews
With `--gpu-time`, one more round of the same N under torch's profiler sums the device's kernel and copy time:
GPU ms a round, and the GPU's idle time a query (the unprofiled round's time less that, over N: the host's work
the device waits for). Every run prints the timed round's timeline from the engine's steps (`on_step`): the time
before its first step began (the queries' first turns: rendering, tokenizing, submitting), in the steps (from a
step's start to its results taken: the device's work and the host's around it), and between them and after the
last (the queries' turns, looking up and choosing the next prefills).

    GPU: python benchmarks/bench_concurrency.py --tokenizer DIR --shape llama-1b --n 64 256 1024
         python benchmarks/bench_concurrency.py --tokenizer DIR --n 1024 --workload mix --gpu-time --hf
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
    {line} where len(TOKENS(S)) < 17{where}
'''
TEMPLATES = W.MIX_TEMPLATES   # (counter and varied: the first alone)


def reviews(n: int, start: int = 0) -> list[str]:
    """n calls' reviews, numbered from `start` (each row of a run its own numbers: a repeated N must not
    find its calls' whole prompts in the trie), the numbers all 6 digits wide (the default tokenizer spells
    a digit a token: a call at N=1,024 would otherwise carry one or two more tokens than at 64)."""
    base = W.w1_reviews(20)
    return [f"{base[i % len(base)]} (visit {i:06d})" for i in range(start, start + n)]


def workload_calls(workload: str, n: int, start: int) -> list[tuple[int, dict]]:
    """n calls of `workload`: (query index, inputs), `start` making them differ from other rounds'."""
    if workload == "counter":
        return [(0, {"prefix": W.w1_shots(40), "review": r}) for r in reviews(n, start)]
    if workload == "varied":
        return [(0, {"prefix": W.w1_shots(40), "review": r}) for r in W.varied_reviews(n, seed=start)]
    return W.mix_calls(n, seed=start)


def prompt_of(call: tuple[int, dict]) -> str:
    """The text a call's prompt renders to (for HF generate and the token counts)."""
    line = TEMPLATES[call[0]][1]
    return line[1:line.index("[S]")].replace("\\n", "\n").format(**call[1])


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


async def run_n(queries, calls: list[tuple[int, dict]]) -> float:
    t = time.perf_counter()
    results = await asyncio.gather(*(queries[q](**inputs) for q, inputs in calls))
    assert len(results) == len(calls)
    return time.perf_counter() - t


def device_times(run) -> list[tuple[float, str]]:
    """The device's time while `run()` runs, by operation (torch's profiler, CUDA activity only: kernels and
    copies): (microseconds, name) pairs, the largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted(((getattr(e, "self_device_time_total", 0), e.key) for e in prof.key_averages()), reverse=True)


def device_seconds(run) -> float:
    """The device's kernel and copy time while `run()` runs."""
    return sum(t for t, _ in device_times(run)) / 1e6


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


def record_steps(backend) -> tuple[list, list[float]]:
    """The engine's steps from now on (`StepInfo`s) and when each was reported (`time.perf_counter()`), as
    `timeline` reads them; `backend.on_step(None)` stops the recording."""
    steps, ended = [], []
    backend.on_step(lambda step: (steps.append(step), ended.append(time.perf_counter())))
    return steps, ended


def triton_compiles():
    """Count the Triton kernel variants compiled (or loaded from Triton's disk cache) in this process from now on:
    returns a function that stops counting (the hook there before is back) and gives the count (None where this
    Triton has no hook for it). A timed run that meets variants its warm-up did not pays for them (a fresh
    machine's first process compiles each)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        before = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return lambda: None
    count = [0]

    def hook(*args, **kwargs):
        count[0] += 1
        return before(*args, **kwargs) if before else None

    def stop() -> int:
        if runtime.jit_post_compile_hook is hook:
            runtime.jit_post_compile_hook = before
        return count[0]
    runtime.jit_post_compile_hook = hook
    return stop


def timeline(steps: list, ended: list[float], began: float, seconds: float) -> str:
    """Where a round's wall time went, from its steps (`StepInfo`s, each reported at `ended`, the round
    having begun at `began` and lasted `seconds`): before the first step, in prefill and decode steps, between
    steps and after the last."""
    if not steps:
        return "no steps"
    starts = [end - info.seconds for info, end in zip(steps, ended)]
    inside = {kind: sum(info.seconds for info in steps if info.kind == kind) for kind in ("prefill", "decode")}
    between = sum(max(0.0, start - end) for start, end in zip(starts[1:], ended))
    after = max(0.0, began + seconds - ended[-1])
    return (f"timeline: first step at {(starts[0] - began) * 1e3:.0f} ms; in prefill steps "
            f"{inside['prefill'] * 1e3:.0f} ms, decode steps {inside['decode'] * 1e3:.0f} ms; between steps "
            f"{between * 1e3:.0f} ms, after the last {after * 1e3:.0f} ms (of {seconds * 1e3:.0f} ms)")


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
    ap.add_argument("--workload", choices=["counter", "varied", "mix"], default="counter")
    ap.add_argument("--gpu-time", action="store_true", help="one more round under the profiler: GPU ms a round")
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
    decoder = f"sample(temperature=0.8{nucleus})" if args.sample else "argmax"
    where = f" and {args.where}" if args.where else ""
    queries = [lmq.compile(QUERY.format(decoder=decoder, line=line, where=where) + 'from "bench"\n')
               for _, line in (TEMPLATES if args.workload == "mix" else TEMPLATES[:1])]
    store = backend.store
    per_token = store.bytes_per_token
    print(f"# {name} on {device}, workload {args.workload}, {'sampled' + nucleus if args.sample else 'greedy'}"
          f"{', where ' + args.where if args.where else ''}, max_batch {args.max_batch}, "
          f"store {store.capacity * per_token / 1e9:.1f} GB ({store.capacity} slots)")
    gpu_cols = " GPU ms a round | GPU idle a query |" if args.gpu_time else ""
    print(f"| N | time | queries/s | K/V at peak | K/V of unique tokens | ratio | HF generate q/s | RSS growth |{gpu_cols}")
    print("|---|---|---|---|---|---|---|---|" + "---|---|" * args.gpu_time)
    start, seen = 0, set()
    for n in args.n:
        calls = workload_calls(args.workload, 3 * n, start)
        start += 3 * n
        warm, timed, profiled = calls[:n], calls[n:2 * n], calls[2 * n:]
        store.peak_used = store.used_slots
        before = store.used_slots
        asyncio.run(run_n(queries, warm))         # warm-up: same N, fills the trie with the prefixes
        ahead = run_ahead(backend)
        steps, ended = record_steps(backend)
        began = time.perf_counter()
        seconds = asyncio.run(run_n(queries, timed))
        backend.on_step(None)
        ahead = [b - a for a, b in zip(ahead, run_ahead(backend))]
        # every token that was live: each prefix once, each call's own part and answer (the trie keeps them)
        prefixes = {c[1]["prefix"] for c in warm + timed} - seen
        seen |= prefixes
        own = sum(len(tokenizer.encode(prompt_of(c))) - len(tokenizer.encode(c[1]["prefix"])) + 16
                  for c in warm + timed)
        unique = (sum(len(tokenizer.encode(p)) for p in prefixes) + own) * per_token
        store.peak_used -= before
        peak = store.peak_used * per_token
        hf = ""
        if args.hf:
            prompts = [prompt_of(c) for c in timed]
            hf = f"{n / hf_generate(plain, tokenizer, prompts, device, args.hf_chunk, args.sample):.0f}"
        gpu = ""
        if args.gpu_time:
            busy = device_seconds(lambda: asyncio.run(run_n(queries, profiled)))
            gpu = f" {busy * 1e3:.0f} | {max(seconds - busy, 0) / n * 1e6:.0f} us |"
        print(f"| {n} | {seconds:.2f} s | {n / seconds:.0f} | {peak / 1e9:.3f} GB | {unique / 1e9:.3f} GB | "
              f"{peak / unique:.2f} | {hf} | {rss_gb() - rss0:.2f} GB |{gpu}", flush=True)
        prefills = [s.batch_size for s in steps if s.kind == "prefill"]  # (the timed round's steps)
        print(f"#   {len(steps) - len(prefills)} decode steps, {len(prefills)} prefill steps (rows: at most "
              f"{max(prefills, default=0)}, median {sorted(prefills)[len(prefills) // 2] if prefills else 0})"
              + (f"; run-ahead steps launched {ahead[0]}, taken {ahead[1]}" if ahead[0] else ""), flush=True)
        print("#   " + timeline(steps, ended, began, seconds), flush=True)
    s = backend.stats()
    print(f"# hit rate {s.token_hit_rate:.3f}, trie {s.bytes_in_use / 1e9:.2f} GB in {s.nodes} nodes, "
          f"evictions {s.evictions}")


if __name__ == "__main__":
    main()
