"""Fuzzing the front end: on any input, parse_query + check_query either succeed or raise an LMQError
subclass; nothing else, and never slowly.

"Never slowly" is checked without a clock: the front end's work (Python calls, lark's steps included,
counted with sys.setprofile) must grow linearly with the input, and stop growing once a depth limit is
hit; the huge inputs run in a subprocess whose generous timeout is only a guard against a hang."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_backend.errors import LMQError, LMQSyntaxError
from lmq_backend.language import check_query, free_names, holes_of, parse_query

from test_grammar import EXAMPLES, FULL

CORPUS = EXAMPLES + [
    FULL,
    '"Q: What is the capital of {country}?\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n")\nreturn ANSWER.strip()',
    'lmql\n"a [[b]] {{c}} { {\'k\': 1}[\'k\'] } [X]"\nwhere\n    INT(X) and\n    len(X) < 3\n',
    "argmax\n    '''multi\n    line [A] {x}'''\n    x = [a for a in A]\nfrom\n    'm'\n",
    '"[A][B]"\nif A in ["x"]: "[C]"\nelif B: pass\nelse:\n    for i, j in z:\n        break\n'
    'distribution\n    C in ["1", "2"]',
]

TOKENS = [
    "[", "]", "{", "}", '"', "'", '"""', "'''", "[[", "]]", "{{", "}}", "[X]", "[ANSWER]", "{x}", "{ {",
    "where", " where ", "and", " and\n", "or", "not", "in", " not in ", "(", ")", ":", ",", "=", "+=",
    "\n", "\n    ", "    ", "\t", "\r\n", "#", "\\", "\\n", "if ", "elif ", "else:", "for ", "return", "pass",
    "from", "distribution", "len(", "TOKENS(", "STOPS_AT(", "INT(", "REGEX(", "FOO(", "argmax", "sample(n=2)",
    "beam(n=3)", "lambda", "*", "**", "...", ".", "0x", "1e", "r\"", "f\"", "b\"", "\x00", "é", "\u2028",
    "\x0c", "lmql\n",
]


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(CORPUS))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "swap_lines", "dup_line", "insert_char"]))
        n = len(text)
        i = draw(st.integers(0, n))
        if op == "insert":
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[i:]
        elif op == "insert_char":
            text = text[:i] + draw(st.characters()) + text[i:]
        elif op == "delete" and n:
            j = draw(st.integers(i, min(n, i + 8)))
            text = text[:i] + text[j:]
        elif op == "replace" and n:
            j = draw(st.integers(i, min(n, i + 4)))
            text = text[:i] + draw(st.sampled_from(TOKENS)) + text[j:]
        else:
            lines = text.split("\n")
            a = draw(st.integers(0, len(lines) - 1))
            b = draw(st.integers(0, len(lines) - 1))
            if op == "swap_lines":
                lines[a], lines[b] = lines[b], lines[a]
            else:
                lines.insert(b, lines[a])
            text = "\n".join(lines)
    return text


def run_front_end(text: str) -> None:
    try:
        q = parse_query(text)
        holes_of(q)
        free_names(q)
        check_query(q)
        check_query(q, inputs=set(), known_globals={"x"})
    except LMQError as e:
        str(e)


FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(mutated())
def test_mutated_queries(text):
    run_front_end(text)


@settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(st.sampled_from(TOKENS + ["X", "x", "1", '"a"', " "]), max_size=40).map("".join))
def test_token_soup(text):
    run_front_end(text)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.text(max_size=200))
def test_random_text(text):
    run_front_end(text)


@pytest.mark.parametrize("text", CORPUS)
def test_corpus_is_valid(text):
    q = parse_query(text)
    check_query(q)


# ----- pathological inputs: bounded work, no clock ----------------------------------------------------

def outcome(text: str) -> str:
    """"ok" or the name of the LMQError the front end raised."""
    try:
        check_query(parse_query(text), inputs=set())
        return "ok"
    except LMQError as e:
        return type(e).__name__


def work(text: str) -> tuple[int, str]:
    """(the front end's steps on `text`, its outcome): Python lines executed (a loop's every iteration
    counts) and calls of Python and C functions (lark's lexer and parser steps among them)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1
        return trace

    def profile(frame, event, arg):
        nonlocal count
        if event == "c_call":
            count += 1

    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        result = outcome(text)
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return count, result


# input families of a size parameter n, and the n at which to compare n with 2n (the outcome is the same
# at both: a depth limit is either not reached or reached at both)
FAMILIES = {
    "open parens": (lambda n: "(" * n, 1000),
    "balanced parens": (lambda n: "x = " + "(" * n + "1" + ")" * n, 1000),
    "open brackets": (lambda n: "x = " + "[" * n, 1000),
    "unary minus": (lambda n: "x = " + "-" * n + "1", 200),
    "not chain": (lambda n: "x = " + "not " * n + "1", 200),
    "not in a constraint": (lambda n: '"[X]" where ' + "not " * n + "INT(X)", 200),
    "attribute chain": (lambda n: "x = " + "a." * n + "b", 200),
    "subscript chain": (lambda n: "x = a" + "[0]" * n, 50),
    "call chain": (lambda n: "x = f" + "()" * n, 200),
    "long sum": (lambda n: "x = " + " + ".join(["1"] * n), 100),
    "brackets in an interpolation": (lambda n: '"{' + "[" * n + "]" * n + '}"', 1000),
    "minus in an interpolation": (lambda n: '"{' + "-" * n + '1}"', 200),
    "escaped brackets": (lambda n: '"' + "[[" * n + '"', 1000),
    "unterminated triple quote": (lambda n: '"""' + "a" * n, 10000),
    "nested ifs": (lambda n: "".join("    " * i + "if x:\n" for i in range(n)) + "    " * n + "pass", 40),
    "many prompts with holes": (lambda n: "".join(f'"q{i} [X{i}]" where len(X{i}) < 3\n' for i in range(n)), 20),
    "many statements": (lambda n: "x = 1\n" * n, 40),
    "a long option list": (lambda n: '"[X]" where X in [' + ", ".join(f'"o{i}"' for i in range(n)) + "]", 100),
    "many conjuncts": (lambda n: '"[X]" where ' + " and ".join(["len(X) < 5"] * n), 20),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_front_end_work_grows_linearly(family):
    """Doubling n multiplies the front end's work by no more than it multiplies the input's length."""
    make, n = FAMILIES[family]
    outcome(make(n // 4))  # warm up whatever is computed once
    small, big = work(make(n)), work(make(2 * n))
    assert small[1] == big[1]
    growth = len(make(2 * n)) / len(make(n))
    assert big[0] <= 1.05 * growth * small[0], (
        f"{family}: {small[0]} calls at n={n}, {big[0]} at n={2 * n} (the input {growth:.2f}x longer)")


@pytest.mark.parametrize("make", [lambda n: "(" * n, lambda n: "x = " + "[" * n, lambda n: '"""' + "a" * n])
def test_past_a_limit_the_work_stops_growing(make):
    """An input past a depth limit fails at the limit: ten times longer input, no more work."""
    assert work(make(5000)) == work(make(50000))
    assert work(make(5000))[1] == "LMQSyntaxError"


HUGE = [
    "(" * 5000,
    "x = " + "(" * 5000 + "1" + ")" * 5000,
    "x = " + "[" * 5000,
    "x = " + "-" * 5000 + "1",
    "x = " + "not " * 5000 + "1",
    '"[X]" where ' + "not " * 5000 + "INT(X)",
    "x = " + "a." * 5000 + "b",
    "x = " + "a" + "[0]" * 5000,
    "x = " + "f" + "()" * 5000,
    "x = " + " + ".join(["1"] * 5000),
    '"{' + "[" * 5000 + "]" * 5000 + '}"',
    '"{' + "-" * 5000 + '1}"',
    "".join("    " * i + "if x:\n" for i in range(150)) + "    " * 150 + "pass",
    '"' + "[[" * 50000 + '"',
    '"""' + "a" * 200000,
]


def test_huge_inputs_end_with_a_result_or_an_lmq_error():
    """Each input ends in success or an LMQError (a syntax error for the unbalanced parentheses). In a
    subprocess: its 10-minute timeout only guards against a hang (the inputs take seconds)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_parser_fuzz as t; "
            "print(json.dumps([t.outcome(x) for x in t.HUGE]))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == len(HUGE) and all(r == "ok" or r.startswith("LMQ") for r in results)
    assert results[0] == "LMQSyntaxError"


def test_5000_open_parens_is_a_syntax_error():
    with pytest.raises(LMQSyntaxError):
        parse_query("(" * 5000)
