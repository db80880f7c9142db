"""Cache tiers (issue: cache tiers): warm starts from the disk tier, and the host tier under a small device budget.

warm-start (CPU, the default model): W1's ~1,086-token few-shot prompt as a query file, run as `lmq run` runs it
(`lmq_backend.cli.main`) in new processes sharing one disk tier folder:
  cold          the first process: the whole prompt is prefilled (and written to disk)
  new process   the first call of a later process: the prefix comes from disk, only the review is prefilled
  + warmed up   the same after two calls of another few-shot prompt of W1's length (whatever a process's first
                calls still pay once is paid by then; the W1 prefix then goes to store slots past those the
                warm-up filled)
  warm          that process's next call: the prefix is in its device trie
Time to first token = from the call's start to the end of its prefill step (its first token's logits), with the
model loaded before; the call's whole time too. Target: new process <= 1.5x warm.

host (GPU): 64 distinct W1-style prefixes (~1,086 tokens) x 64 calls each, in random order, 8 at a time, with a
device trie budget that holds 8 prefixes; with the host tier (4GB) and without it: token hit rate and q/s; and the
ceiling a host tier could reach, a device trie that holds every prefix (no tier, nothing evicted). Each leg's
steps too: how many prefill and decode steps of how many rows (a prefill step's new and cached tokens and its
mean time), the run's timeline (`bench_concurrency.py`: before the first step, in steps, between them), and the
Triton kernel variants compiled during it (those its warm-up did not meet: a fresh machine's first process
compiles each, inside the timed run). With `--device-ops`, each leg runs its first calls once more under torch's
profiler and prints the device's time by operation (kernels and copies, the largest first).
Random weights of the given shape in bf16 (speed does not depend on weight values).

    python benchmarks/bench_tiers.py warm-start [--runs 3]
    python benchmarks/bench_tiers.py host [--shape llama-1b] [--prefixes 64] [--calls 64] [--concurrency 8]
                                          [--device-ops]
    (--device cpu --shape smollm2-135m --prefixes 4 --calls 3 --held 1 --concurrency 1: a dry run, float32)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_concurrency as BC  # noqa: E402
import workloads as W  # noqa: E402


def query_file(folder: Path, shots: str, name: str = "w1.lmq") -> Path:
    """W1 as a file: the shots inline (a user's few-shot query), the review a --var."""
    path = folder / name
    path.write_text(f'argmax\n    {json.dumps(shots)}\n    "Review: {{review}}\\nSentiment:[CLS]"\nfrom "default"\n'
                    f'where CLS in [" positive", " negative", " neutral"]\n')  # (a JSON string is a query string)
    return path


def child(path: str, warm_up: str, reviews: list[str]) -> None:
    """One process: `lmq run` of `warm_up` (a file; "-": none), then once per review, timed; prints a JSON
    line."""
    import contextlib
    import io

    import lmq_backend as lmq
    from lmq_backend.cli import main

    backend = lmq.get_backend("default")  # the backend `lmq run` uses (loaded here, before the clock starts)
    ends: list[float] = []
    backend.on_step(lambda info: ends.append(time.perf_counter()) if info.kind == "prefill" else None)
    calls = []
    if warm_up != "-":
        with contextlib.redirect_stdout(io.StringIO()):
            for review in W.w1_reviews(2, seed=11):  # reviews of W1's length: the same shapes and paths
                assert main(["run", warm_up, "--var", f"review={review}"]) == 0
    for review in reviews:
        before, n = backend.stats(), len(ends)
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["run", path, "--var", f"review={review}"]) == 0
        done = time.perf_counter()
        s = backend.stats().since(before)
        calls.append({"ttft": ends[n] - started, "call": done - started, "prefilled": s.tokens_prefilled,
                      "from_disk": s.tokens_from_disk, "answer": out.getvalue().strip().splitlines()[-1]})
    print("RESULT " + json.dumps(calls))


def run_child(path: Path, folder: str, reviews: list[str], warm_up: Path | None = None) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, "child", str(path), str(warm_up or "-"), *reviews],
                         capture_output=True, text=True,
                         env={**os.environ, "LMQ_DISK_CACHE": folder}, check=True)
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def warm_start(args) -> None:
    from lmq_kernels import cpu  # noqa: F401 - (the header's CPU line)

    reviews = W.w1_reviews(4 * args.runs + 2, seed=7)
    with tempfile.TemporaryDirectory() as tmp:
        path = query_file(Path(tmp), W.w1_shots())
        warm_up = query_file(Path(tmp), W.w1_shots(seed=5), "warm_up.lmq")
        folder = str(Path(tmp) / "kv")
        cold = run_child(path, folder, reviews[:1])[0]
        runs = [run_child(path, folder, reviews[2 + 4 * i:4 + 4 * i]) for i in range(args.runs)]
        warmed = [run_child(path, folder, reviews[4 + 4 * i:6 + 4 * i], warm_up) for i in range(args.runs)]
        off = run_child(path, "off", reviews[1:2])[0]
    first, warm = [r[0] for r in runs], [r[1] for r in runs + warmed]
    first_warmed = [r[0] for r in warmed]
    med = statistics.median
    print(f"{W.cpu_host()}; W1 prompt as a query file, `lmq run` in new processes; {args.runs} runs")
    print(f"{'':<34} {'TTFT ms':>8} {'call ms':>8} {'prefilled':>9} {'from disk':>9}")
    for name, rows in (("cold (writes the disk tier)", [cold]), ("cold, disk tier off", [off]),
                       ("new process, prefix from disk", first), ("  + warmed up", first_warmed),
                       ("warm (same process, next call)", warm)):
        print(f"{name:<34} {med(r['ttft'] for r in rows) * 1e3:8.1f} {med(r['call'] for r in rows) * 1e3:8.1f} "
              f"{med(r['prefilled'] for r in rows):9.0f} {med(r['from_disk'] for r in rows):9.0f}")
    ratio = med(r["ttft"] for r in first) / med(r["ttft"] for r in warm)
    warmed_ratio = med(r["ttft"] for r in first_warmed) / med(r["ttft"] for r in warm)
    print(f"new process / warm TTFT: {ratio:.2f}x, warmed up {warmed_ratio:.2f}x (target <= 1.5x); "
          f"cold / new process: {cold['ttft'] / med(r['ttft'] for r in first):.1f}x")


def host(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lmq_backend as lmq
    from lmq_backend.backend.default_model import default_model_dir
    from lmq_backend.cache.kv_store import token_bytes

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_dir())
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(W.random_config(args.shape), dtype=dtype).to(args.device).eval()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    prefixes = [W.w1_shots(seed=s) for s in range(args.prefixes)]
    reviews = W.w1_reviews(args.calls, seed=1)
    calls = [{"shots": prefixes[p], "review": reviews[c]} for p in range(args.prefixes) for c in range(args.calls)]
    random.Random(0).shuffle(calls)
    source = W.W1_QUERY.replace('from "default"', 'from "tiers-bench"')

    config = model.config
    per_token = token_bytes(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
    prefix_bytes = len(tokenizer(prefixes[0]).input_ids) * per_token

    def measure(host_cache, held: float = args.held) -> dict:
        budget = int((held + 0.5) * prefix_bytes)  # and the calls' tails
        backend = lmq.HFBackend.from_model(model, tokenizer, cache_budget=budget, name=args.shape,
                                           host_cache=host_cache, kv_budget="8GB" if args.device == "cuda" else "2GB")
        lmq.register_backend("tiers-bench", backend)
        query = lmq.Query(source)
        asyncio.run(query.map(calls[:2 * args.concurrency], concurrency=args.concurrency))  # JIT, graphs
        backend.reset_stats()
        steps, ended = BC.record_steps(backend)
        compiles = BC.triton_compiles()  # (until read)
        sync()
        started = time.perf_counter()
        results = asyncio.run(query.map(calls, concurrency=args.concurrency))
        sync()
        seconds = time.perf_counter() - started
        backend.on_step(None)
        compiled = compiles()
        s = backend.stats()
        tiers = backend.tiers
        bandwidth = None if tiers is None else tiers.bandwidth.get("host")
        ops = device_ops(lambda: asyncio.run(query.map(calls[:8 * args.concurrency], concurrency=args.concurrency))) \
            if args.device_ops else ""  # (after the stats: they are the timed run's)
        backend.close()
        return {"qps": len(calls) / seconds, "seconds": seconds, "bandwidth": bandwidth,
                "hit": s.token_hit_rate, "host_hits": s.host_hits,
                "from_host": s.tokens_from_host, "down": s.bytes_to_host, "up": s.bytes_from_host,
                "evictions": s.evictions, "answers": [r["CLS"] for r in results],
                "steps": steps_line(steps) + "; " + BC.timeline(steps, ended, started, seconds)
                + ("" if compiled is None else f"; Triton kernels compiled in it: {compiled}"), "ops": ops}

    with_host, without, ceiling = measure("4GB"), measure(0), measure(0, held=args.prefixes)
    device = torch.cuda.get_device_name() if args.device == "cuda" else W.cpu_host()
    print(f"{device}, torch {torch.__version__}, {args.shape} {str(dtype)[6:]}, random weights; "
          f"{args.prefixes} prefixes x {args.calls} calls, random order, {args.concurrency} at a time, "
          f"device trie budget: {args.held} prefixes")
    print(f"{'':<16} {'q/s':>8} {'hit rate':>9} {'host hits':>9} {'evictions':>9} {'down GB':>8} {'up GB':>8}")
    legs = (("host tier 4GB", with_host), ("no host tier", without), ("all on device", ceiling))
    for name, r in legs:
        print(f"{name:<16} {r['qps']:8.1f} {r['hit']:9.3f} {r['host_hits']:9d} {r['evictions']:9d} "
              f"{r['down'] / 1e9:8.2f} {r['up'] / 1e9:8.2f}")
    for name, r in legs:
        print(f"# {name}: {r['steps']}")
        if r["ops"]:
            print(f"#   device time by operation ({8 * args.concurrency} calls more): {r['ops']}")
    if with_host["bandwidth"]:
        copying = with_host["up"] / with_host["bandwidth"]
        print(f"host -> device at {with_host['bandwidth'] / 1e9:.1f} GB/s (measured on the tier's first load): "
              f"the loads' {with_host['up'] / 1e9:.1f} GB take {copying:.2f} s of the run's "
              f"{with_host['seconds']:.2f} s")
    same = sum(a == b for a, b in zip(with_host["answers"], without["answers"]))
    print(f"q/s with / without the host tier: {with_host['qps'] / without['qps']:.2f}x (target >= 3x, hit rate "
          f">= 0.95); answers agree on {same}/{len(calls)}")
    print(f"the host tier's ceiling, a device trie that holds every prefix: {ceiling['qps'] / without['qps']:.2f}x "
          f"the run without the tier; the host tier reaches {with_host['qps'] / ceiling['qps']:.2f} of it")


def steps_line(steps: list) -> str:
    """How many steps of each kind ran, and their mean rows (a prefill step's new and cached tokens and time too)."""
    out = []
    for kind in ("prefill", "decode"):
        mine = [step for step in steps if step.kind == kind]
        n = max(len(mine), 1)
        line = f"{len(mine)} {kind} steps of {sum(step.batch_size for step in mine) / n:.1f} rows"
        if kind == "prefill":
            line += (f" ({sum(step.new_tokens for step in mine) / n:.0f} new tokens, "
                     f"{sum(step.cached_tokens for step in mine) / n:.0f} cached, "
                     f"{sum(step.seconds for step in mine) / n * 1e3:.1f} ms a step)")
        out.append(line)
    return ", ".join(out)


def device_ops(run, top: int = 8) -> str:
    """The device's time while `run()` runs (`bench_concurrency.device_times`): the total and the `top` largest
    operations."""
    ops = BC.device_times(run)
    total = sum(t for t, _ in ops)
    shown = "; ".join(f"{name[:48]} {t / 1e3:.0f} ms" for t, name in ops[:top] if t > 0)
    return f"{total / 1e3:.0f} ms in all: {shown}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="workload", required=True)
    ws = sub.add_parser("warm-start")
    ws.add_argument("--runs", type=int, default=3)
    ws.set_defaults(func=warm_start)
    h = sub.add_parser("host")
    h.add_argument("--shape", default="llama-1b")
    h.add_argument("--tokenizer", default=None)
    h.add_argument("--prefixes", type=int, default=64)
    h.add_argument("--calls", type=int, default=64)
    h.add_argument("--concurrency", type=int, default=8)
    h.add_argument("--held", type=int, default=8, help="prefixes the device trie's budget holds")
    h.add_argument("--device", default="cuda")
    h.add_argument("--device-ops", action="store_true",
                   help="each leg's first calls once more under the profiler: the device's time by operation (GPU)")
    h.set_defaults(func=host)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
