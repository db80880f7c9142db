"""Nested queries `[X: q]` / `[X: q(args)]`: q runs on the same sequence; a q that returns a value is hidden
afterwards (the outer prompt goes on with the value), one that does not stays (X is the text it wrote).

Exactness: a nested query's values are those of the same text written flat, and the outer prompt after it
is the flat prompt with the value; with the cache on or off, alone or batched."""
from __future__ import annotations

import asyncio

import pytest

import lmq_backend as lmq


@lmq.query
def think():
    '''lmq
    "Let's think.[R]" where len(TOKENS(R)) < 4
    " So:[A]" where len(TOKENS(A)) < 3
    return A.strip()
    '''


@lmq.query
def one_of(choices):
    '''lmq
    " Pick one of {choices}:[C]" where C in choices
    return C
    '''


@lmq.query
def items(n: int):
    '''lmq
    for i in range(n):
        "\n-[ITEM]" where len(TOKENS(ITEM)) < 3
    '''


@lmq.query
def forever():
    '''lmq
    "again[X: forever]"
    return X
    '''


OUTER = '''
argmax
    "Q: {q}\\nA: [ANS: think]"
    " Then[NEXT]" where len(TOKENS(NEXT)) < 4
'''
FLAT_INNER = '"Q: {q}\\nA: Let\'s think.[R]" where len(TOKENS(R)) < 4\n" So:[A]" where len(TOKENS(A)) < 3'
FLAT_OUTER = '"Q: {q}\\nA: {ans} Then[NEXT]" where len(TOKENS(NEXT)) < 4'


async def flat(backend, q):
    inner = await lmq.compile(FLAT_INNER).run({"q": q}, backend)
    ans = inner["A"].strip()
    return ans, await lmq.compile(FLAT_OUTER).run({"q": q, "ans": ans}, backend)


async def test_a_returning_nested_query_is_hidden_and_exact(make_backend):
    backend = make_backend("llama")
    r = await lmq.compile(OUTER).run({"q": "one plus one?"}, backend)
    ans, outer = await flat(make_backend("llama", cache_budget=0), "one plus one?")
    assert r["ANS"] == ans and r["NEXT"] == outer["NEXT"]
    assert r.prompt == outer.prompt and "Let's think" not in r.prompt
    assert set(r.variables) == {"ANS", "NEXT"}  # the nested query's own holes are its own
    assert backend.stats().pinned_nodes == 0


async def test_nested_queries_batched_and_uncached_are_identical(make_backend):
    questions = ["a?", "bb?", "one plus one?", "the sky?"]
    q = lmq.compile(OUTER)
    alone = [(await q.run({"q": x}, make_backend("llama", cache_budget=0))).prompt for x in questions]
    backend = make_backend("llama")
    assert [r.prompt for r in await asyncio.gather(*(q.run({"q": x}, backend) for x in questions))] == alone
    assert backend.stats().pinned_nodes == 0


async def test_the_nested_prompt_is_cached_like_any_text(make_backend):
    backend = make_backend("llama")
    q = lmq.compile(OUTER)
    await q.run({"q": "one plus one?"}, backend)
    backend.reset_stats()
    await q.run({"q": "one plus one?"}, backend)
    s = backend.stats()
    assert s.tokens_prefilled == s.lookups  # every prefill computes its last token alone: the rest was cached


async def test_arguments_and_a_query_without_return(make_backend):
    backend = make_backend("llama")
    r = await lmq.compile('''
"Colour?[C: one_of(['red', 'blue'])]"
" List:[L: items(2)]"
" End."
''').run({}, backend)
    assert r["C"] in ("red", "blue") and "Pick one" not in r.prompt
    assert r["L"].count("\n-") == 2 and r.prompt.endswith(" List:" + r["L"] + " End.")  # kept: a macro


async def test_a_nested_query_under_a_beam_decoder(make_backend):
    backend = make_backend("llama")
    results = await lmq.compile('beam(n=2)\n    "Q: x\\nA: [ANS: think]"').run({}, backend)
    assert len(results) == 2 and all("Let's think" not in r.prompt for r in results)
    assert backend.stats().pinned_nodes == 0


async def test_endless_recursion_is_a_clear_error_and_fails_only_its_call(make_backend):
    backend = make_backend("llama")
    good = lmq.compile(OUTER)
    results = await asyncio.gather(forever.run({}, backend), good.run({"q": "x"}, backend), return_exceptions=True)
    assert isinstance(results[0], lmq.LMQRuntimeError)
    assert "deeper than 32 levels" in str(results[0]) and "[X: forever]" in str(results[0])
    assert isinstance(results[1], lmq.Result)
    assert backend.stats().pinned_nodes == 0


@lmq.query
def failing(key):
    '''lmq
    "X:[V]" where len(TOKENS(V)) < 2
    y = {}[key]
    return V
    '''


async def test_bad_arguments_of_a_nested_query(make_backend):
    with pytest.raises(lmq.LMQInputError, match=r"^line 1: hole \[C: one_of\(\)\]: .*one_of"):
        await lmq.compile('"x[C: one_of()]"').run({}, make_backend("llama"))


async def test_an_error_inside_a_nested_query_names_the_hole_that_called_it(make_backend):
    """A nested query's own lines are numbered in its own source: its error says which outer hole ran it, then
    the line of its own that failed."""
    backend = make_backend("llama")
    with pytest.raises(lmq.LMQRuntimeError, match=r"^line 2: hole \[C: failing\('k'\)\]: line 3: `y = \{\}\[key\]` "
                                                   r"raised KeyError"):
        await lmq.compile('"start"\n"[C: failing(\'k\')]"').run({}, backend)
    assert backend.stats().pinned_nodes == 0


async def test_a_constraint_on_a_nested_querys_hole_is_a_clear_error(make_backend):
    """The value of `[X: q]` is what q returns, decided by q's own holes: a constraint on X (which nothing would
    hold it to) fails the call, before q runs."""
    backend = make_backend("llama")
    q = lmq.compile('"Q: x\\nA: [ANS: think]" where len(ANS) < 3 and ANS in [" a", " b"]')
    with pytest.raises(lmq.LMQRuntimeError, match=r"line 1: hole \[ANS: think\]: a nested query's hole takes no "
                                                   r"constraint"):
        await q.run({"think": think}, backend)
    assert backend.stats().pinned_nodes == 0
