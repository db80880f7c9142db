"""LMQL plugin benchmark: the W1 few-shot query written in LMQL, run by LMQL 0.7.3 on

  lmql-hf   LMQL's own transformers backend, `lmql.model("local:<dir>")`: the whole prompt every call
  lmq       `lmql.model("local:lmq:default")` (lmq_backend.lmql.plugin): the prefix trie of KV caches

with the same model (the default SmolLM2-135M folder, no hub), in one run, calls alternating between the
two, both in LMQL's default `local:` mode (the model in a subprocess); prints per-call medians, the ratio
and the answers' agreement (greedy). Then lmq alone in-process (`async_transport=True`, where its trie
statistics can be read; LMQL's transformers backend reloads its model every query in that mode, so it is
not compared there), with one token per call under a choice's mask (lmq's default) and with LMQL's
16-token speculative chunk (`mask_chunk=16`).

    python benchmarks/bench_lmql.py [--calls 10]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmql  # noqa: E402

import lmq_backend  # noqa: E402
import lmq_backend.lmql.plugin as lmq_lmql  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

W1_LMQL = '''
"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ''' + repr(W.W1_OPTIONS) + '''
return CLS
'''


async def timed(query, shots, reviews, times, answers) -> None:
    for review in reviews:
        t = time.perf_counter()
        answers.append(await query(shots=shots, review=review))
        times.append(time.perf_counter() - t)


async def main(calls: int) -> None:
    folder = str(default_model_dir())
    shots, reviews = W.w1_shots(), W.w1_reviews(calls)
    queries = {"lmql-hf": lmql.query(W1_LMQL, model=lmql.model(f"local:{folder}", tokenizer=folder)),
               "lmq": lmql.query(W1_LMQL, model=lmq_lmql.model("default"))}
    for q in queries.values():  # loads the model; for lmq, the shared prefix enters the trie once
        await q(shots=shots, review="warm-up")
    times = {name: [] for name in queries}
    answers = {name: [] for name in queries}
    for i, review in enumerate(reviews):
        order = list(queries) if i % 2 == 0 else list(queries)[::-1]  # alternate: fair under a noisy CPU
        for name in order:
            await timed(queries[name], shots, [review], times[name], answers[name])
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"W1 via LMQL 0.7.3: {calls} calls, a ~{len(shots) // 4}-token prompt of shots + a new review, "
          f"3-way choice; local: (subprocess) mode; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in queries:
        print(f"  {name:8s} median {med[name]:6.3f} s/call   (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    print(f"  speed-up of lmq over LMQL's transformers backend: {med['lmql-hf'] / med['lmq']:.1f}x")
    agree = sum(a == b for a, b in zip(answers["lmql-hf"], answers["lmq"]))
    print(f"  answers agree (greedy): {agree}/{calls}")

    backend = lmq_backend.get_backend("default")
    in_process = {}
    for chunk in (1, 16):  # 16: LMQL's own speculative chunk under a choice's mask (lmq's default is 1)
        q = lmql.query(W1_LMQL, model=lmq_lmql.model("default", async_transport=True, mask_chunk=chunk))
        await q(shots=shots, review="warm-up")
        backend.reset_stats()
        t_in, a_in = [], []
        await timed(q, shots, reviews, t_in, a_in)
        s = backend.stats()
        in_process[chunk] = a_in
        print(f"  lmq in-process, mask_chunk={chunk:2d}: median {statistics.median(t_in):.3f} s/call; trie: "
              f"{s.tokens_reused}/{s.tokens_requested} prompt tokens reused (hit rate {s.token_hit_rate:.1%}), "
              f"{s.tokens_prefilled} prefilled, {s.tokens_decoded} decoded; same answers: {a_in == answers['lmq']}")
    if agree != calls or any(a != answers["lmq"] for a in in_process.values()):
        sys.exit("answers differ")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=10)
    asyncio.run(main(p.parse_args().calls))
