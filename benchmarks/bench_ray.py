"""lmq over Ray: a few-shot workload of N calls on 2 replicas against 1 replica: throughput, token
hit rate, and what routing and Ray cost per call.

Workload: W1's query (workloads.py) with `--tasks` different few-shot prefixes (`--shots` labeled reviews
each, ~1,100 tokens at 40: one per seed of `w1_shots`); call i takes prefix i % tasks and its own review.
The calls run as one batch job (`Cluster.map`: grouped by prefix, chunks of 8, 64 calls in flight); each
configuration starts cold. 1 replica: one Ray actor with `--cores` CPUs; 2 replicas: two with cores/2 each.
`--in-process` adds the same calls on one HFBackend in this process.

Per-call costs, measured apart from the model's compute:
- router: the router's own work per call (the call's prompt text, its match against each replica's tree,
  the insert), over the workload's texts;
- dispatch: a query without holes (its text is tokenized, no forward) on the 1-replica cluster against the
  same query in-process, one call at a time and as a batch job: the difference is what Ray and routing add.

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
NO_HOLE = lmq.compile('''argmax
    "{shots}Review: {review}\\nSentiment:"
''', name="no-hole")
OPTIONS = dict(device="cpu", dtype="float32", cache_budget="4GB", kv_budget="3GB")


def workload(n: int, tasks: int, n_shots: int = 40) -> list[dict]:
    shots = [W.w1_shots(n_shots, seed=t) for t in range(tasks)]
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
    backend = lmq.HFBackend("default", **OPTIONS)
    t = time.perf_counter()
    results = asyncio.run(_map_in_process(QUERY, inputs, backend))
    return time.perf_counter() - t, backend.stats().token_hit_rate, [r.variables["CLS"] for r in results]


async def _map_in_process(query, inputs: list[dict], backend, concurrency: int = 64) -> list:
    slots = asyncio.Semaphore(concurrency)

    async def one(x):
        async with slots:
            return await query.run(dict(x), backend)

    return await asyncio.gather(*(one(x) for x in inputs))


def dispatch_overhead(cluster, inputs: list[dict], sequential: int = 200) -> dict[str, float]:
    """ms per call of a query without holes (its text is tokenized, no model forward), in-process vs on a
    1-replica cluster: one call at a time (latency), and `len(inputs)` calls as one batch job (amortized)."""
    backend = lmq.HFBackend("default", **OPTIONS)

    async def seq_local():
        for x in inputs[:sequential]:
            await NO_HOLE.run(dict(x), backend)

    async def seq_cluster():
        for x in inputs[:sequential]:
            await cluster.run(NO_HOLE, **x)

    out = {}
    for name, make in (("in-process, one at a time", seq_local), ("cluster, one at a time", seq_cluster),
                       ("in-process, batch job", lambda: _map_in_process(NO_HOLE, inputs, backend)),
                       ("cluster, batch job", lambda: cluster.map(NO_HOLE, inputs))):
        asyncio.run(make())  # warm: the query reaches the replica, the texts are in the trie's tokenizer path
        t = time.perf_counter()
        asyncio.run(make())
        n = min(sequential, len(inputs)) if "one at a time" in name else len(inputs)
        out[name] = 1000 * (time.perf_counter() - t) / n
    return out


def on_cluster(inputs: list[dict], replicas: int, cores: int, overhead: bool):
    from lmq_backend.distributed import Cluster, sum_stats
    from lmq_backend.distributed.router import RouteCounts

    cluster = Cluster("default", replicas=replicas, num_cpus=cores // replicas, **OPTIONS)
    try:
        cluster.wait_ready()
        costs = dispatch_overhead(cluster, inputs) if overhead else {}
        # warm the processes (first forwards, kernel choices), not the caches: a prompt of its own
        warm = [{"shots": f"Warm-up {i}.\n", "review": "fine."} for i in range(2 * replicas)]
        asyncio.run(cluster.map(QUERY, warm, chunk_size=1))
        cluster.reset_stats()
        cluster.router.counts = RouteCounts()
        t = time.perf_counter()
        results = asyncio.run(cluster.map(QUERY, inputs, progress=True))
        seconds = time.perf_counter() - t
        stats = cluster.replica_stats()
        total = sum_stats(list(stats.values()))
        per = [f"{s.calls} calls {100 * s.token_hit_rate:.1f}%" for s in stats.values()]
        c = cluster.router.counts
        routes = f"prefix {c.prefix}, smallest tree {c.smallest_tree}, least loaded {c.least_loaded}"
        if cluster.lost:
            routes += f"; {cluster.retries} calls run again after: {'; '.join(cluster.lost)}"
        return seconds, total.token_hit_rate, [r.variables["CLS"] for r in results], per, routes, costs
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=4, help="distinct few-shot prefixes")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--shots", type=int, default=40, help="labeled reviews per prefix")
    parser.add_argument("--in-process", action="store_true", help="also run the workload in this process")
    args = parser.parse_args()
    import ray

    inputs = workload(args.n, args.tasks, args.shots)
    print(f"host {platform.node()} {platform.machine()}, {os.cpu_count()} cores; ray {ray.__version__}; "
          f"N={args.n}, {args.tasks} prefixes")
    print(f"router work per call: {1000 * router_cost(inputs, 2):.3f} ms (2 replicas)")
    rows, answers = [], {}
    if args.in_process:
        s, hit, answers["in-process"] = in_process(inputs)
        rows.append(("in-process", s, hit, "", ""))
    ray.init(num_cpus=args.cores, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    for replicas in (1, 2):
        s, hit, answers[f"{replicas} replica"], per, routes, costs = on_cluster(inputs, replicas, args.cores,
                                                                               overhead=replicas == 1)
        rows.append((f"{replicas} replica{'s' if replicas > 1 else ''}", s, hit, "; ".join(per), routes))
        for name, ms in costs.items():
            print(f"dispatch, query without holes: {name:<28} {ms:7.2f} ms/call")
    ray.shutdown()
    print(f"{'run':<12} {'seconds':>8} {'calls/s':>8} {'hit rate':>9}  per replica / routes")
    for name, s, hit, per, routes in rows:
        print(f"{name:<12} {s:8.1f} {args.n / s:8.2f} {100 * hit:8.1f}%  {per}  {routes}")
    first = next(iter(answers.values()))
    print("answers identical across runs:", all(a == first for a in answers.values()))


if __name__ == "__main__":
    main()
