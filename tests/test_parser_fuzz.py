"""Fuzzing the front end: on any input, parse_query + check_query either succeed or raise an LMQError
subclass; nothing else, and never slowly."""
from __future__ import annotations

import time

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
    t = time.perf_counter()
    try:
        q = parse_query(text)
        holes_of(q)
        free_names(q)
        check_query(q)
        check_query(q, inputs=set(), known_globals={"x"})
    except LMQError as e:
        str(e)
    assert time.perf_counter() - t < 2.0, f"front end too slow on {text!r}"


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


@pytest.mark.parametrize("text", [
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
])
def test_deeply_nested_or_huge_input_fails_fast(text):
    t = time.perf_counter()
    try:
        q = parse_query(text)
        check_query(q, inputs=set())
    except LMQError as e:
        if text.startswith("(" * 10):
            assert isinstance(e, LMQSyntaxError)
    assert time.perf_counter() - t < 5.0


def test_5000_open_parens_is_a_syntax_error():
    t = time.perf_counter()
    with pytest.raises(LMQSyntaxError):
        parse_query("(" * 5000)
    assert time.perf_counter() - t < 1.0
