"""LMQL plugin benchmark: the W1 few-shot query written in LMQL, run by LMQL 0.7.3 on

  lmq       `lmql.model("local:lmq:default")` (lmq_backend.lmql): the prefix trie of KV caches, in lmq's model
            process (LMQL's default `local:` mode)
  own       the same query in lmq's own language (benchmarks/workloads.py W1_QUERY), in this process
  lmql-hf   LMQL's own transformers backend, `lmql.model("local:<dir>")`: the whole prompt every call (the peer;
            `--no-peer` leaves it out)

with the same model (the default SmolLM2-135M folder, no hub), in one run, calls alternating between them;
prints per-call medians, lmq's ratio to lmq's own language, the same for
`--gathered` calls at once (amortized), and the answers' agreement (greedy). Then lmq alone in-process
(`async_transport=True`, where its trie statistics can be read), with one token per call under a choice's
mask (lmq's default) and with LMQL's 16-token speculative chunk (`mask_chunk=16`). Last, LMQL's own floor:
the same query and calls against a `local:lmq:default` model process that answers every call at once (its
first allowed token, no model work), one at a time and gathered: LMQL's client alone.

    python benchmarks/bench_lmql.py [--calls 10] [--gathered 20] [--no-peer]
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
import torch  # noqa: E402

import lmq_backend  # noqa: E402
import lmq_backend.lmql.plugin as lmq_lmql  # noqa: E402
import lmq_backend.lmql.process as lmq_process  # noqa: E402
from lmq_backend.backend.default_model import default_model_dir  # noqa: E402

W1_LMQL = '''
"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in ''' + repr(W.W1_OPTIONS) + '''
return CLS
'''


async def main(calls: int, gathered: int, peer: bool) -> None:
    folder = str(default_model_dir())
    shots, reviews = W.w1_shots(), W.w1_reviews(calls)
    own_query = lmq_backend.Query(W.W1_QUERY, model=lmq_backend.get_backend("default"))

    async def own(**inputs):
        return (await own_query.run(inputs)).variables["CLS"]

    queries = {"lmq": lmql.query(W1_LMQL, model=lmql.model("local:lmq:default")), "own": own}
    if peer:
        queries["lmql-hf"] = lmql.query(W1_LMQL, model=lmql.model(f"local:{folder}", tokenizer=folder))
    for q in queries.values():  # loads the models; the shared prefix enters the tries once
        for warm in ("warm-up", "warm-up again"):
            await q(shots=shots, review=warm)
    times = {name: [] for name in queries}
    answers = {name: [] for name in queries}
    for i, review in enumerate(reviews):
        order = list(queries)[i % len(queries):] + list(queries)[:i % len(queries)]  # rotate: fair under noise
        for name in order:
            t = time.perf_counter()
            answers[name].append(await queries[name](shots=shots, review=review))
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"W1 via LMQL 0.7.3: {calls} calls, a ~{len(shots) // 4}-token prompt of shots + a new review, 3-way "
          f"choice; torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    for name in queries:
        print(f"  {name:8s} median {med[name]:6.3f} s/call   (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    print(f"  lmq (LMQL) / lmq's own language, per call: {med['lmq'] / med['own']:.2f}x")
    if peer:
        print(f"  speed-up of lmq over LMQL's transformers backend: {med['lmql-hf'] / med['lmq']:.1f}x")
        agree = sum(a == b for a, b in zip(answers["lmql-hf"], answers["lmq"]))
        print(f"  answers agree with LMQL's transformers backend (greedy): {agree}/{calls}")
    print(f"  answers agree with lmq's own language: {sum(a == b for a, b in zip(answers['own'], answers['lmq']))}"
          f"/{calls}")

    if gathered:
        at_once = {}
        for k, name in enumerate(("lmq", "own", "lmq", "own")):  # each side twice, new reviews each time
            batch = W.w1_reviews(gathered, seed=20 + k)
            t = time.perf_counter()
            await asyncio.gather(*(queries[name](shots=shots, review=r) for r in batch))
            at_once.setdefault(name, []).append((time.perf_counter() - t) / gathered)
        lm, ow = min(at_once["lmq"]), min(at_once["own"])
        print(f"  {gathered} calls at once, s/call amortized (best of 2): lmq (LMQL) {lm:.4f}, own {ow:.4f}: "
              f"{lm / ow:.2f}x")

    backend = lmq_backend.get_backend("default")
    in_process = {}
    for chunk in (1, 16):  # 16: LMQL's own speculative chunk under a choice's mask (lmq's default is 1)
        q = lmql.query(W1_LMQL, model=lmq_lmql.model("default", async_transport=True, mask_chunk=chunk))
        await q(shots=shots, review="warm-up")
        backend.reset_stats()
        t_in, a_in = [], []
        for review in reviews:
            t = time.perf_counter()
            a_in.append(await q(shots=shots, review=review))
            t_in.append(time.perf_counter() - t)
        s = backend.stats()
        in_process[chunk] = a_in
        print(f"  lmq in-process, mask_chunk={chunk:2d}: median {statistics.median(t_in):.3f} s/call; trie: "
              f"{s.tokens_reused}/{s.tokens_requested} prompt tokens reused (hit rate {s.token_hit_rate:.1%}), "
              f"{s.tokens_prefilled} prefilled, {s.tokens_decoded} decoded; same answers: {a_in == answers['lmq']}")
    await client_floor(shots, reviews, gathered, med["own"])
    print(f"  load average at the end {os.getloadavg()[0]:.1f}")
    if (peer and answers["lmql-hf"] != answers["lmq"]) or any(a != answers["lmq"] for a in in_process.values()):
        sys.exit("answers differ")


async def client_floor(shots: str, reviews: list[str], gathered: int, own: float) -> None:
    """LMQL's client alone: the W1 calls through `local:lmq:default` whose every GENERATE is answered at once
    with its most-biased token (the model process is asked nothing else either)."""

    async def instant(self, cmd: str, payload: dict, until_first: bool = False):
        if cmd == "GENERATE":
            bias = payload.get("logit_bias") or {0: 0.0}
            token = max(bias, key=bias.get)
            yield {"token": token, "logprob": 0.0, "finish_reason": "length", "top_logprobs": {token: 0.0}}
        elif cmd == "SCORE":
            for j, t in enumerate(payload["scored"]):
                yield {"token": t, "logprob": 0.0, "finish_reason": "stop" if j == len(payload["scored"]) - 1 else None}
        else:
            async for item in real(self, cmd, payload, until_first):
                yield item

    real = lmq_process.ProcessHandle._stream
    lmq_process.ProcessHandle._stream = instant
    try:
        q = lmql.query(W1_LMQL, model=lmql.model("local:lmq:default"))
        await q(shots=shots, review="warm-up")
        times = []
        for review in reviews:
            t = time.perf_counter()
            await q(shots=shots, review=review)
            times.append(time.perf_counter() - t)
        line = f"  LMQL's client alone (a model that answers at once): median {statistics.median(times):.4f} s/call " \
               f"({statistics.median(times) / own:.2f} of lmq's own call)"
        if gathered:
            t = time.perf_counter()
            await asyncio.gather(*(q(shots=shots, review=r) for r in W.w1_reviews(gathered, seed=30)))
            line += f"; {gathered} at once {(time.perf_counter() - t) / gathered:.4f} s/call amortized"
        print(line)
    finally:
        lmq_process.ProcessHandle._stream = real


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--gathered", type=int, default=20, help="calls at once for the batched comparison (0: none)")
    p.add_argument("--no-peer", action="store_true", help="leave out LMQL's transformers backend")
    a = p.parse_args()
    asyncio.run(main(a.calls, a.gathered, not a.no_peer))
