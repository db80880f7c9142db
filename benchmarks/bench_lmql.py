"""LMQL plugin benchmark (issue #7): the W1 few-shot query written in LMQL, run by LMQL 0.7.3 on

  lmql-hf   LMQL's own transformers backend, `lmql.model("local:<dir>")`: the whole prompt every call
  lmq       `lmql.model("local:lmq:default")` (lmq_backend.lmql_plugin): the prefix trie of KV caches

with the same model (the default SmolLM2-135M folder, no hub), in one run, calls alternating between the
two; prints per-call medians, the ratio, the answers' agreement (greedy) and lmq's trie statistics.

    python benchmarks/bench_lmql.py [--calls 10] [--subprocess]

By default both run in-process (`async_transport=True`), so lmq's statistics can be read; --subprocess
uses LMQL's default `local:` mode (the model in a subprocess; no statistics then).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmql  # noqa: E402

import lmq_backend  # noqa: E402
import lmq_backend.lmql_plugin as lmq_lmql  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

W1_LMQL = '''
"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ''' + repr(W.W1_OPTIONS) + '''
return CLS
'''


async def main(calls: int, subprocess: bool) -> None:
    folder = str(default_model_dir())
    mode = {} if subprocess else {"async_transport": True}
    models = {"lmql-hf": lmql.model(f"local:{folder}", tokenizer=folder, **mode),
              "lmq": lmq_lmql.model("default", **mode)}
    queries = {name: lmql.query(W1_LMQL, model=m) for name, m in models.items()}
    shots, reviews = W.w1_shots(), W.w1_reviews(calls)
    for q in queries.values():  # loads the model; for lmq, the shared prefix enters the trie once
        await q(shots=shots, review="warm-up")
    if not subprocess:
        lmq_backend.get_backend("default").reset_stats()
    times = {name: [] for name in queries}
    answers = {name: [] for name in queries}
    for i, review in enumerate(reviews):
        order = list(queries) if i % 2 == 0 else list(queries)[::-1]  # alternate: fair under a noisy CPU
        for name in order:
            t = time.perf_counter()
            answers[name].append(await queries[name](shots=shots, review=review))
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"W1 via LMQL 0.7.3, {calls} calls, ~{len(shots) // 4} tokens of shots, "
          f"{'subprocess' if subprocess else 'in-process'} mode")
    for name in queries:
        print(f"  {name:8s} median {med[name]:6.3f} s/call   (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    print(f"  speed-up lmq vs LMQL's transformers backend: {med['lmql-hf'] / med['lmq']:.1f}x")
    agree = sum(a == b for a, b in zip(answers["lmql-hf"], answers["lmq"]))
    print(f"  answers agree (greedy): {agree}/{calls}   {answers['lmq']}")
    if not subprocess:
        s = lmq_backend.get_backend("default").stats()
        print(f"  lmq trie: {s.tokens_reused}/{s.tokens_requested} prompt tokens reused "
              f"(hit rate {s.token_hit_rate:.1%}), {s.tokens_prefilled} prefilled, {s.tokens_decoded} decoded")
    if agree != calls:
        sys.exit("answers differ")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--subprocess", action="store_true", help="LMQL's default local: mode (model in a subprocess)")
    a = p.parse_args()
    asyncio.run(main(a.calls, a.subprocess))
