"""Prefix-cache benchmark. Two workloads, three ways, one run:

  lmq          the query, with the prefix trie
  hf-scratch   `model.generate` on the whole prompt every call
  hf-cached    `model.generate` on top of a hand-made prefix cache (shared prefix computed once and
               copied per call; for the chat, the cache carried from turn to turn)

W1: few-shot classification, ~1,100-token prompt of 40 labeled reviews + a new review, 3-way choice, 20 calls.
W2: a 6-turn chat growing from ~380 to ~660 tokens, 16 answer tokens a turn at most.

    python benchmarks/bench_prefix_cache.py [--model default|DIR] [--device cpu] [--calls 20]
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402
from lmq_backend.engine import compat  # noqa: E402


def median(xs):
    return statistics.median(xs)


def hf_generate(model, ids, max_new_tokens, cache=None):
    kwargs = {} if cache is None else compat.cache_kwargs(model, cache)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=model.config.eos_token_id, **kwargs)
    return out.sequences[0, len(ids):].tolist(), compat.output_cache(out)


def prefix_cache(model, ids):
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    return compat.output_cache(out)


def w1(backend, model, calls: int) -> dict:
    encode = backend.vocab.encode
    shots, reviews = W.w1_shots(), W.w1_reviews(calls)
    q = lmq.Query(W.W1_QUERY, model=backend)
    times = {"lmq": [], "hf-scratch": [], "hf-cached": []}
    answers = {k: [] for k in times}
    asyncio.run(q.run({"shots": shots, "review": "warm-up"}))  # the shared prefix enters the trie once
    for review in reviews:
        t = time.perf_counter()
        answers["lmq"].append(asyncio.run(q.run({"shots": shots, "review": review}))["CLS"])
        times["lmq"].append(time.perf_counter() - t)
    # The baselines see the ids lmq sees (the text up to the hole, tokenized as one piece); the hand-made
    # cache holds the longest token prefix all calls share, computed once.
    all_ids = [encode(shots + "Review: " + review + "\nSentiment:") for review in reviews]
    shared_len = min(len(a) for a in all_ids)
    while any(a[:shared_len] != all_ids[0][:shared_len] for a in all_ids):
        shared_len -= 1
    shared = prefix_cache(model, all_ids[0][:shared_len])
    prompt_tokens = []
    for ids in all_ids:
        prompt_tokens.append(len(ids))
        t = time.perf_counter()
        out, _ = hf_generate(model, ids, 1)
        times["hf-scratch"].append(time.perf_counter() - t)
        answers["hf-scratch"].append(backend.tokenizer.decode(out))
        t = time.perf_counter()
        out, _ = hf_generate(model, ids, 1, cache=copy.deepcopy(shared))
        times["hf-cached"].append(time.perf_counter() - t)
        answers["hf-cached"].append(backend.tokenizer.decode(out))
    agree = sum(a.strip() == b.strip() for a, b in zip(answers["lmq"], answers["hf-scratch"]))
    return {"times": times, "tokens": median(prompt_tokens), "agree": agree, "n": len(reviews)}


def lmq_turns(backend, source: str, hole: str) -> tuple[list[float], dict, int]:
    """Per-turn seconds of W2 written as `source` (its `hole` line gets a clock), its variables and the
    tokens it prefilled: the call's start or a turn's hole to the next turn's hole, the last to the end."""
    marks = []
    q = lmq.Query(source.replace(hole, hole.replace("[ANSWER]", "{tick()}[ANSWER]")), model=backend)
    inputs = {"system": W.W2_SYSTEM, "turns": W.W2_TURNS, "tick": lambda: marks.append(time.perf_counter()) or ""}
    before = backend.stats().tokens_prefilled
    t0 = time.perf_counter()
    r = asyncio.run(q.run(inputs))
    end = time.perf_counter()
    turns = [b - a for a, b in zip(marks, marks[1:] + [end])]
    turns[0] += marks[0] - t0
    return turns, r.variables, backend.stats().tokens_prefilled - before


def w2(backend, model) -> dict:
    """W2 by lmq (the template's markup written by hand, and with role tags: each on an empty trie, the same
    prefill work), and by transformers from scratch and with a carried cache."""
    encode = backend.vocab.encode
    backend.trie.evict(backend.trie.evictable_bytes())
    hand, answers, hand_prefilled = lmq_turns(backend, W.W2_QUERY, '"[ANSWER]"')
    backend.trie.evict(backend.trie.evictable_bytes())
    roles, role_answers, roles_prefilled = lmq_turns(backend, W.W2_ROLES_QUERY, '"{:assistant} [ANSWER]"')
    print(f"W2 with role tags: the same answers {role_answers == answers}, tokens prefilled {roles_prefilled} "
          f"(by hand {hand_prefilled})")
    lengths = []
    times = {"lmq": hand, "lmq-roles": roles, "hf-scratch": [], "hf-cached": []}
    for mode in ("hf-scratch", "hf-cached"):
        history = encode("<|im_start|>system\n") + encode(W.W2_SYSTEM) + encode("<|im_end|>\n")
        cache, fed = None, 0
        for turn in W.W2_TURNS:
            history += encode("<|im_start|>user\n") + encode(turn) + encode("<|im_end|>\n<|im_start|>assistant\n")
            t = time.perf_counter()
            if mode == "hf-scratch":
                out, _ = hf_generate(model, history, W.W2_ANSWER_TOKENS)
            else:
                out, cache = hf_generate(model, history, W.W2_ANSWER_TOKENS, cache=cache)
            times[mode].append(time.perf_counter() - t)
            if out and out[-1] == model.config.eos_token_id:
                out = out[:-1]
            history += out + encode("<|im_end|>\n")
            lengths.append(len(history))
    return {"times": times, "tokens": f"{lengths[0]}-{lengths[len(W.W2_TURNS) - 1]}", "answers": answers}


def report(name: str, res: dict) -> None:
    t = res["times"]
    print(f"\n{name}: prompt tokens {res['tokens']}")
    print(f"{'method':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'lmq speed-up':>13}")
    for k, xs in t.items():
        print(f"{k:<12} {median(xs):>9.3f} {min(xs):>7.3f} {max(xs):>7.3f} {median(xs) / median(t['lmq']):>12.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    backend = lmq.HFBackend(args.model, device=args.device, dtype=args.dtype, disk_cache=None)  # the process alone
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {args.model}, {args.dtype}")
    model = W.plain_model(backend.model)  # for the HF baselines
    r1 = w1(backend, model, args.calls)
    report("W1 few-shot classification (per call)", r1)
    print(f"lmq and hf-scratch agree on {r1['agree']}/{r1['n']} answers")
    r2 = w2(backend, model)
    report("W2 6-turn chat (per turn)", r2)
    s = backend.stats()
    print(f"\nlmq cache: token hit rate {s.token_hit_rate:.3f}, reused {s.tokens_reused}, "
          f"prefilled {s.tokens_prefilled}, decoded {s.tokens_decoded}, {s.nodes} nodes, {s.bytes_in_use / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
