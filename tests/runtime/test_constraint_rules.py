"""Constraints as token masks plus stop rules, driven by simulated pickers on the real SmolLM2 tokenizer: stop
rules, REGEX / JSON / GRAMMAR through llguidance, and / or / not, property tests, and a constraint compiled
once while its arguments keep their values (the rest: test_constraints.py)."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from lmq_backend.errors import LMQConstraintConflictError, LMQRuntimeError
from lmq_backend.language import ast
from lmq_backend.runtime.constraints import Stop, compile_hole_constraint

from support.constraint_sim import (AND, N, NOT, OR, SPAN, call, choice, compiled, contains, length, run_many, short_tokens,
                            simulate)


# ----- stop rules ----------------------------------------------------------------------------------------

def _check_stop(vocab, state, stop: Stop):
    kept = vocab.decode_bytes(state.tokens[:stop.keep])
    assert stop.keep <= state.n_tokens
    assert state.value_bytes.startswith(kept)
    if "\ufffd" not in stop.text:  # exact when the value is valid UTF-8
        assert kept + stop.tail.encode() == stop.text.encode()
        assert state.value_bytes.startswith(stop.text.encode())


@pytest.mark.parametrize("func, s", [("STOPS_AT", "\n"), ("STOPS_AT", "."), ("STOPS_BEFORE", "."),
                                     ("STOPS_AT", "ab"), ("STOPS_BEFORE", "ab"), ("STOPS_AT", "é!")])
def test_stops(vocab, func, s):
    b = s.encode()

    pref = vocab.tokens_containing(b[:1]) | vocab.tokens_containing(b[-1:])

    def prefer(ids):  # tokens containing the stop string's bytes, so it often ends inside a token
        return ids[pref[ids]]
    fired = 0
    for text, state, stop in run_many(call(func, "X", s), vocab, n=40, prefer=prefer, end_prob=0.0, max_steps=40):
        if stop is None:
            continue
        fired += 1
        _check_stop(vocab, state, stop)
        value = state.value_bytes.decode("utf-8", errors="replace")
        if func == "STOPS_AT":
            assert stop.text.endswith(s) and stop.text.count(s) == 1
        else:
            assert s not in stop.text and value.startswith(stop.text + s)
    assert fired > 10 or len(b) > 2


def test_stop_inside_token(vocab):
    hc = compiled(call("STOPS_AT", "X", "."), vocab)
    s = hc.start()
    s.advance(int(vocab.bytes_to_ids[b"Hello"][0]))
    tok = [b for b in vocab.bytes_to_ids if b.startswith(b".") and len(b) > 2][0]
    stop = s.advance(int(vocab.bytes_to_ids[tok][0]))
    assert stop == Stop(text="Hello.", keep=1, tail=".")
    hc = compiled(call("STOPS_BEFORE", "X", "lo."), vocab)
    s = hc.start()
    s.advance(int(vocab.bytes_to_ids[b"Hello"][0]))
    stop = s.advance(int(vocab.bytes_to_ids[tok][0]))
    assert stop == Stop(text="Hel", keep=0, tail="Hel")
    # the earliest stop of several wins
    hc = compiled(AND(call("STOPS_AT", "X", "."), call("STOPS_BEFORE", "X", "l")), vocab)
    s = hc.start()
    stop = s.advance(int(vocab.bytes_to_ids[b"Hello"][0]))
    assert stop == Stop(text="He", keep=0, tail="He")


def _token(vocab, text: str) -> int:
    return int(vocab.bytes_to_ids[text.encode()][0])


def test_a_token_under_a_limit_is_one_the_value_can_end_within_the_limit_after(vocab):
    """Under a constraint on the text and a token limit, each token the mask holds leaves a value that can still
    end within the tokens the limit leaves: `X in [...] and len(TOKENS(X)) < 2` takes the one-token option (none:
    the mask is empty, the hole cannot be satisfied, not cut short); a three-token option needs a limit that
    leaves it enough tokens, from its first; a token that leaves a rest no token spells is never taken."""
    options = [" strawberry milkshake deluxe", " fig"]
    strawberry = _token(vocab, " strawberry")
    state = compiled(AND(choice(options), length("<", 2, unit="tokens")), vocab).start()
    assert np.flatnonzero(state.allowed()).tolist() == [_token(vocab, " fig")]
    assert state.allows(_token(vocab, " fig")) and not state.allows(strawberry)
    assert not compiled(AND(choice(options[:1]), length("<", 2, unit="tokens")), vocab).start().allowed().any()
    state = compiled(AND(choice(options), length("<", 3, unit="tokens")), vocab).start()
    assert not state.allows(strawberry)  # " milkshake deluxe" takes more tokens than one
    state = compiled(AND(choice(options), length("<", 8, unit="tokens")), vocab).start()  # (as encoded: 7)
    assert state.allows(strawberry)
    state.advance(strawberry)
    rest = [vocab.token_bytes[t] for t in np.flatnonzero(state.allowed())]
    assert rest and all(b" milkshake deluxe".startswith(b) for b in rest)
    # " apple pie" under a limit of 3: after " a", no two tokens spell "pple pie"; " apple" leaves " pie"
    state = compiled(AND(choice([" apple pie", " pear"]), length("<", 4, unit="tokens")), vocab).start()
    a, apple = _token(vocab, " a"), _token(vocab, " apple")
    assert not state.allows(a) and state.allows(apple)
    state = compiled(AND(call("INT", "X"), length("<", 2, unit="tokens")), vocab).start()
    ending = [vocab.token_bytes[t] for t in np.flatnonzero(state.allowed())]
    assert ending and all(re.fullmatch(rb" ?[0-9]+", b) for b in ending)
    state = compiled(AND(call("INT", "X"), length("<", 3, unit="tokens")), vocab).start()
    assert state.allows(_token(vocab, "-"))  # a digit may follow


def test_a_stop_where_the_constraint_may_not_end_says_so(vocab):
    """A stop rule that ends the value where the rest of its constraint does not let it end gives a `Stop` that
    is `broken` (the backend refuses the value): the token limit inside an option, STOPS_AT before it is whole;
    one where it may end is not."""
    state = compiled(AND(choice([" strawberry milkshake"]), length("<", 2, unit="tokens")), vocab).start()
    stop = state.advance(_token(vocab, " strawberry"))  # (what the mask would not offer)
    assert stop.text == " strawberry" and stop.broken == "the token limit (1 tokens)"
    state = compiled(AND(choice([" apple pie"]), call("STOPS_AT", "X", " app")), vocab).start()
    stop = state.advance(_token(vocab, " apple"))
    assert stop.text == " app" and stop.broken == "STOPS_AT(' app')"
    state = compiled(AND(choice([" apple pie", " apple"]), call("STOPS_BEFORE", "X", " pie")), vocab).start()
    assert state.advance(_token(vocab, " apple")) is None
    stop = state.advance(_token(vocab, " pie"))
    assert stop.text == " apple" and stop.broken == ""
    state = compiled(AND(call("STOPS_AT", "X", "."), length("<", 2, unit="tokens")), vocab).start()
    assert state.advance(_token(vocab, " fig")).broken == ""  # (free text: every value may end)


def test_stop_with_mask(vocab):
    for text, state, stop in run_many(AND(call("STOPS_AT", "X", " "), NOT(contains("\n")), length("<", 40)),
                                      vocab, n=40, end_prob=0.02):
        assert text is not None and "\n" not in text and len(text) < 40
        if stop is not None:
            assert text.endswith(" ") and text.count(" ") == 1


# ----- llguidance: REGEX, JSON, GRAMMAR ------------------------------------------------------------------

@pytest.mark.parametrize("rx", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
                                r"\d+(\.\d+)?", r"[A-Z][a-z]{0,5}"])
def test_regex(vocab, rx):
    done = 0
    for prefer in (None, short_tokens(vocab, 2)):
        for text, state, _ in run_many(call("REGEX", "X", rx), vocab, n=20, prefer=prefer, end_prob=0.3,
                                       max_steps=80):
            if text is None:  # ran out of steps on an unbounded repetition
                continue
            done += 1
            assert re.fullmatch(rx, text), text
    assert done >= 10


def test_json(vocab):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for sch in (schema, json.dumps(schema)):
        results = run_many(call("JSON", "X", sch), vocab, n=8, end_prob=0.5, max_steps=200,
                           prefer=short_tokens(vocab, 4))
        for text, state, _ in results:
            assert text is not None, state.text
            obj = json.loads(text)
            assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_grammar(vocab):
    lark = 'start: expr\nexpr: NUM | "(" expr ("+" | "*") expr ")"\nNUM: /[0-9]/'
    n_ok = 0
    for text, state, _ in run_many(call("GRAMMAR", "X", lark), vocab, n=20, end_prob=0.9, max_steps=60):
        if text is None:
            continue
        n_ok += 1
        assert re.fullmatch(r"[0-9()+*]+", text)
        eval(text)  # a well-formed expression
    assert n_ok > 10


def test_regex_stopped_matcher(vocab):
    s = compiled(call("REGEX", "X", "ab"), vocab).start()
    for b in (b"a", b"b"):
        assert s.advance(int(vocab.bytes_to_ids[b][0])) is None
    assert s.can_end() and not s.allowed().any()


def test_every_state_starts_from_the_first_mask_computed_once(vocab, monkeypatch):
    """The states of a REGEX start where its template matcher is: their first mask is the template's, computed
    once a vocabulary and shared (read-only); after a token each computes its own."""
    from lmq_backend.runtime.constraints import llg

    hc = compiled(call("REGEX", "X", r"[a-c]{1,40}!"), vocab)
    first = hc.start().allowed()
    real, computed = llg._mask_of, []
    monkeypatch.setattr(llg, "_mask_of", lambda m, v: computed.append(m) or real(m, v))
    states = [hc.start() for _ in range(5)]
    assert all(np.array_equal(s.allowed(), first) for s in states) and computed == []
    fresh = llg._new_matcher(vocab, llg._llg_grammar("REGEX", r"[a-c]{1,40}!"), "REGEX", None)
    assert np.array_equal(real(fresh, vocab), first) and first.any()
    s = states[0]
    s.advance(int(vocab.bytes_to_ids[b"a"][0]))
    after = s.allowed()
    assert len(computed) == 1 and after[int(vocab.bytes_to_ids[b"!"][0])]
    assert np.array_equal(states[1].allowed(), first)  # the others did not move


@pytest.mark.parametrize("kind, arg", [("REGEX", r"[a-c ]{1,30}!"), ("GRAMMAR", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'),
                                       ("JSON", {"type": "object", "properties": {"a": {"type": "string"}}})])
def test_allows_is_the_mask_at_that_token(vocab, kind, arg):
    """`allows(t)` (llguidance: one token checked, no mask) is `allowed()[t]`, alone and under `and` (the only
    place llguidance's constraints may be), on random walks; two states advanced alike, one asked only
    `allows`, the other only `allowed`."""
    rng = random.Random(3)
    for c in (call(kind, "X", arg), AND(call(kind, "X", arg), contains("z"))):
        hc = compiled(c, vocab)
        for _ in range(3):
            checked, masked = hc.start(), hc.start()
            for _ in range(12):
                mask = masked.allowed()
                options = np.flatnonzero(mask)
                tokens = [t for t in rng.sample(range(vocab.size), 150) + list(options[:60]) if vocab.nonspecial[t]]
                assert [checked.allows(int(t)) for t in tokens] == [bool(mask[t]) for t in tokens]
                if not len(options):
                    break
                t = int(rng.choice(options))
                if checked.advance(t) is not None or masked.advance(t) is not None:
                    break


def test_bad_runtime_regex(vocab):
    with pytest.raises(LMQRuntimeError):
        compiled(call("REGEX", "X", "(["), vocab)


# ----- and / or / not -------------------------------------------------------------------------------------

def test_and_or_combos(vocab):
    c = AND(choice(["12", "1234", "abc", " 7"]), call("INT"))
    for text, _, _ in run_many(c, vocab, n=30):
        assert text in ("12", "1234", " 7")
    c = OR(call("INT"), choice(["none", "many"]))
    for text, _, _ in run_many(c, vocab, n=60, end_prob=0.3):
        assert text in ("none", "many") or re.fullmatch(r" ?-?[0-9]+", text), text
    c = AND(call("STARTS_WITH", "X", "ab"), NOT(contains("z")), length("<=", 6))
    for text, _, _ in run_many(c, vocab, n=30, end_prob=0.1):
        assert text.startswith("ab") and "z" not in text and len(text) <= 6
    c = AND(NOT(choice(["yes", "no"])), length("<", 4))
    for text, _, _ in run_many(c, vocab, n=60, end_prob=0.3, prefer=short_tokens(vocab, 1)):
        assert text not in ("yes", "no") and (len(text) < 4 or "\ufffd" in text)  # invalid UTF-8: approximate
    c = AND(call("REGEX", "X", "[a-z]{1,6}"), NOT(contains("e")), call("STOPS_AT", "X", "q"))
    for text, state, stop in run_many(c, vocab, n=30, end_prob=0.2):
        assert text is not None and "e" not in text and re.fullmatch("[a-z]{1,6}", text)
    # not (A or B) == not A and not B
    c = NOT(OR(contains("a"), contains("b")))
    for text, _, _ in run_many(c, vocab, n=30, end_prob=0.05, max_steps=20):
        if text is not None:
            assert "a" not in text and "b" not in text


def test_unsatisfiable_at_runtime(vocab):
    s = compiled(AND(choice(["abc"]), call("REGEX", "X", "[0-9]+")), vocab).start()
    assert not s.allowed().any() and not s.can_end()
    # options are filtered by the other conditions at compile time; none left: a conflict
    with pytest.raises(LMQConstraintConflictError):
        compiled(AND(choice(["abc"]), call("INT")), vocab)
    hc = compiled(AND(choice(["dog", "cat"]), contains("a")), vocab)
    s = hc.start()
    assert not s.allowed()[vocab.bytes_to_ids[b"d"]].any()


def test_unconstrained(vocab):
    hc = compiled(None, vocab)
    s = hc.start()
    assert s.allowed() is None and s.can_end()
    assert s.advance(int(vocab.bytes_to_ids[b"hi"][0])) is None
    assert s.text == "hi" and s.n_tokens == 1


def test_special_never_allowed(vocab):
    for c in [choice(["a"]), call("INT"), call("STARTS_WITH", "X", "a"), NOT(contains("a")), length("<", 3),
              call("REGEX", "X", ".*"), OR(call("INT"), choice(["b"]))]:
        s = compiled(c, vocab).start()
        m = s.allowed()
        if m is not None:
            assert not (m & vocab.special).any()
            assert not m[sorted(vocab.eos_ids)].any()


# ----- hypothesis -----------------------------------------------------------------------------------------

# (SmolLM2's tokenizer drops some control characters such as "\x16": leave category Cc out)
option_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=0, max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.lists(option_text, min_size=1, max_size=6), seed=st.integers(0, 10_000))
def test_choice_property(vocab, options, seed):
    # (SmolLM2 has no token for some bytes, e.g. 0xF1: characters it cannot spell are left out)
    assume(all(vocab.decode_bytes(vocab.encode(o)) == o.encode() for o in options))
    hc = compiled(choice(options), vocab)
    rng = random.Random(seed)
    for prefer in (None, short_tokens(vocab, 1)):
        text, state, stop = simulate(hc, rng, end_prob=0.3, max_steps=200, vocab=vocab, prefer=prefer)
        assert text in options


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(needle=st.text(min_size=1, max_size=4), seed=st.integers(0, 10_000))
def test_not_contains_property(vocab, needle, seed):
    hc = compiled(NOT(contains(needle)), vocab)
    text, state, _ = simulate(hc, random.Random(seed), end_prob=0.02, max_steps=25, vocab=vocab,
                              prefer=short_tokens(vocab, 2))
    assert needle.encode() not in state.value_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=3),
       before=st.booleans(), seed=st.integers(0, 10_000))
def test_stop_property(vocab, stop, before, seed):
    assume(vocab.decode_bytes(vocab.encode(stop)) == stop.encode())
    hc = compiled(call("STOPS_BEFORE" if before else "STOPS_AT", "X", stop), vocab)
    rng = random.Random(seed)
    state = hc.start()
    # feed a tokenization of some random text with the stop string inside
    text = "".join(rng.choice(["ab", " ", stop, "é", "xyz", "\n"]) for _ in range(8)) + stop
    for tok in vocab.encode(text):
        res = state.advance(tok)
        if res is not None:
            break
    assert res is not None
    _check_stop(vocab, state, res)
    i = text.find(stop)
    assert res.text == (text[:i] if before else text[:i + len(stop)])


# ----- a constraint compiled once, reused while its arguments keep their values ------------------------------

def test_a_constraint_is_compiled_once_while_its_arguments_keep_plain_equal_values(vocab):
    """The same constraint object whose arguments evaluate to equal plain values gets the compiled constraint
    back; a new value compiles again (a stale one would keep the old limit or options)."""
    c = ast.And((ast.LenLimit("X", "tokens", "<", N("n"), SPAN), ast.Call("STOPS_AT", "X", (N("stop"),), SPAN)))
    scope = {"n": 5, "stop": "."}
    ev = lambda e: eval(e.code, {}, scope)  # noqa: E731
    first = compile_hole_constraint(c, ev, vocab)
    assert compile_hole_constraint(c, ev, vocab) is first
    assert first.max_tokens == 4 and first.stops[0].s == b"."
    scope["n"] = 9
    again = compile_hole_constraint(c, ev, vocab)
    assert again is not first and again.max_tokens == 8
    scope["stop"] = "!"
    assert compile_hole_constraint(c, ev, vocab).stops[0].s == b"!"
    scope["n"] = 1
    compile_hole_constraint(c, ev, vocab)
    scope["n"] = True  # equal to 1, but no int: the compiler's error, not the constraint of n=1
    with pytest.raises(LMQRuntimeError):
        compile_hole_constraint(c, ev, vocab)


def test_a_holes_conjuncts_built_anew_each_call_find_their_compiled_constraint(vocab):
    """A hole's conjuncts (and a query's global `where` with them) come as a new `And` each call
    (`constraint_for_hole`): an equal one gets the compiled constraint back, as the same object does, so a
    REGEX hole with a length limit is not compiled again at every call of its query."""
    from lmq_backend.language import parse_query
    from lmq_backend.runtime.constraints import constraint_for_hole

    where = parse_query('"a[S]" where len(TOKENS(S)) < 17 and REGEX(S, r"[a-z]+")').body[0].where
    ev = lambda e: eval(e.code, {}, {})  # noqa: E731
    first, second = constraint_for_hole(where, "S"), constraint_for_hole(where, "S")
    assert first is not second and first == second
    assert compile_hole_constraint(second, ev, vocab) is compile_hole_constraint(first, ev, vocab)


def test_a_constraint_with_a_mutable_argument_compiles_every_call(vocab):
    options = ["yes", "no"]
    c = ast.Choice("X", N("options"), SPAN)
    ev = lambda e: eval(e.code, {}, {"options": options})  # noqa: E731
    first = compile_hole_constraint(c, ev, vocab)
    options.append("maybe")  # the same list, changed: its new option must be allowed
    second = compile_hole_constraint(c, ev, vocab)
    assert second is not first
    state = second.start()
    for t in vocab.encode("maybe"):
        assert state.allowed()[t]
        state.advance(t)
    assert state.can_end()
