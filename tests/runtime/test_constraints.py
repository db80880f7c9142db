"""Constraints as token masks, driven by simulated pickers on the real SmolLM2 tokenizer: which conjuncts a hole
gets, checks of finished values, compile-time validation, choices, INT, STARTS_WITH, contains and length
limits (stop rules, llguidance, combinations and properties: test_constraint_rules.py)."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from lmq_backend.errors import LMQCompileError, LMQConstraintConflictError, LMQNotSupportedError, LMQRuntimeError
from lmq_backend.language import ast
from lmq_backend.runtime.constraints import check_constraint, compile_hole_constraint, constraint_for_hole

from support.constraint_sim import (AND, E, N, NOT, OR, SPAN, call, choice, compiled, contains, evaluate, evaluate_literal, length,
                            run_many, short_tokens)


# ----- constraint_for_hole --------------------------------------------------------------------------------

def test_constraint_for_hole_selects_conjuncts():
    a, b = choice(["x"], "A"), call("INT", "B")
    c = AND(a, AND(b, contains("z", "A")))
    got = constraint_for_hole(c, "A")
    assert isinstance(got, ast.And) and got.parts == (a, contains("z", "A"))
    assert constraint_for_hole(c, "B") == b
    assert constraint_for_hole(c, "C") is None
    assert constraint_for_hole(None, "A") is None


def test_constraint_for_hole_two_holes():
    with pytest.raises(LMQNotSupportedError, match="one hole"):
        constraint_for_hole(OR(choice(["x"], "A"), choice(["y"], "B")), "A")


# ----- check_constraint -------------------------------------------------------------------------------------

@pytest.mark.parametrize("c, err", [
    (choice([]), LMQConstraintConflictError),
    (AND(choice(["a", "b"]), call("INT")), LMQConstraintConflictError),
    (AND(choice(["a", " 12"]), call("INT")), None),
    (AND(choice(["ab", "cd"]), call("STARTS_WITH", "X", "x")), LMQConstraintConflictError),
    (AND(choice(["ab", "xd"]), call("STARTS_WITH", "X", "x")), None),
    (AND(choice(["ab", "cd"]), call("REGEX", "X", "[0-9]+")), LMQConstraintConflictError),
    (AND(choice(["abc", "cde"]), length("<", 3)), LMQConstraintConflictError),
    (AND(choice(["abc", "cd"]), length("<", 3)), None),
    (AND(choice(["a\nb"]), NOT(contains("\n"))), LMQConstraintConflictError),
    (AND(choice(["a", "b"]), choice(["c"])), LMQConstraintConflictError),
    (AND(call("STARTS_WITH", "X", "ab"), call("INT")), LMQConstraintConflictError),
    (length("<", 0), LMQConstraintConflictError),
    (call("STOPS_AT", "X", 3), LMQCompileError),
    (call("STOPS_AT", "X", ""), LMQCompileError),
    (call("STOPS_BEFORE", "X", None), LMQCompileError),
    (ast.Call("INT", "X", (E(3),), SPAN), LMQCompileError),
    (length("<", "3"), LMQCompileError),
    (length("<", 2.5, unit="tokens"), LMQCompileError),
    (call("REGEX", "X", "(["), LMQCompileError),
    (call("JSON", "X", "{not json"), LMQCompileError),
    (call("JSON", "X", {"type": "blah"}), LMQCompileError),
    (call("REGEX", "X", "(?=a)b"), LMQCompileError),  # Python compiles it; llguidance has no look-around
    (call("GRAMMAR", "X", "start: foo"), LMQCompileError),
    (call("GRAMMAR", "X", 'start: "a" | "b"'), None),
    (call("JSON", "X", '{"type": "object"}'), None),
    (OR(call("STOPS_AT", "X", "."), choice(["a"])), LMQNotSupportedError),
    (NOT(call("REGEX", "X", "a")), LMQNotSupportedError),
    (OR(call("JSON", "X", {"type": "object"}), choice(["a"])), LMQNotSupportedError),
    (NOT(length("<", 3, unit="tokens")), LMQNotSupportedError),
    (ast.Call("FOO", "X", (), SPAN), LMQCompileError),
    (ast.Choice("X", E(set(["a", "b"])), SPAN), None),
    (ast.Choice("X", N("names"), SPAN), None),  # not a literal: checked at run time
    (call("STOPS_AT", "X", "\n"), None),
])
def test_check_constraint(c, err):
    if err is None:
        check_constraint(c, evaluate_literal)
    else:
        with pytest.raises(err):
            check_constraint(c, evaluate_literal)


# ----- compile-time validation of evaluated values ------------------------------------------------------

def test_runtime_argument_errors(vocab):
    with pytest.raises(LMQConstraintConflictError):
        compiled(ast.Choice("X", E(()), SPAN), vocab)
    with pytest.raises(LMQRuntimeError):
        compiled(ast.Choice("X", E([1, 2]), SPAN), vocab)
    with pytest.raises(LMQRuntimeError):
        compiled(ast.Choice("X", N("gen"), SPAN), vocab)
    with pytest.raises(LMQRuntimeError):
        compiled(call("STOPS_AT", "X", 5), vocab)
    with pytest.raises(LMQRuntimeError):
        compiled(length("<", "5"), vocab)
    # any iterable of strings works
    hc = compile_hole_constraint(ast.Choice("X", E(("a", "b")), SPAN), evaluate, vocab)
    assert hc.start().allowed().any()
    hc = compile_hole_constraint(ast.Choice("X", N("names"), SPAN), evaluate, vocab)
    assert hc.start().allowed().any()


# ----- choice -----------------------------------------------------------------------------------------------

CHOICE_OPTIONS = [
    ["yes", "no"],
    [" positive", " negative", " neutral"],
    ["a", "ab", "abc", "abcd efg"],  # prefixes of each other
    ["日本語", "日本", "ü", "🎉 party", "naïve café"],  # unicode, multi-byte chars split over tokens
    ["", "x"],  # the empty option
    ["New York City", "New York", "New Jersey", "Newark"],
]


@pytest.mark.parametrize("options", CHOICE_OPTIONS)
def test_choice_exact(vocab, options):
    for prefer in (None, short_tokens(vocab, 1), short_tokens(vocab, 2)):
        for text, state, stop in run_many(choice(options), vocab, n=40, prefer=prefer, end_prob=0.3):
            assert text in options, text
            assert stop is None
            assert state.can_end()


def test_choice_tokenizations(vocab):
    # every tokenization of an option is allowed: the first step allows every token prefix of the options
    hc = compiled(choice(["abcd efg"]), vocab)
    s = hc.start()
    mask = s.allowed()
    for k in range(1, 5):
        ids = vocab.bytes_to_ids.get(b"abcd efg"[:k])
        if ids is not None:
            assert mask[ids].all()
    assert not s.can_end()
    # walk one byte at a time
    for ch in "abcd efg":
        ids = vocab.bytes_to_ids[ch.encode()]
        assert s.allowed()[ids[0]]
        assert s.advance(int(ids[0])) is None
    assert s.can_end() and s.text == "abcd efg"
    assert not s.allowed().any()


def test_states_in_one_choice_position_share_one_read_only_mask(vocab):
    """Rows at the same place in the options share one mask object (a step then stacks and moves one mask, not
    one a row); it is read-only, so no state's caller can change another's; masks a state builds for itself
    (a conjunction's) stay the caller's to modify."""
    hc = compiled(choice([" positive", " negative", " neutral"]), vocab)
    a, b = hc.start(), hc.start()
    assert a.allowed() is b.allowed() and not a.allowed().flags.writeable
    tok = int(np.flatnonzero(a.allowed())[0])
    a.advance(tok), b.advance(tok)
    assert a.allowed() is b.allowed() and a.allowed() is not hc.start().allowed()
    both = compiled(AND(choice([" positive", " negative"]), call("STARTS_WITH", "X", " p")), vocab).start()
    mine = both.allowed()
    assert mine.flags.writeable and mine is not both.allowed()


def test_choice_many_options(vocab):
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(3, 25)))
             for _ in range(1000)]
    for text, state, _ in run_many(choice(words), vocab, n=30, end_prob=0.5):
        assert text in words


def test_a_long_option_list_is_compiled_once(vocab):
    """A list of more than 64 options keeps its compiled node among the last LONG_CHOICES lists (a data
    set's labels, the same on every call): the same node for the same options, a new one once pushed out."""
    from lmq_backend.runtime.constraints.compiler import LONG_CHOICES

    lists = [[f"label {k} {i}" for i in range(100)] for k in range(LONG_CHOICES + 1)]
    first = compiled(choice(lists[0]), vocab).node
    assert compiled(choice(list(lists[0])), vocab).node is first
    for options in lists[1:]:
        assert compiled(choice(options), vocab).node is not first
    assert compiled(choice(lists[0]), vocab).node is not first
    for text, state, _ in run_many(choice(lists[0]), vocab, n=10, end_prob=0.5):
        assert text in lists[0]


# ----- INT -----------------------------------------------------------------------------------------------

def test_int(vocab):
    for prefer in (None, short_tokens(vocab, 1)):
        for text, state, _ in run_many(call("INT"), vocab, n=60, prefer=prefer, end_prob=0.3):
            assert text is not None
            assert re.fullmatch(r" ?-?[0-9]+", text), text
            int(text)
    s = compiled(call("INT"), vocab).start()
    assert not s.can_end()
    m = s.allowed()
    assert m[vocab.bytes_to_ids[b" "]].all() and m[vocab.bytes_to_ids[b"-"]].all()
    assert not m[vocab.bytes_to_ids[b"a"]].any()


def test_a_special_or_out_of_range_token_is_no_part_of_a_value(vocab):
    special = int(np.flatnonzero(vocab.special)[0])
    for bad in (-1, vocab.size, vocab.size + 7, special):
        s = compiled(None, vocab).start()
        with pytest.raises(LMQRuntimeError, match="special or out of range"):
            s.advance(bad)
        assert s.n_tokens == 0 and s.text == ""  # nothing of the refused token was appended
    s = compiled(None, vocab).start()
    assert s.advance(vocab.bytes_to_ids[b"a"][0]) is None and s.text == "a"


# ----- STARTS_WITH ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["Hello", " the answer is", "日本", "{\"a\":"])
def test_starts_with(vocab, prefix):
    for prefer in (None, short_tokens(vocab, 2)):
        for text, state, _ in run_many(call("STARTS_WITH", "X", prefix), vocab, n=30, prefer=prefer):
            assert text is not None and text.startswith(prefix), text


def test_not_starts_with(vocab):
    for text, _, _ in run_many(NOT(call("STARTS_WITH", "X", "a")), vocab, n=40, max_steps=10):
        if text is not None:
            assert not text.startswith("a")


# ----- contains / not contains ---------------------------------------------------------------------------

@pytest.mark.parametrize("needle", ["\n", "ab", "the", "é", "xyzzy"])
def test_not_contains(vocab, needle):
    b = needle.encode()
    pref = vocab.tokens_containing(b[:1]) | vocab.tokens_containing(b[-1:])

    def prefer(ids):  # adversarial: tokens that contain pieces of the needle
        return ids[pref[ids]]
    for p in (None, prefer):
        for text, state, _ in run_many(NOT(contains(needle)), vocab, n=25, prefer=p, end_prob=0.05,
                                       max_steps=30):
            final = text if text is not None else state.text
            assert needle not in final
            assert needle.encode() not in state.value_bytes


def test_contains(vocab):
    hc = compiled(contains("ok"), vocab)
    s = hc.start()
    assert s.allowed() is None and not s.can_end()
    s.advance(int(vocab.bytes_to_ids[b"o"][0]))
    assert not s.can_end()
    s.advance(int(vocab.bytes_to_ids[b"k"][0]))
    assert s.can_end()
    for text, state, _ in run_many(AND(contains("a"), choice(["cat", "dog", "bat"])), vocab, n=30):
        assert text in ("cat", "bat")


# ----- length limits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, n", [("<", 5), ("<=", 5), ("<", 1), ("<=", 12)])
def test_len_chars(vocab, op, n):
    limit = n - 1 if op == "<" else n
    for text, state, _ in run_many(length(op, n), vocab, n=30, end_prob=0.05):
        assert text is not None and (len(text) <= limit or "\ufffd" in text)  # invalid UTF-8: approximate
        assert len(state.value_bytes.decode("utf-8", errors="ignore")) <= limit


def test_len_tokens(vocab):
    for op, n, want in [("<", 4, 3), ("<=", 4, 4), ("<", 1, 0)]:
        for text, state, stop in run_many(length(op, n, unit="tokens"), vocab, n=10, end_prob=0.0):
            assert state.n_tokens == want
            if want:
                assert stop is not None and stop.keep == want and stop.tail == "" and stop.text == state.text


def test_not_len(vocab):
    for text, state, _ in run_many(AND(NOT(length("<", 4)), length("<", 8)), vocab, n=30):
        assert text is not None and 4 <= len(text) < 8
