"""Python's control flow inside a query (`while`, `def`, `await`, `import`, `try/except/finally`, `with`, besides
if/for/break/continue/return): the body runs as a compiled coroutine function with Python's semantics; a
Python exception fails its own call with the query's line and never another call of the batch; beam decoders
replay the program."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest

import lmq_backend as lmq

LOG: list[str] = []


async def lookup(term: str) -> str:
    """An async tool, as a query awaits one (LMQL's `await wikipedia(TERM)`)."""
    await asyncio.sleep(0)
    return f"<{term.strip()}>"


@contextlib.contextmanager
def logged(name):
    LOG.append(f"enter {name}")
    try:
        yield name.upper()
    finally:
        LOG.append(f"exit {name}")


@contextlib.asynccontextmanager
async def alogged(name):
    LOG.append(f"aenter {name}")
    yield name
    LOG.append(f"aexit {name}")


async def countdown(n):
    for i in range(n, 0, -1):
        yield i


AGENT = '''
argmax
    import json as j
    def fmt(k, v):
        return f"{k}={v}"
    steps = 0
    "Task: {task}\\n"
    while steps < 3:
        "Thought:[THOUGHT]" where STOPS_AT(THOUGHT, "\\n") and len(TOKENS(THOUGHT)) < 4
        result = await lookup(THOUGHT)
        "Observation: {result}\\n"
        steps += 1
        if steps == 2:
            break
    else:
        "never"
    try:
        "Answer:[N: int]" where len(TOKENS(N)) < 3
        ratio = 10 / (N - N)
    except ZeroDivisionError as e:
        " ({type(e).__name__})"
    finally:
        " done"
    with logged("ctx") as name:
        " in {name}"
    async with alogged("actx") as aname:
        " in {aname}"
    async for i in countdown(2):
        " {i}"
    return j.dumps({"steps": steps, "n": N}), fmt("t", THOUGHT)
'''

FLAT = '''
argmax
    "Task: {task}\\nThought:[T1]" where STOPS_AT(T1, "\\n") and len(TOKENS(T1)) < 4
    "Observation: <{T1.strip()}>\\nThought:[T2]" where STOPS_AT(T2, "\\n") and len(TOKENS(T2)) < 4
    "Observation: <{T2.strip()}>\\nAnswer:[N]" where INT(N) and len(TOKENS(N)) < 3
    " (ZeroDivisionError) done in CTX in actx 2 1"
'''


async def test_control_flow_runs_as_python_and_matches_the_flat_query(make_backend):
    LOG.clear()
    backend = make_backend("llama")
    r = await lmq.compile(AGENT).run({"task": "find x"}, backend)
    flat = await lmq.compile(FLAT).run({"task": "find x"}, make_backend("llama", cache_budget=0))
    assert json.loads(r[0]) == {"steps": 2, "n": int(flat["N"])}
    assert r[1] == f"t={flat['T2']}"
    assert LOG == ["enter ctx", "exit ctx", "aenter actx", "aexit actx"]
    full = await lmq.compile(AGENT.replace("    return j.dumps", "    x = j.dumps")).run({"task": "find x"}, backend)
    assert full.prompt == flat.prompt and full.variables == {"THOUGHT": flat["T2"], "N": int(flat["N"])}


async def test_batched_calls_with_control_flow_equal_each_alone(make_backend):
    q = lmq.compile(AGENT)
    tasks = [{"task": t} for t in ["a", "find x", "sort the list", "b c"]]
    alone = [await q.run(t, make_backend("llama", cache_budget=0)) for t in tasks]
    backend = make_backend("llama")
    assert list(await asyncio.gather(*(q.run(t, backend) for t in tasks))) == alone
    assert backend.stats().pinned_nodes == 0


async def test_an_exception_fails_its_own_call_at_its_line(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('''
"Value:[X]" where len(TOKENS(X)) < 3
if fail:
    items = {}
    y = items["missing"]
"!"
''')
    results = await asyncio.gather(q.run({"fail": True}, backend), q.run({"fail": False}, backend),
                                   return_exceptions=True)
    assert isinstance(results[0], lmq.LMQRuntimeError)
    assert str(results[0]) == "line 5: `y = items[\"missing\"]` raised KeyError: 'missing'"
    assert isinstance(results[1], lmq.Result) and results[1].prompt.endswith("!")
    assert backend.stats().pinned_nodes == 0


async def test_await_on_something_that_is_not_awaitable(make_backend):
    q = lmq.compile('"a"\nx = await len("abc")')
    with pytest.raises(lmq.LMQRuntimeError, match=r"line 2: `x = await len\(\"abc\"\)`: `await` on a value that is "
                                                  r"not awaitable"):
        await q.run({}, make_backend("llama"))


async def test_a_query_catches_a_failed_hole(make_backend):
    """An LMQError of a hole is an exception like any other: the query's own try may catch it."""
    backend = make_backend("llama")
    r = await lmq.compile('''
try:
    "A point:[P: Point]" where len(TOKENS(P)) < 2
except lmq.LMQRuntimeError:
    P = None
" fallback"
return P
''').run({}, backend)
    assert r is None


@dataclasses.dataclass
class Point:
    x: int


def lambda_value(v):
    return v * 2


async def test_functions_defined_in_the_query_see_its_variables(make_backend):
    q = lmq.compile('''
def total():
    return sum(values) + offset
offset = 1
values = [1, 2]
"Sum:{total()}[X]" where len(TOKENS(X)) < 2
class Box:
    size = offset * 10
return total(), Box.size, lambda_value(3)
''')
    assert await q.run({}, make_backend("llama")) == (4, 10, 6)


async def test_generators_defined_in_the_query(make_backend):
    q = lmq.compile('''
def evens(n):
    for i in range(n):
        if i % 2 == 0:
            yield i
    yield from [10]
async def ticks():
    yield "a"
    yield "b"
async def collect():
    out = []
    async for t in ticks():
        out.append(t)
    return out
"Evens:{list(evens(5))}[X]" where len(TOKENS(X)) < 2
return list(evens(3)), await collect()
''')
    assert await q.run({}, make_backend("llama")) == ([0, 2, 10], ["a", "b"])
    with pytest.raises(lmq.LMQSyntaxError, match="'yield' outside function"):
        lmq.compile('"A"\nyield 1')


async def test_async_comprehensions_and_await_in_comprehensions(make_backend):
    """`[x async for x in agen]` and `await` in a comprehension, as in Python's coroutine functions: in an
    assignment, a prompt's `{...}`, a loop's iterable, a return and an async def of the query."""
    q = lmq.compile('''
seen = [i async for i in countdown(3) if i != 2]
"Ticks: {[await lookup(str(i)) async for i in countdown(2)]}\\n"
for t in [await lookup(w) for w in words]:
    "{t}:[X]" where len(TOKENS(X)) < 2
async def pairs():
    return {i: [j async for j in countdown(i)] async for i in countdown(2)}
doubled = (i * 2 async for i in countdown(2))
return seen, await pairs(), sorted({await lookup(w) for w in words}), [v async for v in doubled]
''')
    backend = make_backend("llama")
    assert await q.run({"words": ["b", "a"]}, backend) == ([3, 1], {2: [2, 1], 1: [1]}, ["<a>", "<b>"], [4, 2])
    r = await lmq.compile('"Ticks: {[await lookup(str(i)) async for i in countdown(2)]}"').run({}, backend)
    assert r.prompt == "Ticks: ['<2>', '<1>']"


async def test_beam_decoders_replay_loops_and_try(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('''
beam(n=2)
    i = 0
    while i < 2:
        try:
            "Step {i}:[S]" where len(TOKENS(S)) < 3
        finally:
            i += 1
''')
    results = await q.run({}, backend)
    assert len(results) == 2 and all(r.prompt.startswith("Step 0:") and "Step 1:" in r.prompt for r in results)
    assert results[0].score >= results[1].score
    assert backend.stats().pinned_nodes == 0


@pytest.mark.parametrize("source,message,line", [
    ('"a"\nbreak', "'break' outside loop", 2),
    ('"a"\nwhile True:\n    def f():\n        continue', "'continue' not properly in loop", 4),
    ('"a"\nnonlocal x', "nonlocal declaration not allowed at module level", 2),
])
def test_python_refuses_it_at_compile_time(source, message, line):
    with pytest.raises(lmq.LMQSyntaxError, match=message) as e:
        lmq.compile(source)
    assert e.value.line == line
