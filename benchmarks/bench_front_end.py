"""Front-end speed (moved here from timed tests): parsing a 30-line query, one constraint-mask step
(`HoleState.allowed()`) per constraint kind over the default model's vocabulary, and lmq's hand-written
masks against the same constraints written as a regular expression (or a Lark token) for llguidance.

    python benchmarks/bench_front_end.py [--runs 30] [--only compare]

The comparison times what a query call does for one hole: compile the hole's constraint
(`compile_hole_constraint`, per call: its arguments are evaluated in the call's scope), then for every
token of a value that satisfies it `allowed()`, `can_end()`, `advance()`, then a last `allowed()` and
`can_end()`. "first" is a call whose argument was never seen (a new option list, prefix, needle, limit),
"again" one with the argument of the previous call (a compiled query called many times), "step" the
mask step alone (allowed + can_end + advance) per token of an already compiled constraint. Medians of
--runs; each kind's two implementations alternate, so that a noisy neighbour hurts both alike. It also
counts the steps where the two masks differ along the value (each side's None is every non-special
token), the tokens only one side allows, and a few of them.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lmq_backend.language.parser import parse_query
from lmq_backend.runtime.constraints import compile_hole_constraint, constraint_for_hole
from lmq_backend.text.vocab import VocabIndex


def best_of(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def parse_and_steps(vocab: VocabIndex) -> None:
    lines = ["argmax"] + [f'    "line {i}: {{x}} [V{i}]" where STOPS_AT(V{i}, "\\n") and len(V{i}) < 20'
                          for i in range(28)] + ['from "default"']
    text = "\n".join(lines)
    print(f"parse a {len(lines)}-line query: {best_of(lambda: parse_query(text)) * 1e3:.2f} ms")

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


# ----- hand-written masks vs llguidance ----------------------------------------------------------------

_META = set("\\.+*?()|[]{}^$#&-~/")
ANY = "(?s:.)"


def rx(s: str) -> str:
    """`s` as a literal in llguidance's (Rust) regex syntax, also inside a Lark /.../ token."""
    return "".join("\\" + c if c in _META else c if c.isprintable() else f"\\x{{{ord(c):X}}}" for c in s)


@dataclass
class Kind:
    """One hand-written constraint and its llguidance twin. `args(i)` is the i-th call's argument (the
    scope both `where`s are evaluated in); `value(env)` a value that satisfies it."""

    name: str
    where: str          # the hand-written form, over the names of args()
    llg: str            # REGEX(X, r) or GRAMMAR(X, g), over r / g from `to_llg(env)`
    to_llg: Callable[[dict], dict]
    args: Callable[[int], dict]
    value: Callable[[dict], str]


def kinds(words: list[str]) -> list[Kind]:
    def options(i):
        return {"opts": [" positive", " negative", " neutral"] + ([f" other{i}"] if i else [])}

    def many(i):
        return {"opts": words[:999] + [f"word number {i}"]}

    def alternation(env):
        return {"r": "(" + "|".join(rx(o) for o in env["opts"]) + ")"}

    return [
        Kind("X in 3 options", "X in opts", "REGEX(X, r)", alternation, options, lambda env: " negative"),
        Kind("X in 1000 options", "X in opts", "REGEX(X, r)", alternation, many, lambda env: env["opts"][500]),
        Kind("INT", "INT(X)", "REGEX(X, r)", lambda env: {"r": "[ ]?-?[0-9]+"}, lambda i: {},
             lambda env: " -1234567"),
        Kind("STARTS_WITH", "STARTS_WITH(X, s)", "REGEX(X, r)", lambda env: {"r": rx(env["s"]) + ANY + "*"},
             lambda i: {"s": f"Answer {i}: the"}, lambda env: env["s"] + " capital of France is Paris."),
        Kind("s in X", "s in X", "REGEX(X, r)", lambda env: {"r": ANY + "*" + rx(env["s"]) + ANY + "*"},
             lambda i: {"s": f"fox{i}"}, lambda env: f"the quick brown {env['s']} jumps over the dog"),
        Kind("not s in X", "not s in X", "GRAMMAR(X, g)",
             lambda env: {"g": f"start: T\nT: /{ANY}*/ & ~/{ANY}*{rx(env['s'])}{ANY}*/"},
             lambda i: {"s": "\n" if i == 0 else f"END{i}"}, lambda env: "a line of text, and no break in it"),
        Kind("len(X) < n", "len(X) < n", "REGEX(X, r)", lambda env: {"r": f"{ANY}{{0,{env['n'] - 1}}}"},
             lambda i: {"n": 40 + i}, lambda env: "an answer of thirty-odd characters"),
        Kind("not s in X and len < n", "not s in X and len(X) < n", "GRAMMAR(X, g)",
             lambda env: {"g": f"start: T\nT: /{ANY}{{0,{env['n'] - 1}}}/ & ~/{ANY}*{rx(env['s'])}{ANY}*/"},
             lambda i: {"s": "\n" if i == 0 else f"END{i}", "n": 40 + i},
             lambda env: "an answer of thirty-odd characters"),
    ]


def constraint(where: str):
    q = parse_query(f'"[X]" where {where}')
    return constraint_for_hole(q.body[0].where, "X")


def call(c, env: dict, tokens: list[int], vocab: VocabIndex, masks: list | None = None) -> None:
    """One hole of one query call: compile, then walk `tokens`."""
    state = compile_hole_constraint(c, lambda e: eval(e.code, {}, env), vocab).start()
    for t in tokens:
        m = state.allowed()
        if masks is not None:
            masks.append(m)
        state.can_end()
        state.advance(t)
    m = state.allowed()
    if masks is not None:
        masks.append(m)
    assert state.can_end(), "the walked value does not satisfy the constraint"


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compare(vocab: VocabIndex, runs: int) -> None:
    rng = random.Random(3)
    words = list(dict.fromkeys("".join(rng.choice("abcdefghij ") for _ in range(rng.randint(3, 15)))
                               for _ in range(1200)))[:1000]
    print(f"hand-written masks vs llguidance, one hole of a call, vocabulary {vocab.size}, medians of {runs}:")
    print(f"  {'constraint':<24} {'impl':<5} {'tokens':>6} {'first ms':>9} {'again ms':>9} {'step ms':>8}"
          f"  masks differ")
    for k in kinds(words):
        hand_c, llg_c = constraint(k.where), constraint(k.llg)
        env0 = k.args(0)
        tokens = vocab.encode(k.value(env0))
        envs = {"hand": env0, "llg": {**env0, **k.to_llg(env0)}}
        cs = {"hand": hand_c, "llg": llg_c}
        masks: dict[str, list] = {"hand": [], "llg": []}
        for impl in ("hand", "llg"):
            call(cs[impl], envs[impl], tokens, vocab, masks[impl])  # warm the memos of argument 0
        full = vocab.nonspecial
        pairs = [(full if a is None else a, full if b is None else b) for a, b in zip(masks["hand"], masks["llg"])]
        differ = sum(not np.array_equal(a, b) for a, b in pairs)
        hand_only = [np.flatnonzero(a & ~b) for a, b in pairs]
        llg_only = [np.flatnonzero(b & ~a) for a, b in pairs]
        examples = sorted({vocab.token_bytes[t] for ids in hand_only for t in ids[:3]})[:4]
        examples_llg = sorted({vocab.token_bytes[t] for ids in llg_only for t in ids[:3]})[:4]
        fresh = iter(range(1, 10**6))
        results = {impl: {"first": [], "again": [], "step": []} for impl in cs}
        compiled = {impl: compile_hole_constraint(cs[impl], lambda e, env=envs[impl]: eval(e.code, {}, env), vocab)
                    for impl in cs}
        for _ in range(runs):
            i = next(fresh)
            env_i = k.args(i)
            tok_i = vocab.encode(k.value(env_i))
            for impl in cs:
                env = env_i if impl == "hand" else {**env_i, **k.to_llg(env_i)}
                t = time.perf_counter()
                call(cs[impl], env, tok_i, vocab)
                results[impl]["first"].append(time.perf_counter() - t)
                t = time.perf_counter()
                call(cs[impl], envs[impl], tokens, vocab)
                results[impl]["again"].append(time.perf_counter() - t)
                state = compiled[impl].start()
                t = time.perf_counter()
                for tok in tokens:
                    state.allowed()
                    state.can_end()
                    state.advance(tok)
                results[impl]["step"].append((time.perf_counter() - t) / len(tokens))
        for impl in cs:
            r = {key: statistics.median(v) * 1e3 for key, v in results[impl].items()}
            diff = (f"  {differ}/{len(pairs)} steps; hand only {sum(map(len, hand_only))} {examples}, "
                    f"llg only {sum(map(len, llg_only))} {examples_llg}") if impl == "llg" else ""
            print(f"  {k.name:<24} {impl:<5} {len(tokens):>6} {r['first']:>9.3f} {r['again']:>9.3f} "
                  f"{r['step']:>8.4f}{diff}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="calls per constraint kind and implementation")
    ap.add_argument("--only", choices=["parse", "compare"], help="one part only")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lmq_backend.backend.default_model import default_model_dir

    vocab = VocabIndex.for_tokenizer(AutoTokenizer.from_pretrained(str(default_model_dir())))
    vocab.ll_tokenizer()  # built once per tokenizer, not part of any call
    if args.only != "compare":
        parse_and_steps(vocab)
    if args.only != "parse":
        compare(vocab, args.runs)


if __name__ == "__main__":
    main()
