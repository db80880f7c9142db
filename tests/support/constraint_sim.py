"""The constraint tests' tools (test_constraints.py, test_constraint_rules.py): constraint ASTs built by hand,
and a simulated engine driving a HoleState with random (optionally adversarial) picks over the real
SmolLM2 tokenizer's vocabulary index (the `vocab` fixture, conftest.py)."""
from __future__ import annotations

import random

import numpy as np

from lmq_backend.errors import LMQRuntimeError
from lmq_backend.language import ast
from lmq_backend.runtime.constraints import NOT_LITERAL, compile_hole_constraint


SPAN = ast.Span(1, 1)


# ----- building ASTs by hand -----------------------------------------------------------------------------

def E(value) -> ast.PyExpr:
    """A PyExpr for a Python value (its repr is the source)."""
    src = repr(value)
    return ast.PyExpr(src, compile(src, "<test>", "eval"), frozenset(), SPAN)


def N(name: str) -> ast.PyExpr:
    """A PyExpr reading a name (not a literal)."""
    return ast.PyExpr(name, compile(name, "<test>", "eval"), frozenset({name}), SPAN)


def call(func, var="X", *args):
    return ast.Call(func, var, tuple(E(a) for a in args), SPAN)


def choice(options, var="X"):
    return ast.Choice(var, E(options), SPAN)


def contains(s, var="X"):
    return ast.Contains(var, E(s), SPAN)


def length(op, n, var="X", unit="chars"):
    return ast.LenLimit(var, unit, op, E(n), SPAN)


def AND(*parts):
    return ast.And(tuple(parts))


def OR(*parts):
    return ast.Or(tuple(parts))


def NOT(p):
    return ast.Not(p)


def evaluate(expr: ast.PyExpr):
    return eval(expr.code, {"set": set, "list": list}, {"names": ["x", "y"], "gen": None})


def evaluate_literal(expr: ast.PyExpr):
    if expr.names:
        return NOT_LITERAL
    try:
        return eval(expr.code, {"__builtins__": {"set": set, "list": list}}, {})
    except Exception:
        return NOT_LITERAL


# ----- the simulated engine (the `vocab` fixture: conftest.py) -----------------------------------------------------------------

def compiled(c, vocab):
    return compile_hole_constraint(c, evaluate, vocab)


def simulate(hc, rng: random.Random, *, end_prob=0.2, max_steps=60, prefer=None, vocab=None):
    """Drive a HoleState like the engine does with a random picker. Returns (final text, state, stop).
    `prefer`: optional callable(ids) -> ids giving an adversarial bias (still within allowed)."""
    state = hc.start()
    for _ in range(max_steps):
        mask = state.allowed()
        if mask is None:
            mask = vocab.nonspecial.copy()
        assert mask.dtype == bool and mask.shape == (vocab.size,)
        assert not (mask & vocab.special).any(), "a special token in allowed()"
        ids = np.flatnonzero(mask)
        end = state.can_end()
        if len(ids) == 0:
            if end:
                return state.text, state, None
            raise LMQRuntimeError("constraint cannot be satisfied")
        if end and rng.random() < end_prob:
            return state.text, state, None
        if prefer is not None:
            ids = prefer(ids) if len(prefer(ids)) else ids
        tok = int(ids[rng.randrange(len(ids))])
        stop = state.advance(tok)
        if stop is not None:
            return stop.text, state, stop
    return None, state, None  # ran out of steps


def run_many(c, vocab, n=60, seed=0, **kw):
    hc = compiled(c, vocab)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, state, stop = simulate(hc, rng, vocab=vocab, **kw)
        out.append((text, state, stop))
    return out


def short_tokens(vocab, k=3):
    """An adversarial preference: short tokens (more steps, more token boundaries)."""
    def prefer(ids):
        return ids[vocab.n_bytes[ids] <= k]
    return prefer
