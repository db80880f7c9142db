"""JSON(X, schema) and GRAMMAR(X, lark_source) on a running model: every value parses as JSON that follows
the schema, or as a sentence of the grammar (checked by lark itself, not by llguidance).

On a tiny random model the values are sampled (many different paths through the grammar); its JSON
schema turns llguidance's flexible whitespace off (`x-guidance`), since a random model would otherwise
pick whitespace forever. The default model writes ordinary JSON under an ordinary schema."""
from __future__ import annotations

import asyncio
import json
import re

import lark
import pytest

import lmq_backend as lmq

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["colour", "n", "ok", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}

GREETING = r'''
start: greeting " " name "!"
greeting: "Hello" | "Hi" | "Good morning"
name: "Alice" | "Bob" | NUMBER
NUMBER: /[1-9][0-9]{0,2}/
'''


def follows_schema(value: str) -> bool:
    v = json.loads(value)
    return (isinstance(v, dict) and set(v) == {"colour", "n", "ok", "tags"} and v["colour"] in ("red", "green", "blue")
            and type(v["n"]) is int and 0 <= v["n"] <= 99 and type(v["ok"]) is bool
            and isinstance(v["tags"], list) and len(v["tags"]) <= 3 and set(v["tags"]) <= {"a", "b"})


async def test_json_values_follow_the_schema(make_backend):
    q = lmq.compile('sample(n=8, temperature=1.0, seed=0)\n'
                    f'    "JSON:[X]" where JSON(X, {json.dumps(SCHEMA)!r}) and len(TOKENS(X)) < 80', model=make_backend())
    values = [r["X"] for r in await q()]
    assert all(follows_schema(v) for v in values), values
    assert len(set(values)) >= 6  # sampled: many different paths through the schema


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
async def test_grammar_values_are_sentences_of_the_grammar(make_backend, kind):
    parser = lark.Lark(GREETING)
    q = lmq.compile('sample(n=8, temperature=1.0, seed=1)\n'
                    f'    "Greeting:[X]" where GRAMMAR(X, {GREETING!r}) and len(TOKENS(X)) < 20\n'
                    '    " Reply:[Y]" where len(TOKENS(Y)) < 3', model=make_backend(kind))
    results = await q()
    for r in results:
        parser.parse(r["X"])  # raises if not a sentence
        assert r.prompt.startswith("Greeting:" + r["X"] + " Reply:")
    assert len({r["X"] for r in results}) >= 4


@pytest.mark.parametrize("model", ["default", "tiny"])
async def test_checked_picks_are_the_picks_under_the_mask(model, request, monkeypatch):
    """A greedy REGEX / JSON / GRAMMAR hole checks the step's unconstrained pick against its constraint before
    it computes a mask (`HoleLoop._checked`): the values equal those of picks under the whole mask (the checks
    off), queries batched; on the default model most picks need no mask, on a random model most do."""
    from lmq_backend.runtime.constraints import llg

    backend = request.getfixturevalue("default_backend" if model == "default" else "make_backend")
    if model == "tiny":
        backend = backend("llama")
    person = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}}}
    source = ('"A sentence about {x}:[A]" where REGEX(A, r"[A-Za-z ,.\'-]{1,80}") and len(TOKENS(A)) < 12\n'
              f'"\\nA person who likes it, as JSON with a name and an age:\\n[J]" where JSON(J, {json.dumps(person)!r})'
              ' and len(TOKENS(J)) < 40\n'
              f'"\\nA greeting:[G]" where GRAMMAR(G, {GREETING!r}) and len(TOKENS(G)) < 8')
    topics = ["a cat", "the sea", "fresh bread", "winter"]
    masks, real = [], llg._mask_of
    monkeypatch.setattr(llg, "_mask_of", lambda m, v: masks.append(1) or real(m, v))

    async def run():  # (a value its token limit cuts short fails its call, the same way both times)
        masks.clear()
        q = lmq.compile(source, model=backend)
        results = await asyncio.gather(*(q(x=x) for x in topics), return_exceptions=True)
        return [str(r) if isinstance(r, lmq.LMQRuntimeError) else r.variables for r in results], len(masks)

    checked, checked_masks = await run()
    monkeypatch.setattr(llg._LLGNode, "checks_tokens", False)
    eager, eager_masks = await run()
    assert checked == eager
    assert eager_masks > 40
    if model == "default":  # a real model's pick mostly keeps to the constraint
        assert checked_masks < eager_masks / 2, (checked_masks, eager_masks)
        assert all(re.fullmatch(r"[A-Za-z ,.'-]{1,80}", v["A"]) and json.loads(v["J"]) for v in checked)


@pytest.mark.slow
async def test_json_on_the_default_model(default_backend):
    person = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 30},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150},
                             "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                           "maxItems": 4}},
              "required": ["name", "age", "languages"], "additionalProperties": False}
    q = lmq.compile('"A software developer described as JSON with a name, an age and the languages they speak:\\n[P]"'
                    f' where JSON(P, {json.dumps(person)!r}) and len(TOKENS(P)) < 80')
    p = json.loads((await q())["P"])
    assert set(p) == {"name", "age", "languages"}
    assert isinstance(p["name"], str) and 0 < len(p["name"]) <= 30
    assert type(p["age"]) is int and 0 <= p["age"] <= 150
    assert isinstance(p["languages"], list) and 0 < len(p["languages"]) <= 4
    assert all(isinstance(x, str) and len(x) <= 20 for x in p["languages"])


@pytest.mark.slow
async def test_grammar_on_the_default_model(default_backend):
    sums = r'''
start: NUMBER " + " NUMBER " = " NUMBER
NUMBER: /[0-9]{1,3}/
'''
    q = lmq.compile('"2 + 2 = 4\\n3 + 5 = 8\\n10 + 7 = 17\\n[S]" where GRAMMAR(S, ' + repr(sums) + ')'
                    ' and len(TOKENS(S)) < 16')
    s = (await q())["S"]
    lark.Lark(sums).parse(s)
    a, b, c = (int(x) for x in s.replace("+", "=").split("="))
    assert 0 <= a <= 999 and 0 <= b <= 999 and 0 <= c <= 999
