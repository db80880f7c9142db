"""The plugin's patch of LMQL's token-set comparison (`hook._patch_token_sets`): the same answers as LMQL's own
`TokenSetConcrete.__eq__`, for each of its cases, and installed wherever LMQL's module is imported."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import lmql  # noqa: F401 - (the hook patches LMQL's modules as they are imported)
from lmql.ops import token_set

from lmq_backend.lmql import hook

PATCHED = token_set.TokenSetConcrete.__eq__
OWN = getattr(PATCHED, "lmqls_own", None)


def sets() -> list:
    """Token sets over a small vocabulary: empty, full, one token, all but one; with and without a tail."""
    vocab = 64
    masks = [np.zeros(vocab, dtype=bool), np.ones(vocab, dtype=bool), np.arange(vocab) == 7, np.arange(vocab) != 3]
    out = []
    for mask, tail in itertools.product(masks, (None, "ab")):
        s = token_set.TokenSetConcrete.__new__(token_set.TokenSetConcrete)
        s.mask, s.tail = mask.copy(), tail
        out.append(s)
    return out


def lmqls_answer(a, b) -> bool:
    """`a == b` with LMQL's own comparison throughout (its set-against-set case compares `b` with the names)."""
    token_set.TokenSetConcrete.__eq__ = OWN
    try:
        return bool(a == b)
    finally:
        token_set.TokenSetConcrete.__eq__ = PATCHED


def test_the_patch_is_installed():
    assert getattr(PATCHED, "_lmq", False) and OWN is not None


@pytest.mark.parametrize("name", ["∅", "*"])
def test_a_set_against_the_empty_and_full_names_answers_as_lmqls_own(name):
    for s in sets():
        assert s == name if lmqls_answer(s, name) else not s == name


def test_two_sets_compare_as_lmqls_own():
    for a, b in itertools.product(sets(), repeat=2):
        assert bool(a == b) == lmqls_answer(a, b), (a.mask.sum(), a.tail, b.mask.sum(), b.tail)


def test_patching_twice_wraps_once():
    hook._patch_token_sets(token_set)
    assert token_set.TokenSetConcrete.__eq__ is PATCHED
