"""Front-end speed (moved here from timed tests): parsing a 30-line query, and one constraint-mask step
(`HoleState.allowed()`) per constraint kind over the default model's vocabulary.

    python benchmarks/bench_front_end.py
"""
from __future__ import annotations

import random
import time

import numpy as np

from lmq_backend.language.parser import parse_query
from lmq_backend.runtime.constraints import compile_hole_constraint, constraint_for_hole
from lmq_backend.runtime.vocab import VocabIndex


def best_of(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    from transformers import AutoTokenizer

    from lmq_backend.backend.default_model import default_model_dir

    lines = ["argmax"] + [f'    "line {i}: {{x}} [V{i}]" where STOPS_AT(V{i}, "\\n") and len(V{i}) < 20'
                          for i in range(28)] + ['from "default"']
    text = "\n".join(lines)
    print(f"parse a {len(lines)}-line query: {best_of(lambda: parse_query(text)) * 1e3:.2f} ms")

    vocab = VocabIndex.for_tokenizer(AutoTokenizer.from_pretrained(str(default_model_dir())))
    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(3, 15))) for _ in range(1000)]
    cases = {
        "X in 3 options": 'X in ["yes", "no", "maybe"]',
        "X in 1000 options": "X in words",
        "INT": "INT(X)",
        "STARTS_WITH": 'STARTS_WITH(X, "Hello world")',
        "not contains": 'not "\\n" in X',
        "len < 20": "len(X) < 20",
        "REGEX": 'REGEX(X, r"[a-z]+ [0-9]{2}")',
        "and of three": 'not "\\n" in X and len(X) < 30 and STOPS_AT(X, ".")',
    }
    print(f"one mask step after a token, start() + advance() + allowed() over {vocab.size} tokens (best of 5):")
    for name, where in cases.items():
        q = parse_query(f'argmax\n    "[X]" where {where}\nfrom "default"')
        c = constraint_for_hole(q.where if q.where is not None else q.body[0].where, "X")
        hc = compile_hole_constraint(c, lambda e: eval(e.code, {}, {"words": words}), vocab)
        hc.start().allowed()  # warm: per-vocabulary tables are built once

        def step():  # the mask after one token of the value (a start state's mask may be memoized)
            state = hc.start()
            mask = state.allowed()
            state.advance(int(np.flatnonzero(mask & ~vocab.special)[0]) if mask is not None else vocab.encode("a")[0])
            state.allowed()

        print(f"  {name:<20} {best_of(step) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
