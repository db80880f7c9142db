"""The grammar's Python statements beyond if/for: while, try, with, def, class, decorators, import, raise, assert,
del, global, `await`, `;`; inline distributions; typed holes and role tags in prompt strings; the code
generator's Python (language/codegen.py)."""
from __future__ import annotations

import pytest

from lmq_backend.errors import LMQSyntaxError, LMQUnknownVariableError
from lmq_backend.language import check_query, free_names, holes_of, parse_query
from lmq_backend.language.ast import For, Handler, Hole, Prompt, Try, While, With
from lmq_backend.language.checks import bound_names, walk_stmts
from lmq_backend.language.codegen import compile_program

QUERY = '''
argmax
    import json
    from os import path as p
    @decorate(1)
    def helper(a, b=default, *args, k: int = 2, **kw):
        """A docstring is no prompt: [X] {y}"""
        z = a + b + glob
        return z + X
    class C(Base):
        v = 1
    i = 0; j = 1
    while i < 3:
        "[X]" where len(TOKENS(X)) < 2
        i += 1
    else:
        pass
    try:
        r = await fetch(i)
    except (ValueError, KeyError) as e:
        "[Y]"
    except Exception:
        raise
    else:
        "ok"
    finally:
        done = True
    with open_it() as (f, g), other():
        x = f
    async with actx() as h:
        pass
    async for q in aiter_():
        break
    for a in range(2):
        continue
    else:
        "{a}"
    "A:[CLS]" distribution CLS in ["a", "b"]
    assert x, "msg"
    del x
    global gv
    raise ValueError("x") from None
'''


def test_python_statements_parse_into_the_ast():
    q = parse_query(QUERY)
    kinds = [type(s).__name__ for s in q.body]
    assert kinds == ["Exec"] * 6 + ["While", "Try", "With", "With", "For", "For", "Prompt"] + ["Exec"] * 4
    helper = q.body[2].stmt
    assert helper.source.startswith("@decorate(1)\ndef helper(") and helper.assigned == {"helper"}
    assert helper.names == {"decorate", "default", "int", "glob", "X"}
    assert q.body[0].stmt.assigned == {"json"} and q.body[1].stmt.assigned == {"p"}
    w, t, wi, aw, af = q.body[6:11]
    assert isinstance(w, While) and w.test.source == "i < 3" and len(w.body) == 2 and w.orelse == ()
    assert isinstance(t, Try) and [h.name for h in t.handlers] == ["e", None] and len(t.finalbody) == 1
    assert isinstance(t.handlers[0], Handler) and t.handlers[0].type.source == "(ValueError, KeyError)"
    assert isinstance(wi, With) and [i.context.source for i in wi.items] == ["open_it()", "other()"]
    assert wi.items[0].target.assigned == {"f", "g"} and not wi.is_async and aw.is_async
    assert isinstance(af, For) and af.is_async and isinstance(q.body[11].orelse[0], Prompt)
    dist = q.body[12]
    assert isinstance(dist, Prompt) and dist.distribution.var == "CLS"
    assert holes_of(q) == ["X", "Y", "CLS"]  # not the docstring's [X]
    assert free_names(q) == {"decorate", "default", "glob", "Base", "fetch", "open_it", "other", "actx", "aiter_"}
    assert {"i", "j", "e", "f", "g", "h", "q", "a", "x", "r", "done", "helper", "C", "json", "p"} <= bound_names(q)
    check_query(q, inputs=free_names(q))


def test_the_generated_function_declares_every_bound_name_global():
    program = compile_program(parse_query(QUERY), "q")
    names = set(program.code.co_names)
    assert {"i", "j", "X", "Y", "CLS", "e", "helper", "json", "done"} <= names
    # no local, no cell: the body's names live in the call's env (helper reads X from there)
    assert program.code.co_varnames == ("__lmq__",) and program.code.co_cellvars == ()
    assert [p.span.line for p in program.prompts] == [14, 21, 25, 37, 38]


def test_async_comprehensions_parse_where_python_takes_them():
    q = parse_query('''
xs = [t async for t in ticks() if t]
pairs = {k: await f(v) async for k, v in items() for w in v}
"{[await f(t) async for t in ticks()]}"
async def tail():
    return (t async for t in g() async for u in h(t))
for y in {t async for t in ticks()}:
    "{y}"
''')
    xs, pairs, shown, tail, loop = q.body
    assert xs.stmt.source == "xs = [t async for t in ticks() if t]" and xs.stmt.names == {"ticks"}
    assert pairs.stmt.names == {"f", "items"} and shown.pieces[0].expr.names == {"f", "ticks"}
    assert tail.stmt.assigned == {"tail"} and loop.iter.source == "{t async for t in ticks()}"
    assert free_names(q) == {"ticks", "f", "items", "g", "h"}
    compile_program(q, "q")  # the query body is a coroutine function: Python takes them there
    with pytest.raises(LMQSyntaxError, match="asynchronous comprehension outside of an asynchronous function") as e:
        compile_program(parse_query('"a"\ndef tail():\n    return [t async for t in g()]'), "q")
    assert (e.value.line, e.value.column) == (3, 12)


def test_walk_visits_every_block():
    q = parse_query(QUERY)
    prompts = [s for s in walk_stmts(q.body) if isinstance(s, Prompt)]
    assert len(prompts) == 5


@pytest.mark.parametrize("source,message", [
    ('yield 1', "'yield' outside function"),
    ('"a"\nwhile x:\n"b"', "expected an indented block"),
    ('try:\n    pass\n', "unexpected"),
    ('"a" distribution X', "must have the form `VAR in <options>`"),
])
def test_syntax_errors(source, message):
    with pytest.raises(Exception, match=message):
        parse_query(source)


def test_an_inline_distribution_names_a_hole_of_its_string():
    with pytest.raises(LMQUnknownVariableError, match="not a hole of its prompt string"):
        check_query(parse_query('"a[X]"\n"b[Y]" distribution X in ["a"]'))


def test_typed_holes_and_roles_in_prompt_strings():
    q = parse_query('''"{:user}  Q: [A: int] [B: one_of(['a]', 'b'])] [C: r'[0-9]+']"''')
    (p,) = q.body
    assert p.role == "user" and q.chat and p.pieces[0].text == "Q: "
    holes = [x for x in p.pieces if isinstance(x, Hole)]
    assert [h.type.source for h in holes] == ["int", "one_of(['a]', 'b'])", "r'[0-9]+'"]
    assert free_names(q) == {"one_of"}
    with pytest.raises(LMQSyntaxError, match="needs a type"):
        parse_query('"[A: ]"')
