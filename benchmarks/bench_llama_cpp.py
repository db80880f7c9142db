"""lmq against llama.cpp (llama-cpp-python) on the CPU, on the same GGUF weights and the same texts, in one run.

Pairs: lmq float32 (the default model: the shipped Q4_1 de-quantized) against llama.cpp F32 (the same GGUF
re-written as F32 by llama.cpp's own `llama_model_quantize`, so both hold the same values), and lmq int4
(`HFBackend("default", dtype="int4")`: the shipped Q4_1 layers as they are, an int8 LM head) against llama.cpp
on the shipped Q4_1 file. Same threads for both (torch and llama.cpp).

W1 (benchmarks/workloads.py): a ~1,100-token few-shot prefix, a new review, a 3-way choice; a warm-up (lmq:
every call once, and concurrent runs until two in a row measure no new class of its CPU kernels; llama.cpp: the first call) warms each side (its prefix computed once and kept: lmq's trie, llama.cpp's KV prefix reuse), then the mean
of the next calls. llama.cpp scores the options from the logits after the prompt (each option's tokens fed
in turn when it has more than one). W2: the 6-turn chat, each turn's history re-sent (~400-700 tokens) and up
to `--answer-tokens` greedy tokens; per turn = a chat's time / 6, after a warm-up chat (lmq's trie then
holds the chat's earlier turns: each turn prefills only the new user text and decodes the answer). llama.cpp reuses the longest common prefix of its KV cache (as `Llama.generate` does) and decodes
greedily (argmax of the logits, ended by a special token), the same picks lmq makes.

Reported: wall seconds per call (W1) or per turn (W2), the process's CPU seconds alongside, the ratio
lmq / llama.cpp (< 1: lmq faster), the host, ISA and load average. The two sides alternate round by round
(the host is shared: its load moves), medians over `--rounds`.

Run:  python benchmarks/bench_llama_cpp.py [--rounds 3] [--w1-calls 10] [--answer-tokens 24] [--threads 2]
Needs the `bench` extra: pip install -e '.[bench]' (llama-cpp-python; building it compiles llama.cpp).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W  # noqa: E402

import lmq_backend as lmq  # noqa: E402
from lmq_backend.backend.default_model import gguf_path  # noqa: E402
from lmq_backend.paths import cache_dir  # noqa: E402


def f32_gguf() -> Path:
    """The shipped GGUF re-written as F32 by llama.cpp itself (once, into lmq's cache directory)."""
    import llama_cpp

    target = cache_dir() / "bench" / "SmolLM2-135M-Instruct.F32.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        params.nthread = 2
        partial = target.with_suffix(f".partial-{os.getpid()}")
        if llama_cpp.llama_model_quantize(str(gguf_path()).encode(), str(partial).encode(), ctypes.byref(params)):
            raise RuntimeError("llama_model_quantize to F32 failed")
        partial.replace(target)
    return target


class LlamaCpp:
    """One llama.cpp model: prefix reuse over its KV cache, the last position's logits, greedy decoding."""

    def __init__(self, path: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.special = {self.llm.token_eos(), *self.llm.tokenize(b"<|im_end|><|im_start|>", add_bos=False,
                                                                    special=True)}

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def feed(self, ids: list[int]) -> np.ndarray:
        """Evaluate `ids` reusing the longest common prefix already in the KV cache; the last logits [V]."""
        import llama_cpp

        llm = self.llm
        common = 0
        for a, b in zip(llm.input_ids[: llm.n_tokens], ids[:-1]):
            if a != b:
                break
            common += 1
        llm.n_tokens = common  # eval() removes the cache's columns from here on
        llm.eval(ids[common:])
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def w1(self, prompt: str, options: list[str]) -> str:
        ids = self.tokens(prompt)
        first = self.feed(ids)
        scores = []
        for option in options:
            opt = self.tokens(option)
            logits, total = first, 0.0
            for k, t in enumerate(opt):
                total += float(logits[t] - np.logaddexp.reduce(logits))
                if k + 1 < len(opt):
                    logits = self.feed(ids + opt[: k + 1])
            scores.append(total)
        return options[int(np.argmax(scores))]

    def w2(self, turns: list[str], answer_tokens: int) -> list[str]:
        text = f"<|im_start|>system\n{W.W2_SYSTEM}<|im_end|>\n"
        answers = []
        for turn in turns:
            text += f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"
            ids = self.tokens(text)
            out: list[int] = []
            logits = self.feed(ids)
            while len(out) < answer_tokens:
                t = int(np.argmax(logits))
                if t in self.special:
                    break
                out.append(t)
                if len(out) < answer_tokens:
                    logits = self.feed(ids + out)
            answer = self.llm.detokenize(out).decode(errors="replace")
            answers.append(answer)
            text += answer + "<|im_end|>\n"
        return answers


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


class Lmq:
    """The same workloads through lmq (`HFBackend("default", dtype=...)`), one event loop."""

    def __init__(self, dtype: str, args):
        name = f"bench-{dtype}"
        lmq.register_backend(name, lmq.HFBackend("default", device="cpu", dtype=dtype))
        self.q1 = lmq.compile(W.W1_QUERY.replace('from "default"', f'from "{name}"'))
        self.q2 = lmq.compile(W.W2_QUERY.replace('from "default"', f'from "{name}"')
                              .replace(f"< {W.W2_ANSWER_TOKENS + 1}", f"< {args.answer_tokens + 1}"))
        self.loop = asyncio.new_event_loop()

    def w1(self, shots: str, review: str):
        return self.loop.run_until_complete(self.q1(shots=shots, review=review))

    def w1_concurrent(self, shots: str, reviews: list[str]):
        async def all_at_once():
            return await asyncio.gather(*(self.q1(shots=shots, review=r) for r in reviews))

        return self.loop.run_until_complete(all_at_once())

    def w2(self):
        return self.loop.run_until_complete(self.q2(system=W.W2_SYSTEM, turns=W.W2_TURNS))

    def close(self) -> None:
        """Stop the backend's scheduler task with the loop (a loop dropped with it pending warns at exit)."""
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


def compare(pair: str, ours: Lmq, theirs: LlamaCpp, args, shots: str) -> None:
    """Warm both up, then per round: W1's calls and a W2 chat on lmq, then on llama.cpp (so that both meet
    the shared host's load of that moment); medians over rounds."""
    prompt = lambda r: f"{shots}Review: {r}\nSentiment:"  # noqa: E731
    reviews = W.w1_reviews(args.w1_calls + 1, seed=1)
    for r in reviews:  # lmq: the prefix in the trie and the CPU kernels' calibration of every class met
        ours.w1(shots, r)
    seeds = iter(range(50, 100))  # concurrent runs meet batch shapes (kernel classes) a few at a time
    W.until_calibrated(lambda: ours.w1_concurrent(shots, W.w1_reviews(args.w1_calls, seed=next(seeds))))
    ours.w2()
    theirs.w1(prompt(reviews[0]), W.W1_OPTIONS)
    theirs.w2(W.W2_TURNS, args.answer_tokens)
    rows: dict[str, list] = {k: [] for k in ("W1", "W1 concurrent", "W2")}
    n1, n2 = len(reviews) - 1, len(W.W2_TURNS)
    for k in range(args.rounds):
        reviews = W.w1_reviews(args.w1_calls + 1, seed=2 + k)
        ours.w1(shots, reviews[0])                     # untimed: llama.cpp's one KV sequence held the last chat,
        theirs.w1(prompt(reviews[0]), W.W1_OPTIONS)    # so its prefix is computed again here, not in W1's calls
        _, t, c = timed(lambda: [ours.w1(shots, r) for r in reviews[1:]])
        _, lt, lc = timed(lambda: [theirs.w1(prompt(r), W.W1_OPTIONS) for r in reviews[1:]])
        rows["W1"].append((t / n1, c / n1, lt / n1, lc / n1))
        others = W.w1_reviews(args.w1_calls, seed=100 + k)   # not yet in lmq's trie either
        _, t, _ = timed(lambda: ours.w1_concurrent(shots, others))
        rows["W1 concurrent"].append((t / n1, float("nan"), lt / n1, lc / n1))
        _, t, c = timed(ours.w2)
        _, lt, lc = timed(lambda: theirs.w2(W.W2_TURNS, args.answer_tokens))
        rows["W2"].append((t / n2, c / n2, lt / n2, lc / n2))
    for workload, values in rows.items():
        t, c, lt, lc = (statistics.median(v[i] for v in values) for i in range(4))
        ratios = " ".join(f"{v[0] / v[2]:.2f}" for v in values)
        print(f"{pair:<16} {workload:<14} {t:8.3f} {c:7.3f} {lt:12.3f} {lc:7.3f} {t / lt:9.2f}   ({ratios})",
              flush=True)


def host_line(args) -> str:
    import llama_cpp

    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {W.cpu_host()}; "
            f"torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, {args.threads} threads; load "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; command: {' '.join(sys.argv)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="W2 chats timed (after a warm-up chat)")
    ap.add_argument("--w1-calls", type=int, default=10)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", default="fp32,int4", help="fp32 (vs F32) and/or int4 (vs Q4_1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(host_line(args), flush=True)
    shots = W.w1_shots()
    print(f"{'pair':<16} {'workload':<14} {'lmq s':>8} {'cpu s':>7} {'llama.cpp s':>12} {'cpu s':>7} {'lmq/llama':>9}"
          "   (per round)   [medians over rounds; W1 concurrent: lmq's calls all at once against llama.cpp's "
          "sequential ones]")
    for pair in args.pairs.split(","):
        dtype, path, peer = {"fp32": ("float32", None, "F32"), "int4": ("int4", gguf_path(), "Q4_1")}[pair]
        ours = Lmq(dtype, args)
        compare(f"{pair} vs {peer}", ours, LlamaCpp(path or f32_gguf(), args.threads), args, shots)
        ours.close()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
