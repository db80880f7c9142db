"""A long prompt arriving while short queries decode (CPU, the default model, float32): how long the running
rows' decode steps stall behind its prefill, prefilled in one piece or in parts (`Scheduler.max_part_tokens`).

    python benchmarks/bench_long_prompt.py [--parts 16384 512] [--tokens 2600] [--rows 4]
    python benchmarks/bench_long_prompt.py --shape llama-1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --tokens 12000 --rows 16 --parts 16384 4096 2048        # a GPU, random weights of that shape

Per setting, in one process each: the long query's time, the longest gap between two decode steps (the stall
the decoding rows see), and the prefill steps (new tokens, seconds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

WORDS = "alpha river stone cloud seven green table quiet north apple lamp orbit matrix".split()


def backend(args):
    import lmq_backend as lmq

    if args.shape is None:
        return lmq.HFBackend("default", device=args.device, dtype=args.dtype, cache_budget="2GB")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workloads import random_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(random_config(args.shape), dtype=getattr(torch, args.dtype))
    return lmq.HFBackend.from_model(model.to(args.device), AutoTokenizer.from_pretrained(args.tokenizer),
                                    cache_budget="8GB", name=args.shape)


def one(args) -> dict:
    import lmq_backend as lmq

    part, tokens, rows = args.one, args.tokens, args.rows
    b = backend(args)
    b.scheduler.max_part_tokens = part
    short = lmq.Query('"Count slowly from one, item {i}:[A]" where len(TOKENS(A)) < 120', model=b)
    long_q = lmq.Query(f'argmax(max_len={4 * tokens})\n"{{t}} Summary:[A]" where len(TOKENS(A)) < 8', model=b)
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(tokens))
    asyncio.run(short.run({"i": -1}))            # warm-up: calibration, the decode and prefill paths
    asyncio.run(long_q.run({"t": "warm " * 50}))
    steps = []
    b.on_step(lambda s: steps.append((time.perf_counter(), s.kind, s.new_tokens, s.seconds)))

    async def main() -> float:
        shorts = [asyncio.ensure_future(short.run({"i": i})) for i in range(rows)]
        while sum(s[1] == "decode" for s in steps) < 10:  # the short queries decode, then the long one comes
            await asyncio.sleep(0.01)
        t = time.perf_counter()
        await long_q.run({"t": text})
        took = time.perf_counter() - t
        await asyncio.gather(*shorts)
        return took

    took = asyncio.run(main())
    decodes = [t for t, kind, *_ in steps if kind == "decode"]
    return dict(part=part, long_query=took, stall=max(b - a for a, b in zip(decodes, decodes[1:])),
                prefills=[(n, round(s, 2)) for _, kind, n, s in steps if kind != "decode"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", type=int, nargs="+", default=[16384, 512])
    ap.add_argument("--tokens", type=int, default=2600)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--shape", default=None, help="a random-weight model of this shape (workloads.random_config)")
    ap.add_argument("--tokenizer", default=None, help="the tokenizer's folder for --shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args)))
        return
    model = args.shape or "default model"
    print(f"a ~{args.tokens}-token prompt arriving while {args.rows} short queries decode ({model}, {args.device} "
          f"{args.dtype})")
    print("| max_part_tokens | long query | longest decode stall | prefill steps (new tokens, s) |")
    print("|---|---|---|---|")
    for part in args.parts:  # a process each: the same calibration, no state carried between settings
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(part)], capture_output=True,
                             text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {part} | {r['long_query']:.2f} s | {r['stall']:.2f} s | {r['prefills'][1:]} |", flush=True)


if __name__ == "__main__":
    main()
