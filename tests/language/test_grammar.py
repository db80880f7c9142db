"""The query grammar and parser: every rule, LMQL's documentation examples, the AST they produce (the where
clause's forms: test_grammar_where.py)."""
from __future__ import annotations

import textwrap

import pytest

from lmq_backend.language import check_query, free_names, holes_of, parse_query
from lmq_backend.language.ast import (
    And, Break, Call, Choice, Contains, Continue, Exec, For, Hole, If, Interp, LenLimit, Not, Prompt,
    Return, Span, Text,
)

# ----- LMQL documentation examples ------------------------------------------------------------------

SENTIMENT = (
    'argmax\n'
    '    """Review: We had a great stay. Hiking in the mountains was fabulous and the food is really good.\n'
    'Q: What is the underlying sentiment of this review and why?\n'
    'A:[ANALYSIS]\n'
    'Based on this, the overall sentiment of the message can be considered to be[CLASSIFICATION]"""\n'
    'from "default"\n'
    'where\n'
    '    not "\\n" in ANALYSIS and CLASSIFICATION in [" positive", " neutral", " negative"]'
)
PACKING = (
    '"A list of things not to forget when going to the sea (not travelling): \\n"\n'
    '"- Sunglasses \\n"\n'
    'for i in range(4):\n'
    '    "- [THING] \\n" where THING in set(["Volleyball", "Sunscreen", "Bathing Suite"])'
)
DATE = (
    '"Q: It is August 12th, 2020. What date was it 100 days ago? Answer in DD/MM/YYYY.\\n"\n'
    '"A: [DATE]" where REGEX(DATE, r"[0-9]{2}/[0-9]{2}/[0-9]{4}")'
)
SPIDER = '"Q: How many legs does a spider have?\\nA: [N]" where INT(N)'
DISTRIBUTION = (
    'argmax\n'
    '    "Review: {review}\\nQ: Is this review positive or negative?\\nA:[CLS]"\n'
    'from "default"\n'
    'distribution\n'
    '    CLS in [" positive", " negative"]'
)
SAMPLE = 'sample(temperature=1.2, n=3)\n    "Say \'this is a test\':[RESPONSE]" where len(TOKENS(RESPONSE)) < 25'

EXAMPLES = [SENTIMENT, PACKING, DATE, SPIDER, DISTRIBUTION, SAMPLE]


def texts(prompt):
    return [p.text if isinstance(p, Text) else p for p in prompt.pieces]


def test_sentiment_example():
    q = parse_query(SENTIMENT)
    check_query(q)
    assert q.decoder.name == "argmax" and q.decoder.args == {}
    assert q.model == "default"
    (p,) = q.body
    assert isinstance(p, Prompt) and p.where is None
    kinds = [type(x).__name__ for x in p.pieces]
    assert kinds == ["Text", "Hole", "Text", "Hole"]
    assert p.pieces[0].text.startswith("Review: We had a great stay.")
    assert p.pieces[0].text.endswith("and why?\nA:")
    assert p.pieces[1].name == "ANALYSIS" and p.pieces[1].span == Span(4, 3)
    assert p.pieces[3].name == "CLASSIFICATION"
    assert isinstance(q.where, And)
    neg, choice = q.where.parts
    assert isinstance(neg, Not) and isinstance(neg.part, Contains)
    assert neg.part.var == "ANALYSIS" and eval(neg.part.needle.code) == "\n"
    assert isinstance(choice, Choice) and choice.var == "CLASSIFICATION"
    assert eval(choice.options.code) == [" positive", " neutral", " negative"]
    assert holes_of(q) == ["ANALYSIS", "CLASSIFICATION"]
    assert free_names(q) == set()


def test_packing_list_example():
    q = parse_query(PACKING)
    check_query(q, inputs=set())
    assert q.decoder.name == "argmax"
    p1, p2, loop = q.body
    assert texts(p1) == ["A list of things not to forget when going to the sea (not travelling): \n"]
    assert texts(p2) == ["- Sunglasses \n"]
    assert isinstance(loop, For)
    assert loop.target.assigned == {"i"} and loop.target.names == frozenset()
    assert loop.iter.source == "range(4)" and loop.iter.names == {"range"}
    (inner,) = loop.body
    assert isinstance(inner.pieces[1], Hole) and inner.pieces[1].name == "THING"
    assert isinstance(inner.where, Choice) and inner.where.var == "THING"
    assert eval(inner.where.options.code) == {"Volleyball", "Sunscreen", "Bathing Suite"}
    assert holes_of(q) == ["THING"]
    assert free_names(q) == set()


def test_date_regex_example():
    q = parse_query(DATE)
    check_query(q)
    p = q.body[1]
    assert isinstance(p.where, Call) and p.where.func == "REGEX" and p.where.var == "DATE"
    (arg,) = p.where.args
    assert arg.source == 'r"[0-9]{2}/[0-9]{2}/[0-9]{4}"'
    assert eval(arg.code) == "[0-9]{2}/[0-9]{2}/[0-9]{4}"
    assert texts(p) == ["A: ", p.pieces[1]]


def test_int_example():
    q = parse_query(SPIDER)
    check_query(q)
    (p,) = q.body
    assert p.where == Call("INT", "N", (), p.where.span)
    assert texts(p)[0] == "Q: How many legs does a spider have?\nA: "


def test_distribution_example():
    q = parse_query(DISTRIBUTION)
    check_query(q, inputs={"review"})
    assert q.distribution.var == "CLS"
    assert eval(q.distribution.options.code) == [" positive", " negative"]
    (p,) = q.body
    assert isinstance(p.pieces[1], Interp) and p.pieces[1].expr.source == "review"
    assert p.pieces[1].expr.names == {"review"}
    assert free_names(q) == {"review"}


def test_distribution_one_line():
    q = parse_query('argmax\n    "A:[CLS]"\ndistribution CLS in ["a", "b"]')
    check_query(q)
    assert q.distribution.var == "CLS"


def test_sample_example():
    q = parse_query(SAMPLE)
    check_query(q)
    assert q.decoder.name == "sample" and q.decoder.args == {"temperature": 1.2, "n": 3}
    (p,) = q.body
    assert texts(p)[0] == "Say 'this is a test':"
    w = p.where
    assert isinstance(w, LenLimit) and (w.var, w.unit, w.op) == ("RESPONSE", "tokens", "<")
    assert eval(w.limit.code) == 25


# ----- statements -----------------------------------------------------------------------------------

FULL = '''\
sample(n=4, temperature=0.8, seed=1, top_p=0.9, max_len=64)   # decoder with arguments

    # a comment line, and blank lines
    "Review: {review}\\n"
    "Sentiment:[CLS]" where CLS in [" positive", " negative"]
    x = 1
    a, b = 1, 2
    x += len(review)
    items: list = []
    print(x)
    if CLS == " positive":
        "Why?[WHY]" where STOPS_AT(WHY, "\\n")
    elif CLS == " negative":
        "Why not?[WHY_NOT]"
        pass
    else:
        pass
    for i in range(3):
        if i == 2:
            break
        elif i == 0:
            continue
        "-[THING]" where STOPS_AT(THING, "\\n") and len(TOKENS(THING)) < 10
    for k, (u, v) in enumerate(pairs):
        "{k}: {u}={v}"
    return CLS
from "default"
where len(TOKENS(CLS)) < 5
'''


def test_all_statement_kinds():
    q = parse_query(FULL)
    check_query(q, inputs={"review", "pairs"})
    assert q.decoder.args == {"n": 4, "temperature": 0.8, "seed": 1, "top_p": 0.9, "max_len": 64}
    b = q.body
    assert [type(s).__name__ for s in b] == [
        "Prompt", "Prompt", "Exec", "Exec", "Exec", "Exec", "Exec", "If", "For", "For", "Return"]
    assert b[2].stmt.assigned == {"x"} and b[2].stmt.source == "x = 1"
    assert b[3].stmt.assigned == {"a", "b"}
    assert b[4].stmt.assigned == {"x"} and b[4].stmt.names == {"x", "len", "review"}
    assert b[5].stmt.assigned == {"items"}
    assert b[6].stmt.assigned == frozenset() and b[6].stmt.names == {"print", "x"}
    env = {}
    exec(b[3].stmt.code, env)
    assert env["a"] == 1 and env["b"] == 2
    iff = b[7]
    assert isinstance(iff, If) and len(iff.branches) == 2 and iff.orelse == ()
    assert iff.branches[0][0].source == 'CLS == " positive"'
    assert isinstance(iff.branches[0][1][0].where, Call)
    assert [type(s).__name__ for s in iff.branches[1][1]] == ["Prompt"]   # pass dropped
    loop = b[8]
    assert isinstance(loop.body[0], If)
    assert isinstance(loop.body[0].branches[0][1][0], Break)
    assert isinstance(loop.body[0].branches[1][1][0], Continue)
    w = loop.body[1].where
    assert isinstance(w, And) and isinstance(w.parts[0], Call) and isinstance(w.parts[1], LenLimit)
    loop2 = b[9]
    assert loop2.target.assigned == {"k", "u", "v"}
    env = {"__lmq_item__": (7, (8, 9))}
    exec(loop2.target.code, env)
    assert (env["k"], env["u"], env["v"]) == (7, 8, 9)
    assert [p.expr.source for p in loop2.body[0].pieces if isinstance(p, Interp)] == ["k", "u", "v"]
    assert isinstance(b[10], Return) and b[10].value.source == "CLS"
    assert q.model == "default"
    assert isinstance(q.where, LenLimit) and q.where.unit == "tokens"
    assert holes_of(q) == ["CLS", "WHY", "WHY_NOT", "THING"]
    assert free_names(q) == {"review", "pairs"}


def test_one_line_suites_and_return_without_value():
    q = parse_query('"a[X]"\nif X: "yes[Y]"\nfor i in range(2): x = i\nreturn')
    check_query(q)
    assert isinstance(q.body[1], If) and isinstance(q.body[1].branches[0][1][0], Prompt)
    assert isinstance(q.body[2], For) and isinstance(q.body[2].body[0], Exec)
    assert isinstance(q.body[3], Return) and q.body[3].value is None


def test_docstring_form_with_marker():
    doc = '''
        lmql
        "Q: What is the capital of {country}?\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n")
        return ANSWER.strip()

    '''
    q = parse_query(textwrap.dedent(doc))
    check_query(q, inputs={"country"})
    assert q.decoder.name == "argmax"
    p, r = q.body
    assert p.where == Call("STOPS_AT", "ANSWER", p.where.args, p.where.span)
    assert r.value.source == "ANSWER.strip()"
    assert p.span.line == 3          # the marker line is blanked, line numbers are kept
    # the parser dedents by itself, and accepts the `lmq` marker too
    q2 = parse_query(doc.replace("lmql", "lmq"))
    assert [type(s) for s in q2.body] == [Prompt, Return]


def test_decoder_at_top_level_without_indent():
    q = parse_query('sample(n=2)\n"a[X]"')
    assert q.decoder.name == "sample" and q.decoder.args == {"n": 2}
    assert len(q.body) == 1


# ----- prompt strings -------------------------------------------------------------------------------

def test_escapes_and_brackets():
    q = parse_query(r'''"a [[b]] {{c}} \"q\" \\ \t \u00e9 [X] ]"''')
    (p,) = q.body
    assert texts(p) == ['a [b] {c} "q" \\ \t é ', p.pieces[1], " ]"]
    assert p.pieces[1].name == "X"


def test_single_quotes_and_triple_single_quotes():
    q = parse_query("'one [A]'\n'''two\n[B] {x}'''")
    a, b = q.body
    assert texts(a)[0] == "one "
    assert texts(b)[0] == "two\n" and b.pieces[1].name == "B" and b.pieces[1].span == Span(3, 1)
    assert isinstance(b.pieces[3], Interp)


def test_nested_braces_in_interpolation():
    q = parse_query("""'v={ {"a": 1}["a"] } w={ "}" + x[0] } z={f(a, {1: [2]})}'""")
    (p,) = q.body
    interps = [x.expr for x in p.pieces if isinstance(x, Interp)]
    assert [e.source for e in interps] == ['{"a": 1}["a"]', '"}" + x[0]', "f(a, {1: [2]})"]
    assert eval(interps[0].code) == 1
    assert interps[1].names == {"x"} and interps[2].names == {"f", "a"}
    assert texts(p)[0] == "v="


def test_implicit_concatenation_and_raw_prompt():
    q = parse_query('"a[X]" "b"\nr"\\d[Y]"')
    p1, p2 = q.body
    assert texts(p1) == ["a", p1.pieces[1], "b"]
    assert texts(p2)[0] == "\\d"


def test_adjacent_text_is_merged():
    q = parse_query('"a[[b" "c]]d {{"')
    assert texts(q.body[0]) == ["a[bc]d {"]


def test_interpolation_names_exclude_comprehension_and_lambda_bound():
    q = parse_query('"{[y * k for y in ys]} {(lambda z: z + w)(1)} { {a: b for a, b in d.items()} }"')
    names = [x.expr.names for x in q.body[0].pieces if isinstance(x, Interp)]
    assert names == [{"k", "ys"}, {"w"}, {"d"}]


def fields(prompt):
    """Each Interp of a prompt as (source, conversion, spec texts: nested fields by their source)."""
    def spec(i):
        if i.spec is None:
            return None
        return [p.text if isinstance(p, Text) else "{" + p.expr.source + "}" for p in i.spec]
    return [(p.expr.source, p.conversion, spec(p)) for p in prompt.pieces if isinstance(p, Interp)]


def test_conversions_and_format_specs_as_in_f_strings():
    q = parse_query('"Price: {x:.2f} {name!r} {x:>8} {n:,} {s!a:^{w}.{p}} {d:%H:%M} {v!s}"')
    (p,) = q.body
    assert fields(p) == [("x", None, [".2f"]), ("name", "r", None), ("x", None, [">8"]), ("n", None, [","]),
                         ("s", "a", ["^", "{w}", ".", "{p}"]), ("d", None, ["%H:%M"]), ("v", "s", None)]
    assert texts(p)[0] == "Price: " and all(i.formatted for i in p.pieces if isinstance(i, Interp))
    assert [i.expr.span for i in p.pieces[9].spec if isinstance(i, Interp)] == [Span(1, 46), Span(1, 50)]
    assert free_names(q) == {"x", "name", "n", "s", "w", "p", "d", "v"}  # a nested field's names too


def test_self_documenting_fields():
    """`{x=}` writes its source, then repr(x) (a spec: format(x, spec); a conversion: that one), as Python does."""
    (p,) = parse_query('"{x=} { y = :>4}{z=!s}"').body
    assert texts(p)[0] == "x=" and texts(p)[2] == "  y = " and texts(p)[4] == "z="
    assert fields(p) == [("x", "r", None), ("y", None, [">4"]), ("z", "s", None)]


@pytest.mark.parametrize("text, source", [
    ('"{a != b}"', "a != b"), ('"{a == b}"', "a == b"), ('"{a <= b >= c}"', "a <= b >= c"),
    ('"{d[1:2]}"', "d[1:2]"), ('"{f(k=1)}"', "f(k=1)"), ('"{(y := 3)}"', "(y := 3)"),
    ('"{\'!:}\' + s}"', "'!:}' + s"), ('"{ {1: 2}[1] }"', "{1: 2}[1]"), ('"{(lambda v: v)(1)}"', "(lambda v: v)(1)"),
])
def test_operators_and_brackets_are_not_a_conversion_or_a_spec(text, source):
    (p,) = parse_query(text).body
    assert fields(p) == [(source, None, None)] and not p.pieces[0].formatted


def test_role_tags_and_escapes_next_to_format_specs():
    (p,) = parse_query('"{:user} {x:>3} {{y:z}} {{:user}}"').body
    assert p.role == "user"
    assert fields(p) == [("x", None, [">3"])] and texts(p)[1:] == [" {y:z} {:user}"]
    (p,) = parse_query('"{x:=^5}"').body  # as in Python: `:` starts the spec, `=^5` (parenthesize a `:=`)
    assert fields(p) == [("x", None, ["=^5"])]


# ----- expressions ----------------------------------------------------------------------------------

EXPRESSIONS = [
    "a + b * c - d / e // f % g ** h", "-a + ~b", "a << 1 | b >> 2 & c ^ d",
    "a < b <= c > d >= e == f != g", "a in b and c not in d", "a is None or b is not None",
    "not a", "a if b else c", "lambda x, y=1, *args, z, **kw: x", "lambda: 0",
    "[1, 2, *xs]", "(1,)", "()", "{}", "{1, 2}", "{'a': 1, **d}", "[x for x in y if x]",
    "{x for x in y}", "{k: v for k, v in y}", "sum(x for x in y)", "f(1, *a, k=2, **kw)",
    "a.b.c[1:2, ::3]", "a[1:]", "x[::-1]", "'a' 'b' r'c'", "0x1F + 0o7 + 0b1 + 1e3 + 1.5 + 2j",
    "...", "f'{x}'", "(a)", "a[b][c](d)",
]


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_python_expressions(text):
    q = parse_query(f"y = {text}\nreturn ({text})")
    assert q.body[0].stmt.source == f"y = {text}"
    assert q.body[1].value.source == f"({text})"


def test_augmented_assignments():
    ops = ["+=", "-=", "*=", "@=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=", "**=", "//="]
    q = parse_query("\n".join(f"x {op} 1" for op in ops))
    assert all(s.stmt.assigned == {"x"} for s in q.body)


def test_from_clause_block_form():
    q = parse_query('argmax\n    "a[X]"\nfrom\n    "openai/gpt2"\nwhere\n    INT(X)')
    assert q.model == "openai/gpt2" and isinstance(q.where, Call)


def test_comments_everywhere():
    q = parse_query('# head\nargmax # dec\n    # inside\n    "a[X]" # after\n\n    # more\nfrom "m" # c\n# x\nwhere INT(X) # end')
    assert q.model == "m" and isinstance(q.where, Call) and len(q.body) == 1


def test_tabs_and_crlf():
    q = parse_query('argmax\r\n\t"a[X]"\r\n\tif X:\r\n\t\t"b"\r\n')
    assert isinstance(q.body[1], If)


def test_keywords_as_names_in_expressions():
    q = parse_query('x = {"where": 1}\n"{x}[A]" where A in [where for where in ["a"]]')
    assert isinstance(q.body[1].where, Choice)


def test_spans():
    q = parse_query('argmax\n    x = 1\n    "ab[X]" where INT(X)\n    return x')
    assert q.body[0].stmt.span == Span(2, 5)
    assert q.body[1].span == Span(3, 5)
    assert q.body[1].pieces[1].span == Span(3, 8)
    assert q.body[1].where.span == Span(3, 19)
    assert q.body[2].span == Span(4, 5)


@pytest.mark.parametrize("text", EXAMPLES)
def test_examples_check(text):
    q = parse_query(text)
    check_query(q, inputs=free_names(q))


def test_transformer_mirrors_statement_rules():
    import re

    from lmq_backend.language.parser import QueryTransformer, grammar_text
    rules = set(re.findall(r"^([a-z]\w*)\s*:", grammar_text(), re.M))
    stmt_rules = {r for r in rules if r.endswith(("_stmt", "_clause", "_block")) or r in {"start", "suite"}}
    assert stmt_rules == set(QueryTransformer.RULES)
    assert all(callable(getattr(QueryTransformer, r, None)) for r in stmt_rules)
