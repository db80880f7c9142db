"""lmq over Ray (issue #17): a few-shot workload of N calls on 2 replicas against 1 replica, and the same calls
in-process: throughput, token hit rate, and what routing costs per call.

Workload: W1's query (workloads.py) with `--tasks` different 40-shot prefixes (~1,100 tokens each: one per
seed of `w1_shots`), call i taking prefix i % tasks and its own review; the calls run as one batch job
(`Cluster.map`: grouped by prefix, chunks of 8, 64 calls in flight). Each configuration starts cold.

- in-process: one HFBackend in this process (torch threads: all cores), `Query.map` with 64 in flight.
- 1 replica: one Ray actor with `--cores` CPUs; 2 replicas: two actors with cores/2 each.
- router: the router's own work per call (rendering the call's prompt text, matching it against each
  replica's tree, inserting it), timed alone over the workload's texts.
- Ray's per-call overhead: (1-replica time - in-process time) / N.

    python benchmarks/bench_ray.py --n 2000            # the default model, float32, on the CPU
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402

QUERY = lmq.compile(W.W1_QUERY, name="w1")
OPTIONS = dict(device="cpu", dtype="float32", cache_budget="4GB", kv_budget="3GB")


def workload(n: int, tasks: int) -> list[dict]:
    shots = [W.w1_shots(40, seed=t) for t in range(tasks)]
    reviews = W.w1_reviews(n, seed=1)
    return [{"shots": shots[i % tasks], "review": f"{reviews[i]} (visit {i})"} for i in range(n)]


def router_cost(inputs: list[dict], replicas: int) -> float:
    """Seconds per call of the router's own work (prompt text, tree match for each replica, insert)."""
    from lmq_backend.distributed.render import prompt_prefix
    from lmq_backend.distributed.router import Router

    router = Router()
    for r in range(replicas):
        router.add(r)
    t = time.perf_counter()
    for x in inputs:
        r = router.choose(prompt_prefix(QUERY, x))
        router.finished(r)
    return (time.perf_counter() - t) / len(inputs)


def in_process(inputs: list[dict]) -> tuple[float, float, list]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    backend = lmq.HFBackend("default", **OPTIONS)
    QUERY.model = backend
    t = time.perf_counter()
    results = asyncio.run(QUERY.map(inputs, concurrency=64))
    seconds = time.perf_counter() - t
    hit = backend.stats().token_hit_rate
    QUERY.model = "default"
    del backend
    return seconds, hit, [r.variables["CLS"] for r in results]


def on_cluster(inputs: list[dict], replicas: int, cores: int) -> tuple[float, float, list, list, str]:
    from lmq_backend.distributed import Cluster, sum_stats

    cluster = Cluster("default", replicas=replicas, num_cpus=cores // replicas, **OPTIONS)
    try:
        cluster.wait_ready()
        t = time.perf_counter()
        results = asyncio.run(cluster.map(QUERY, inputs, progress=True))
        seconds = time.perf_counter() - t
        stats = cluster.replica_stats()
        total = sum_stats(list(stats.values()))
        per = [f"{s.calls} calls {100 * s.token_hit_rate:.1f}%" for s in stats.values()]
        c = cluster.router.counts
        routes = f"prefix {c.prefix}, smallest tree {c.smallest_tree}, least loaded {c.least_loaded}"
        return seconds, total.token_hit_rate, [r.variables["CLS"] for r in results], per, routes
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=4, help="distinct few-shot prefixes")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args()
    import ray

    inputs = workload(args.n, args.tasks)
    print(f"host {platform.node()} {platform.machine()}, {os.cpu_count()} cores; ray {ray.__version__}; "
          f"N={args.n}, {args.tasks} prefixes")
    print(f"router work per call: {1000 * router_cost(inputs, 2):.3f} ms (2 replicas)")
    rows, answers = [], {}
    if not args.skip_in_process:
        s, hit, answers["in-process"] = in_process(inputs)
        rows.append(("in-process", s, hit, "", ""))
    ray.init(num_cpus=args.cores, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    for replicas in (1, 2):
        s, hit, answers[f"{replicas} replica"], per, routes = on_cluster(inputs, replicas, args.cores)
        rows.append((f"{replicas} replica{'s' if replicas > 1 else ''}", s, hit, "; ".join(per), routes))
    ray.shutdown()
    print(f"{'run':<12} {'seconds':>8} {'calls/s':>8} {'hit rate':>9}  per replica / routes")
    for name, s, hit, per, routes in rows:
        print(f"{name:<12} {s:8.1f} {args.n / s:8.2f} {100 * hit:8.1f}%  {per}  {routes}")
    first = next(iter(answers.values()))
    print("answers identical across runs:", all(a == first for a in answers.values()))
    if "in-process" in answers:
        one = next(r for r in rows if r[0] == "1 replica")
        print(f"Ray per-call overhead, 1 replica vs in-process: {1000 * (one[1] - rows[0][1]) / args.n:.2f} ms")


if __name__ == "__main__":
    main()
