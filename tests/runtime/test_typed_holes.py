"""Typed holes `[X: type]`: the type constrains the text and X is the Python value built from it."""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import re
from typing import Literal, Optional

import pytest

import lmq_backend as lmq
from lmq_backend.language import ast
from lmq_backend.runtime.typed import FLOAT, from_json, hole_type, json_schema


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Shape:
    name: str
    corners: list[Point]
    colour: Colour
    filled: bool = False
    note: Optional[str] = None


import pydantic  # the README's install brings it (the `test` extra): lmq itself needs it only for pydantic holes


class City(pydantic.BaseModel):
    name: str
    country: str


HOLE = ast.Hole("X", ast.Span(1, 1), ast.PyExpr("T", compile("T", "<lmq>", "eval"), frozenset({"T"}), ast.Span(1, 5)))


def test_dataclass_schema_and_value():
    schema = json_schema(Shape)
    assert schema["required"] == ["name", "corners", "colour"] and schema["additionalProperties"] is False
    assert schema["properties"]["corners"] == {"type": "array", "items": json_schema(Point)}
    assert schema["properties"]["colour"] == {"enum": ["red", "blue"]}
    data = {"name": "sq", "corners": [{"x": 0, "y": 1}], "colour": "blue", "note": None}
    assert from_json(Shape, data) == Shape("sq", [Point(0, 1)], Colour.BLUE, False, None)
    assert from_json(int | str, "5") == "5" and from_json(int | str, 5) == 5 and from_json(float, 2) == 2.0


def test_pydantic_model_schema_and_value():
    ht = hole_type(City, HOLE)
    assert ht.constraint.func == "JSON" and json.loads(eval(ht.constraint.args[0].code))["required"] == [
        "name", "country"]
    assert ht.build('{"name": "Bern", "country": "CH"}') == City(name="Bern", country="CH")

    class Trip(pydantic.BaseModel):
        cities: list[City]

    wrapped = json_schema(list[Trip])  # a model inside another type: its definitions at the root
    assert wrapped["items"]["properties"]["cities"]["items"] == {"$ref": "#/$defs/City"}
    assert set(wrapped["$defs"]) == {"City"}
    assert from_json(list[Trip], [{"cities": [{"name": "Bern", "country": "CH"}]}]) == [
        Trip(cities=[City(name="Bern", country="CH")])]


@pytest.mark.parametrize("t,text,value", [
    (int, " 42", 42), (float, "-3.25", -3.25), (float, " 1e-3", 0.001), (bool, " True", True), (bool, "false", False),
    (str, " any text", " any text"), (r"[a-z]+", "abc", "abc"), (Literal["yes", 3], "3", 3),
])
def test_builtin_types(t, text, value):
    ht = hole_type(t, HOLE)
    assert ht.build(text) == value and type(ht.build(text)) is type(value)


def test_float_pattern():
    for ok in ["0", "-1.5", " 3.25e10", "12"]:
        assert re.fullmatch(FLOAT, ok)
    for bad in ["01", "1.", ".5", "--1"]:
        assert not re.fullmatch(FLOAT, bad)


@pytest.mark.parametrize("value", [42, "x".join, object(), [int]])
def test_a_value_that_is_not_a_type_is_refused_with_its_position(value):
    with pytest.raises(lmq.LMQCompileError, match=r"line 1, column 1: the type of hole \[X: T\] .* not a type"):
        hole_type(value, HOLE)


async def test_typed_holes_on_a_model(make_backend):
    """int, float, bool, regex and Literal holes on a random model: each value is of its type and its text
    satisfies the type's constraint; the prompt holds the text."""
    backend = make_backend("llama")
    q = lmq.compile('''
argmax
    "N: [N: int]" where len(TOKENS(N)) < 4
    " F: [F: float]" where len(TOKENS(F)) < 6
    " B: [B: bool]"
    " D: [D: r'[0-9]{2}-[0-9]{2}']"
    " C: [C: Literal['red', 'green']]"
    return N, F, B, D, C
''')
    n, f, b, d, c = await q.run({}, backend)
    assert type(n) is int and type(f) is float and type(b) is bool
    assert re.fullmatch(r"[0-9]{2}-[0-9]{2}", d) and c in ("red", "green")


async def test_typed_holes_under_batching_and_without_the_cache(make_backend):
    q = lmq.compile('"{p} N: [N: int]" where len(TOKENS(N)) < 4\n" B:[B: bool]"\nreturn N, B')
    prompts = [{"p": p} for p in ["a", "bb", "c c", "dd d"]]
    alone = [await q.run(x, make_backend("llama", cache_budget=0)) for x in prompts]
    backend = make_backend("llama")
    assert list(await asyncio.gather(*(q.run(x, backend) for x in prompts))) == alone


async def test_a_value_that_cannot_be_built_names_the_hole_and_the_text(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('"A point: [P: Point]" where len(TOKENS(P)) < 3')
    with pytest.raises(lmq.LMQRuntimeError, match=r"line 1: hole \[P: Point\]: cannot build a Point from the text '"):
        await q.run({}, backend)


def test_an_unknown_type_names_itself_and_its_position():
    with pytest.raises(lmq.LMQUnknownVariableError, match=r"unknown type 'Persn' of hole \[P: Persn\] at line 2, column 9"):
        @lmq.query
        def person():
            '''lmq
            "A: [P: Persn]"
            '''
    q = lmq.compile('"A: [P: Persn]"')  # inputs unknown: the type may be an input, until the call
    with pytest.raises(lmq.LMQUnknownVariableError, match=r"unknown type 'Persn' of hole \[P: Persn\] at line 1"):
        q.run_sync()


def test_a_global_that_is_not_a_type_fails_at_compile_time():
    with pytest.raises(lmq.LMQCompileError, match=r"line 1, column 4: the type of hole \[X: HOLE\]"):
        lmq.compile('"A:[X: HOLE]"')


async def test_a_bad_type_fails_only_its_own_call(make_backend):
    backend = make_backend("llama")
    q = lmq.compile('"A:[X: t]" where len(TOKENS(X)) < 3')
    good, bad = await asyncio.gather(q.run({"t": int}, backend), q.run({"t": 3}, backend), return_exceptions=True)
    assert isinstance(good, lmq.Result) and type(good["X"]) is int
    assert isinstance(bad, lmq.LMQCompileError) and "line 1, column 4" in str(bad)


@pytest.mark.slow
async def test_dataclass_and_pydantic_holes_on_the_default_model(default_backend):
    q = lmq.compile('''
argmax
    "A point with x=1 and y=2 as JSON: [P: Point]\\n"
    "Paris as JSON: [C: City]"
    return P, C
from "default"
''')
    p, c = await q()
    assert isinstance(p, Point) and isinstance(p.x, int) and isinstance(c, City) and isinstance(c.name, str)
