"""Bad queries: each gives its LMQError subclass, syntax errors with line, column and a caret line."""
from __future__ import annotations

import pytest

from lmq_backend.errors import (
    LMQCompileError, LMQConstraintConflictError, LMQError, LMQNotSupportedError, LMQSyntaxError,
    LMQUnknownConstraintError, LMQUnknownVariableError,
)
from lmq_backend.language import check_query, parse_query


def parse_and_check(text, **kw):
    q = parse_query(text)
    check_query(q, **kw)
    return q


# (source, line, column, message fragment)
SYNTAX_ERRORS = [
    ('"a [ b"', 1, 4, "'[' must start a hole"),
    ('"ok"\n"a[X] and [1]"', 2, 11, "'[' must start a hole"),
    ('"a [X ]"', 1, 4, "'[' must start a hole"),
    ('"""line one\nline [two"""', 2, 6, "'[' must start a hole"),
    ('"a {x"', 1, 4, "'{' was never closed"),
    ('"a }"', 1, 4, "single '}'"),
    ('"a {}"', 1, 4, "empty expression"),
    ('"a {1 +}"', 1, 5, "invalid Python expression"),
    ('"[X]"\nif X ==:\n    "b"', 2, 8, "unexpected ':'"),
    ('argmax\n    "a"\n  "b"', 3, 3, "unindent does not match"),
    ('"a"\n    "b"', 2, 5, "unexpected indent"),
    ('x = 1\n    "a"', 2, 5, "unexpected indent"),
    ('if x:\n"a"', 2, 1, "expected an indented block"),
    ('"[X]"\nreturn foo(', 2, 11, "'(' was never closed"),
    ('"abc', 1, 1, "unterminated string"),
    ('"""abc\n\ndef', 1, 1, "unterminated string"),
    ('x = 1 $ 2', 1, 7, "unexpected character '$'"),
    ('x + 1 = 2', 1, 1, "cannot assign"),
    ('for 1 in x:\n    "a"', 1, 5, "cannot assign"),
    ('"a[X]" where X in ["a"] where', 1, 25, "unexpected 'where'"),
    ('argmax(3)\n    "a"', 1, 1, "keyword arguments"),
    ('sample(n=x)\n    "a"', 1, 1, "must be a Python literal"),
    ('b"[X]"', 1, 1, "bytes"),
    ('"a\\N{nosuchname}"', 1, 1, "invalid string literal"),
    ('argmax\n    "a"\n"b"', 3, 1, "statement after the indented query body"),
    ('"[X]"\nwhere\n    INT(X) and', 3, 15, "unexpected end of input"),
    ('from "m"\n"a"', 2, 1, "unexpected"),
    ('x = (1,\n     2]\n', 2, 7, "unexpected ']'"),
    ('"a {x!z}"', 1, 6, "a conversion is '!r', '!s' or '!a'"),
    ('"a {x!r }"', 1, 6, "a conversion is '!r', '!s' or '!a'"),
    ('"a {x:>8"', 1, 4, "'{' was never closed"),
    ('"a {x:>{w}"', 1, 4, "'{' was never closed"),
    ('"a {!r}"', 1, 4, "empty expression before '!'"),
    ('"a {x:{}}"', 1, 7, "empty expression"),
    ('"a {x = 1}"', 1, 9, "expected '}', '!' or ':' after '='"),
    ('"a {x:{1 +}}"', 1, 8, "invalid Python expression"),
    ('"a [X:.2f]"', 1, 7, "a hole takes a type after ':', not a format spec"),
    ('"a [X: >8]"', 1, 7, "a hole takes a type after ':', not a format spec"),
    ('"a [X!r]"', 1, 6, "a hole [X] takes no conversion or format spec"),
    ('"a [X=]"', 1, 6, "a hole [X] takes no conversion or format spec"),
    ('"a [X: 1 +]"', 1, 8, "invalid Python expression"),
]


@pytest.mark.parametrize("text,line,column,fragment", SYNTAX_ERRORS)
def test_syntax_errors(text, line, column, fragment):
    with pytest.raises(LMQSyntaxError) as info:
        parse_query(text)
    e = info.value
    assert fragment in e.message
    if line:
        assert (e.line, e.column) == (line, column), str(e)
        shown = str(e).splitlines()
        # the message, the offending line, then the caret under the column
        assert shown[1].strip() == text.splitlines()[line - 1].strip()
        assert shown[2].index("^") == 4 + column - 1


def test_caret_message_format():
    with pytest.raises(LMQSyntaxError) as info:
        parse_query('argmax\n    "Q: [ANSWER"\n')
    text = str(info.value)
    assert text.splitlines() == [
        "'[' must start a hole [NAME] or [NAME: type] (write '[[' for a literal '[') (line 2, column 9)",
        '        "Q: [ANSWER"',
        "            ^",
    ]


def test_unknown_constraint_function():
    with pytest.raises(LMQUnknownConstraintError) as info:
        parse_query('"a[X]"\nwhere INT(X) and FOO(X)')
    msg = str(info.value)
    assert "FOO" in msg and "line 2, column 18" in msg and "STOPS_AT(VAR, s)" in msg


@pytest.mark.parametrize("where", [
    "lower(X)", "len(X) == 3", "X == 'a'", "1 < len(X) < 3", "INT(X, 3)", "STOPS_AT(X)",
    "STOPS_AT('a', X)", "REGEX(X, pattern='a')", "len(X + 'a') < 3", "X.startswith('a')", "True", "X",
    "len(TOKENS(X), 2) < 3", "'a' in 'b'",
])
def test_unknown_constraint_forms(where):
    with pytest.raises(LMQUnknownConstraintError):
        parse_query(f'"a[X]" where {where}')


def test_unknown_hole_in_constraint():
    with pytest.raises(LMQUnknownVariableError) as info:
        parse_and_check('"Q:[ANSWER]" where STOPS_AT(ANSWR, "\\n")')
    assert "'ANSWR' is not a hole of this query (holes: ANSWER)" in str(info.value)
    with pytest.raises(LMQUnknownVariableError):
        parse_and_check('"Q:[ANSWER]"\nwhere not "\\n" in ANSWR')
    with pytest.raises(LMQUnknownVariableError):
        parse_and_check('"Q:[ANSWER]"\nwhere len(TOKENS(ANSWR)) < 3')


@pytest.mark.parametrize("options", ["[]", "()", "set()", "{}", "list()", "set([])"])
def test_empty_choice(options):
    with pytest.raises(LMQConstraintConflictError):
        parse_and_check(f'"a[X]" where X in {options}')


def test_negated_empty_choice_is_fine():
    parse_and_check('"a[X]" where not X in []')


@pytest.mark.parametrize("decoder", ["beam(n=3)", "beam_var(n=2, max_len=64)", "var(b=2, n=3)", "beam",
                                     "best_k(k=2, budget=10)", "beam_sample(n=3, temperature=0.7, seed=1)"])
def test_beam_decoders_parse(decoder):
    parse_and_check(f'{decoder}\n    "a[X]"')


def test_an_unknown_decoder_lists_the_known_ones():
    with pytest.raises(LMQNotSupportedError) as info:
        parse_and_check('beam_search(n=3)\n    "a[X]"')
    assert "unknown decoder 'beam_search'" in str(info.value) and "beam_sample" in str(info.value)


@pytest.mark.parametrize("decoder", ["sample(foo=1)", "argmax(n=2)", "argmax(temperature=0.5)", "greedy",
                                     "beam(n=2, top_k=3)"])
def test_unknown_decoder_or_argument(decoder):
    with pytest.raises(LMQNotSupportedError):
        parse_and_check(f'{decoder}\n    "a[X]"')


def test_known_decoder_arguments():
    parse_and_check('argmax(max_len=10, repetition_penalty=1.2)\n    "a[X]"')
    parse_and_check('sample(n=2, temperature=0.5, top_p=0.9, seed=3, max_len=5, top_k=3, repetition_penalty=1.1, '
                    'frequency_penalty=0.5, presence_penalty=-0.5)\n    "a[X]"')


@pytest.mark.parametrize("decoder, message", [
    ("sample(n=2, top_k=0)", "decoder sample (line 1, column 1): top_k must be an integer >= 1, got 0"),
    ("argmax(repetition_penalty=0)", "decoder argmax (line 1, column 1): repetition_penalty must be a number > 0"),
    ("sample(presence_penalty='x')", "decoder sample (line 1, column 1): presence_penalty must be a number in [-2, 2]"),
])
def test_a_decoding_knob_out_of_range(decoder, message):
    with pytest.raises(LMQCompileError) as info:
        parse_and_check(f'{decoder}\n    "a[X]"')
    assert message in str(info.value)


def test_distribution_errors():
    parse_and_check('"a[X][Y]"\ndistribution X in ["a"]')  # any hole, not only the last
    with pytest.raises(LMQUnknownVariableError, match="not a hole of its prompt string"):
        parse_and_check('"a[X]"\n"b[Y]" distribution X in ["a"]')
    with pytest.raises(LMQUnknownVariableError):
        parse_and_check('"a[X]"\ndistribution Z in ["a"]')
    with pytest.raises(LMQCompileError):
        parse_and_check('"a[X]"\ndistribution INT(X)')
    with pytest.raises(LMQConstraintConflictError):
        parse_and_check('"a[X]"\ndistribution X in []')


def test_unknown_inputs():
    text = 'argmax\n    "Review: {review}\\n"\n    y = helper(x)\n    "[A]"\n    return A + y'
    q = parse_query(text)
    check_query(q)                           # no inputs given: no check
    check_query(q, inputs={"review", "x"}, known_globals={"helper"})
    with pytest.raises(LMQUnknownVariableError) as info:
        check_query(q, inputs={"review"}, known_globals={"helper"})
    assert "'x'" in str(info.value) and "line 3, column 5" in str(info.value)
    with pytest.raises(LMQUnknownVariableError) as info:
        check_query(q, inputs={"x"}, known_globals={"helper"})
    assert "'review'" in str(info.value)


@pytest.mark.parametrize("text", [
    None, 3, "", "\n\n", "   ", "# just a comment", "\x00", "\ufeff", "'''", "\\", "\t\t\n  x",
])
def test_odd_inputs_only_raise_lmq_errors(text):
    try:
        q = parse_query(text)
        check_query(q, inputs=set())
    except LMQError:
        pass


def test_empty_query_is_valid():
    q = parse_query("")
    assert q.body == () and q.decoder.name == "argmax"
