"""Streaming: `async for event in query.stream(**inputs)` and `lmq run --stream`. A hole's events add up to its
value, token by token, whole characters only; the last event holds the result, the same as an unstreamed call;
closing or cancelling the stream cancels the call and releases its pins."""
from __future__ import annotations

import asyncio
import contextlib

import lmq_backend as lmq
from lmq_backend.cli import main


async def collect(query, backend, **inputs):
    query.model = backend
    return [e async for e in query.stream(**inputs)]


def by_variable(events):
    out = {}
    for e in events:
        if e.variable is not None:
            out.setdefault(e.variable, []).append(e.text)
    return out


async def test_events_add_up_to_each_value_and_end_with_the_result(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('''
"Q: {q}\\nA:[A]" where len(TOKENS(A)) < 8
"\\nMore:[B]" where STOPS_BEFORE(B, "e") and len(TOKENS(B)) < 8
"\\nUnicode:[U]" where REGEX(U, "[éàü日本語]{3,6}")
''')
    events = await collect(q, backend, q="hi?")
    final = events[-1]
    assert final.done and [e for e in events if e.done] == [final]
    r = final.result
    assert r == await q.run({"q": "hi?"}, backend)  # as an unstreamed call
    deltas = by_variable(events)
    for name in "ABU":
        assert "".join(deltas[name]) == r[name], name
        assert all(d and "\ufffd" not in d for d in deltas[name])
    assert len(deltas["A"]) > 1  # token by token
    assert "e" not in r["B"]
    text = "".join(e.text for e in events if e.variable is None)
    assert text == "Q: hi?\nA:\nMore:\nUnicode:"


async def test_roles_distributions_and_nested_values_are_streamed(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('''
"{:user} Pick"
"{:assistant} [C]" distribution C in [" a", " b"]
"{:user} Again"
"{:assistant} [D: pick]"
''')
    events = await collect(q, backend)
    roles = [e.role for e in events if e.role is not None and not e.text]
    assert roles == ["user", "assistant", "user", "assistant"]
    r = events[-1].result
    assert by_variable(events) == {"C": [r["C"]], "D": [r["D"]], "P": [r["D"]]}


@lmq.query
def pick():
    '''lmq
    "Say:[P]" where len(TOKENS(P)) < 2
    return P
    '''


async def test_closing_the_stream_cancels_the_call(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('"Long:[A]" where len(TOKENS(A)) < 200')
    q.model = backend
    seen = 0
    async with contextlib.aclosing(q.stream()) as stream:
        async for event in stream:
            seen += event.variable == "A"
            if seen == 2:
                break
    assert backend.stats().pinned_nodes == 0
    assert isinstance(await q.run({}, backend), lmq.Result)  # the backend serves the next call


async def test_cancelling_the_consumer_cancels_the_call(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('"Long:[A]" where len(TOKENS(A)) < 200')
    q.model = backend
    first = asyncio.Event()

    async def consume():
        async for event in q.stream():
            if event.variable == "A":
                first.set()

    task = asyncio.ensure_future(consume())
    await first.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert backend.stats().pinned_nodes == 0


async def test_a_failing_call_raises_from_the_stream(make_backend):
    q = lmq.compile('"A:[A]" where len(TOKENS(A)) < 3\nx = 1 / 0')
    q.model = make_backend("llama")
    events = []
    try:
        async for event in q.stream():
            events.append(event)
    except lmq.LMQRuntimeError as e:
        assert "line 2" in str(e)
    else:
        raise AssertionError("no error")
    assert by_variable(events)["A"]


def test_lmq_run_stream_prints_as_it_goes(capsys, tmp_path, make_backend):
    lmq.register_backend("tiny-stream", make_backend("llama"))
    path = tmp_path / "chat.lmq"
    path.write_text('argmax\n    "{:user} {q}"\n    "{:assistant} [A]" where len(TOKENS(A)) < 5\n')
    assert main(["run", str(path), "--model", "tiny-stream", "--var", "q=Hello", "--stream"]) == 0
    out = capsys.readouterr().out
    shown, _, variables = out.partition("\n---\n")
    answer = eval(variables.strip().removeprefix("A = "))  # noqa: S307 - the printed repr
    assert shown == f"\nuser: Hello\nassistant: {answer}"
