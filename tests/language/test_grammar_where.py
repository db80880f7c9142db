"""The where clause: every constraint form, and / or / not and their flattening, continuation lines, the
one-line and block forms, which hole a choice or a contains names (the rest of the grammar: test_grammar.py)."""
from __future__ import annotations

import textwrap

from lmq_backend.language import check_query, parse_query
from lmq_backend.language.ast import And, Choice, Contains, Not, Or, Prompt, Span


def test_constraint_forms():
    q = parse_query(textwrap.dedent('''\
        "[A][B][C][D][E][F]"
        where
            A in ["x", "y"] and
            "z" in B
            "w" not in C or not STOPS_BEFORE(C, ".")
            len(D) <= 3 and 10 > len(TOKENS(E))
            STARTS_WITH(F, "a") and JSON(F, schema) and GRAMMAR(F, g) and STOPS_AT(F, "\\n")
            not "\\n" in A
    '''))
    check_query(q)
    w = q.where
    assert isinstance(w, And)
    kinds = [type(p).__name__ for p in w.parts]
    assert kinds == ["Choice", "Contains", "Or", "LenLimit", "LenLimit", "Call", "Call", "Call", "Call", "Not"]
    orp = w.parts[2]
    assert isinstance(orp.parts[0], Not) and isinstance(orp.parts[0].part, Contains)
    assert isinstance(orp.parts[1], Not) and orp.parts[1].part.func == "STOPS_BEFORE"
    d, e = w.parts[3], w.parts[4]
    assert (d.var, d.unit, d.op) == ("D", "chars", "<=")
    assert (e.var, e.unit, e.op) == ("E", "tokens", "<") and e.limit.source == "10"
    assert w.parts[6].args[0].names == {"schema"}
    assert isinstance(w.parts[9].part, Contains)     # not ("\n" in A)
    assert w.parts[0].span == Span(3, 5)


def test_or_and_nested_flattening():
    q = parse_query('"[A]" where (INT(A) and (STOPS_AT(A, "x") and len(A) < 3)) or A in ["1"] or A in ["2"]')
    w = q.body[0].where
    assert isinstance(w, Or) and len(w.parts) == 3
    assert isinstance(w.parts[0], And) and len(w.parts[0].parts) == 3


def test_inline_where_continuation_lines():
    q = parse_query('"[A]" where INT(A) and\n    len(A) < 3 and\n  A in ["1",\n         "2"]\n"b"')
    w = q.body[0].where
    assert isinstance(w, And) and len(w.parts) == 3
    assert isinstance(q.body[1], Prompt)


def test_where_clause_forms_one_line_and_block():
    one = parse_query('"[A][B]"\nwhere INT(A) and INT(B)')
    block = parse_query('"[A][B]"\nwhere\n    INT(A)\n    INT(B)')
    assert one.where == block.where or [type(p) for p in one.where.parts] == [type(p) for p in block.where.parts]
    assert isinstance(block.where, And) and [p.var for p in block.where.parts] == ["A", "B"]


def test_choice_on_hole_defined_later_and_contains_with_both_names():
    q = parse_query('"[A]" where B in A\n"[B]"')
    w = q.body[0].where
    assert isinstance(w, Choice) and w.var == "B"
    q = parse_query('"[A]" where opts in A')
    assert isinstance(q.body[0].where, Contains) and q.body[0].where.var == "A"
