"""A query's host work at N concurrent calls, with the model's share taken out.

On a GPU, lmq's N = 1,024 round is host-bound: the device's work is well under half of the round
(benchmarks/RESULTS.md). This measures the host's part where it can be measured
alone, on the CPU: `bench_concurrency.py`'s query and texts (a ~1,060-token shared few-shot prefix, each
call's own review, a hole of up to 16 tokens), the default model's tokenizer, and a random-weight Llama of
one small layer (head dim 64, so that lmq's C decode attention runs: what remains of the model is small).
Timers around the runner's model calls (`ModelRunner.decode`, `.prefill`, `.sample`) and the greedy picks
(`picks_cpu`' masked argmax, which a GPU step makes on the device) take the model's share out; the rest of a round,
divided by N, is the host's work a query: the interpreter, tokenizing the new tail, the trie, admission, the
steps' bookkeeping, the hole loop's checks and plans, results. The cyclic collector's time in the round
(`gc.callbacks`) is shown apart (counted wherever it ran: mostly inside the rest, some inside the model's calls).
The same share in the main thread's CPU time (`time.thread_time`, the round's less the model calls') is shown too:
on a machine other processes share, it moves far less than the wall-clock time, which counts the waits for a core.
With `--calls`, one more round under cProfile counts the Python function calls a query (all of them, and those of
lmq's own modules): a count does not drift with the host's speed, so two trees compare on any machine.

    python benchmarks/bench_host.py [--n 256 1024] [--rounds 3] [--where 'STOPS_AT(S, "x")'] [--sample] [--calls]

Medians over --rounds timed rounds after a warm-up round of the same N (each round its own texts).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_concurrency as BC  # noqa: E402

import lmq_backend as lmq  # noqa: E402
from lmq_backend.engine import runner as runner_module  # noqa: E402
from lmq_backend.engine import picks_cpu  # noqa: E402

SPENT: Counter = Counter()


def timed(cls, name: str, key: str) -> None:
    """Add the seconds `cls.name` takes to SPENT[key], the main thread's CPU seconds in it to SPENT[f"{key} cpu"]
    (calls nested in another timed one count once)."""
    f = getattr(cls, name)

    def wrapper(*args, **kwargs):
        if SPENT["depth"]:
            return f(*args, **kwargs)
        SPENT["depth"] += 1
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - t
            SPENT[key + " cpu"] += time.thread_time() - cpu
            SPENT["depth"] -= 1
    setattr(cls, name, wrapper)


def collector_seconds(phase: str, info: dict, started: list[float] = [0.0]) -> None:  # noqa: B006
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        SPENT["gc"] += time.perf_counter() - started[0]


def tiny_backend():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lmq_backend.backend.default_model import default_model_dir

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    return lmq.HFBackend.from_model(model, tokenizer, cache_budget="8GB", name="tiny", max_batch=256)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--where", default="", help="a constraint on S besides its length")
    ap.add_argument("--sample", action="store_true", help="sample(temperature=0.8) instead of argmax")
    ap.add_argument("--workload", choices=["counter", "varied", "mix"], default="counter",
                    help="bench_concurrency.py's workloads")
    ap.add_argument("--calls", action="store_true", help="also count the Python calls a query (one more round)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    backend = tiny_backend()
    lmq.register_backend("bench", backend)
    queries = [lmq.compile(BC.QUERY.format(decoder="sample(temperature=0.8)" if args.sample else "argmax", line=line,
                                           where=f" and {args.where}" if args.where else "") + 'from "bench"\n')
               for _, line in (BC.TEMPLATES if args.workload == "mix" else BC.TEMPLATES[:1])]
    for name in ("decode", "prefill", "sample"):
        timed(runner_module.ModelRunner, name, "model")
    timed(picks_cpu, "masked_argmax", "model")  # the CPU's greedy picks (a GPU step makes them on the device)
    gc.callbacks.append(collector_seconds)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}; {'sampled' if args.sample else 'greedy'}"
          f"{', where ' + args.where if args.where else ''}; medians of {args.rounds} rounds")
    counted = " Python calls a query | of them lmq's |" if args.calls else ""
    print(f"| N | round | model | host a query | of which the collector | host CPU a query (main thread) |{counted}")
    print("|---|---|---|---|---|---|" + "---|---|" * args.calls)
    start = 0
    for n in args.n:
        calls = BC.workload_calls(args.workload, (args.rounds + 1 + args.calls) * n, start)
        start += (args.rounds + 1 + args.calls) * n
        asyncio.run(BC.run_n(queries, calls[:n]))
        rounds = []
        for r in range(1, args.rounds + 1):
            SPENT.clear()
            cpu = time.thread_time()
            seconds = asyncio.run(BC.run_n(queries, calls[r * n:(r + 1) * n]))
            cpu = time.thread_time() - cpu - SPENT["model cpu"]
            rounds.append((seconds, SPENT["model"], (seconds - SPENT["model"]) / n, SPENT["gc"] / n, cpu / n))
        total, model, host, collector, host_cpu = (statistics.median(x) for x in zip(*rounds))
        if args.calls:
            everything, own = python_calls(queries, calls[-n:])
            counted = f" {everything / n:,.0f} | {own / n:,.0f} |"
        print(f"| {n} | {total:.3f} s | {model:.3f} s | {host * 1e6:.0f} us | {collector * 1e6:.0f} us | "
              f"{host_cpu * 1e6:.0f} us |{counted}")


def python_calls(queries, calls) -> tuple[int, int]:
    """The Python function calls of one round of `calls` under cProfile: (all of them, those of lmq's modules)."""
    profile = cProfile.Profile()
    profile.enable()
    asyncio.run(BC.run_n(queries, calls))
    profile.disable()
    profile.create_stats()
    own = os.sep + "lmq_backend" + os.sep
    return (sum(n for _, n, *_ in profile.stats.values()),
            sum(n for (path, *_), (_, n, *_) in profile.stats.items() if own in path))


if __name__ == "__main__":
    main()
