"""Decoders: how a token is picked from the logits of one row, among the tokens its constraint allows.

`argmax` is greedy and exact; `sample(n, temperature, top_p, seed)` draws from the softmax with a
per-result generator (one uniform a pick: `engine.picks.Draw`), so a seeded run repeats whatever else shares
its batch (the samplers themselves are the engine's: `engine.picks`). Both take the decoding knobs `top_k`,
`repetition_penalty`, `frequency_penalty`, `presence_penalty` (`engine.picks.Knobs` defines them; a result's
sampler counts its own call's tokens). The beam decoders `beam(n=4)`, `beam_var(n=4)` and `var(b=2, n=b)`
choose among each beam's best tokens by the sum of their log-probabilities over the whole query, and return
the n best results; `beam_sample(n=4, temperature=1.0, seed=None)` among n tokens each beam samples;
`best_k(k=4, budget=30, ...)` is LMQL's best-first search (runtime/beam.py says exactly how).
"""
from __future__ import annotations

import ast as pyast
import math
from dataclasses import dataclass

from ..backend.protocol import DEFAULT_MAX_LEN
from ..engine.picks import Greedy, Knobs, Sampler, Sampling
from ..errors import LMQCompileError, LMQNotSupportedError
from ..language.checks import DECODER_ARGS, check_knobs

__all__ = ["DEFAULT_MAX_LEN", "Sampler", "Greedy", "Sampling", "Knobs", "BestK", "DecoderSpec"]

BEAM_DECODERS = ("beam", "beam_sample", "beam_var", "var", "best_k")


@dataclass(frozen=True, slots=True)
class BestK:
    """The arguments of `best_k`, with LMQL's defaults (runtime/beam.py)."""

    k: int = 4                      # beams expanded at each step, the best of the heap
    budget: int = 30                # expansions in all (the search goes on until one beam finishes)
    kappa: float = 1.0              # an entry's priority falls by kappa * age ** beta
    beta: float = 0.5
    gamma: float = 0.05             # a choice less likely than this is not kept
    max_heap_size: int = 500
    top_k_continuations: int = 5    # choices per expanded beam


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """A decoder clause with its arguments checked: what the runtime needs to run a query."""

    name: str = "argmax"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_len: int = DEFAULT_MAX_LEN
    b: int = 2  # var(b, n): the beams each kept beam searches a variable with
    best_k: BestK | None = None
    # the decoding knobs of argmax and sample (`engine.picks.Knobs`)
    top_k: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def beam(self) -> bool:
        return self.name in BEAM_DECODERS

    @classmethod
    def from_clause(cls, name: str, args: dict) -> "DecoderSpec":
        """Check a decoder clause's arguments (the parser has checked their names)."""
        if name not in ("argmax", "sample", *BEAM_DECODERS):
            raise LMQNotSupportedError(f"decoder {name!r} is not supported: use argmax, sample(...), "
                                       f"beam(n), beam_sample(n, temperature), beam_var(n), var(b, n) or "
                                       f"best_k(k, budget)")
        unknown = sorted(set(args) - DECODER_ARGS[name])
        if unknown:
            raise LMQCompileError(f"decoder {name}: unknown argument(s) {', '.join(unknown)}; "
                                  f"allowed: {', '.join(sorted(DECODER_ARGS[name]))}")
        check_knobs(name, args)
        if name in ("beam", "beam_sample", "beam_var", "var") and "n" not in args:
            args = {**args, "n": args.get("b", 2) if name == "var" else 4}  # LMQL's defaults
        if name == "best_k":
            args = {"max_len": args.get("max_len", DEFAULT_MAX_LEN),
                    "best_k": _check_best_k(BestK(**{k: v for k, v in args.items() if k != "max_len"}))}
        try:
            spec = cls(name=name, **args)
        except TypeError:
            raise LMQCompileError(f"decoder {name}: unknown argument(s) in {sorted(args)}") from None
        checks = [("b", _integer(spec.b) and spec.b >= 1, "an integer >= 1"),
                  ("n", _integer(spec.n) and spec.n >= 1, "an integer >= 1"),
                  ("temperature", _number(spec.temperature) and spec.temperature >= 0, "a finite number >= 0"),
                  ("top_p", _number(spec.top_p) and 0 < spec.top_p <= 1, "a number in (0, 1]"),
                  ("seed", spec.seed is None or _integer(spec.seed), "an integer"),
                  ("max_len", _integer(spec.max_len) and spec.max_len >= 1, "an integer >= 1")]
        for field_name, ok, what in checks:
            if not ok:
                raise LMQCompileError(f"decoder {name}: {field_name} must be {what}, got {getattr(spec, field_name)!r}")
        return spec

    @classmethod
    def parse(cls, text: str) -> "DecoderSpec":
        """A decoder given as text, e.g. "sample(n=3, temperature=0.7)" (for `@lmq.query(decoder=...)`)."""
        try:
            node = pyast.parse(text.strip(), mode="eval").body
            if isinstance(node, pyast.Name):
                return cls.from_clause(node.id, {})
            if isinstance(node, pyast.Call) and isinstance(node.func, pyast.Name) and not node.args:
                return cls.from_clause(node.func.id, {k.arg: pyast.literal_eval(k.value) for k in node.keywords})
        except (SyntaxError, ValueError, TypeError) as e:
            raise LMQCompileError(f"cannot read decoder {text!r}: {e}") from None
        raise LMQCompileError(f"cannot read decoder {text!r}: write it like sample(n=3, temperature=0.7)")

    @property
    def knobs(self) -> Knobs | None:
        """The decoding knobs that change a pick (None: none; argmax's `top_k` changes none)."""
        knobs = Knobs(self.top_k if self.name == "sample" else None, float(self.repetition_penalty),
                      float(self.frequency_penalty), float(self.presence_penalty))
        return knobs if knobs.penalizes or knobs.top_k is not None else None

    def sampler(self, index: int) -> Sampler:
        """The sampler of result number `index` (seeded runs give result i the seed `seed + i`); each result's
        own (its penalties count its own tokens)."""
        if self.name == "argmax":
            return Greedy(self.knobs)
        seed = None if self.seed is None else self.seed + index
        return Sampling(self.temperature, self.top_p, seed, self.knobs)


def _check_best_k(options: BestK) -> BestK:
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0

    checks = [("k", integer, "an integer >= 1"), ("budget", integer, "an integer >= 1"),
              ("kappa", number, "a number >= 0"), ("beta", number, "a number >= 0"),
              ("gamma", lambda v: number(v) and v <= 1, "a number in [0, 1]"),
              ("max_heap_size", integer, "an integer >= 1"), ("top_k_continuations", integer, "an integer >= 1")]
    for name, ok, what in checks:
        if not ok(getattr(options, name)):
            raise LMQCompileError(f"decoder best_k: {name} must be {what}, got {getattr(options, name)!r}")
    return options


def _integer(value) -> bool:
    """An int that is not a bool (`True` is an int in Python, never a count or a seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)
