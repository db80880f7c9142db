"""Typed holes: `[X: int]`, `[X: float]`, `[X: bool]`, `[X: str]`, `[X: r"regex"]`, `[X: Literal[...]]`, and
`[X: SomeClass]` with SomeClass a dataclass or a pydantic model (or a list, tuple, dict, Optional, Union or
Enum of such types): the constraint a type puts on the hole's text, and the Python value built from the text.

| type              | constraint on the text                          | value                        |
|-------------------|-------------------------------------------------|------------------------------|
| int               | INT: an optional space, then `-?[0-9]+`          | int(text)                    |
| float             | REGEX ` ?-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?` | float(text)     |
| bool              | one of True / False / true / false (a space before allowed) | text.strip().lower() == "true" |
| str               | none                                            | the text                     |
| a regex string    | REGEX(X, pattern)                               | the text                     |
| Literal[a, b]     | X in [str(a), str(b)]                           | the option (a or b)          |
| anything else     | JSON(X, its JSON schema) through llguidance     | built from the parsed JSON   |

A dataclass's schema is built here (its fields' types, those without a default required, no other keys); a
pydantic model's is its own (`model_json_schema`), and its value `model_validate` (pydantic is needed only
for pydantic models).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from ..errors import LMQCompileError, LMQRuntimeError
from ..language import ast

FLOAT = r" ?-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?"
BOOLS = ("True", "False", "true", "false", " True", " False", " true", " false")


@dataclass(frozen=True, slots=True)
class HoleType:
    """What a type asks of a hole: `constraint` on its text (None: free text), and `build(text) -> value`."""

    name: str
    constraint: ast.Constraint | None
    build: Callable[[str], Any]


def hole_type(t: Any, hole: ast.Hole) -> HoleType:
    """The HoleType of `t`, the value of the hole's type expression. Raises LMQCompileError for a value that
    is not a type lmq can constrain a hole to."""
    try:
        ht = _hole_type(t, hole.name, hole.span)
    except TypeError as e:  # unhashable: never a type
        if "unhashable" not in str(e):
            raise
        ht = None
    except LMQCompileError as e:
        raise LMQCompileError(f"line {hole.span.line}, column {hole.span.column}: hole "
                              f"[{hole.name}: {hole.type.source}]: {e}") from None
    if ht is None:
        raise not_a_type(t, hole)
    return ht


def not_a_type(t: Any, hole: ast.Hole) -> LMQCompileError:
    return LMQCompileError(
        f"line {hole.span.line}, column {hole.span.column}: the type of hole [{hole.name}: {hole.type.source}] is "
        f"{type(t).__name__} {t!r:.60}, not a type: use int, float, bool, str, a regex string, Literal[...], a "
        f"dataclass, a pydantic model or an @lmq.query function")


def build_value(ht: HoleType, text: str, hole: ast.Hole) -> Any:
    """The hole's value from its text; raises LMQRuntimeError naming the hole and the text."""
    try:
        return ht.build(text)
    except Exception as e:  # noqa: BLE001 - any failure to build is the value's
        raise LMQRuntimeError(
            f"line {hole.span.line}: hole [{hole.name}: {hole.type.source}]: cannot build a {ht.name} from the text "
            f"{text!r}: {type(e).__name__}: {e}") from e


@lru_cache(maxsize=256)
def _hole_type(t: Any, var: str, span: ast.Span) -> HoleType | None:
    if t is int:
        return HoleType("int", ast.Call("INT", var, (), span), int)
    if t is float:
        return HoleType("float", ast.Call("REGEX", var, (_const(FLOAT, span),), span), float)
    if t is bool:
        return HoleType("bool", ast.Choice(var, _const(list(BOOLS), span), span), lambda s: s.strip().lower() == "true")
    if t is str:
        return HoleType("str", None, str)
    if isinstance(t, str):
        return HoleType(f"text matching {t!r}", ast.Call("REGEX", var, (_const(t, span),), span), str)
    if typing.get_origin(t) is typing.Literal:
        by_text = {str(o): o for o in typing.get_args(t)}
        return HoleType(str(t), ast.Choice(var, _const(list(by_text), span), span), by_text.__getitem__)
    if not _is_type(t):
        return None
    schema = json_schema(t)
    name = getattr(t, "__name__", str(t))
    return HoleType(name, ast.Call("JSON", var, (_const(json.dumps(schema), span),), span),
                    lambda text: from_json(t, json.loads(text)))


def _const(value: Any, span: ast.Span) -> ast.PyExpr:
    source = repr(value)
    return ast.PyExpr(source, compile(source, "<lmq>", "eval"), frozenset(), span)


def _is_type(t: Any) -> bool:
    return isinstance(t, type) or typing.get_origin(t) is not None


# ----- JSON schemas and values ------------------------------------------------------------------------------

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _is_pydantic(t: Any) -> bool:
    return isinstance(t, type) and hasattr(t, "model_json_schema") and hasattr(t, "model_validate")


def json_schema(t: Any) -> dict:
    """The JSON schema of a type (see the module docstring), with the definitions of pydantic models at its root."""
    defs: dict[str, Any] = {}
    schema = _schema(t, defs)
    return {**schema, "$defs": defs} if defs else schema


def _schema(t: Any, defs: dict) -> dict:
    if t is Any:
        return {}
    if t in _SCALARS:
        return {"type": _SCALARS[t]}
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(a, defs) for a in args]}
    if origin in (list, set, frozenset) or t in (list, set, frozenset):
        return {"type": "array", "items": _schema(args[0], defs) if args else {}}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema(args[0], defs)}
        return {"type": "array", "prefixItems": [_schema(a, defs) for a in args], "minItems": len(args),
                "maxItems": len(args)}
    if origin is dict or t is dict:
        return {"type": "object", "additionalProperties": _schema(args[1], defs) if args else {}}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return {"enum": [m.value for m in t]}
    if _is_pydantic(t):
        schema = t.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        return schema
    if dataclasses.is_dataclass(t) and isinstance(t, type):
        hints = typing.get_type_hints(t)
        fields = [f for f in dataclasses.fields(t) if f.init]
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        return {"type": "object", "properties": {f.name: _schema(hints[f.name], defs) for f in fields},
                "required": required, "additionalProperties": False}
    raise LMQCompileError(f"lmq cannot give the type {t!r} a JSON schema (a hole's type may be int, float, bool, "
                          f"str, a Literal, an Enum, a dataclass, a pydantic model, or a list / tuple / dict / "
                          f"Optional of them)")


def from_json(t: Any, data: Any) -> Any:
    """The value of type `t` from parsed JSON that its schema allows."""
    if t is Any or t in (str, int, bool, type(None)):
        return data
    if t is float:
        return float(data)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return data
    if origin in (typing.Union, types.UnionType):
        errors = []
        for a in args:
            try:
                value = from_json(a, data)
            except Exception as e:  # noqa: BLE001 - the next member of the union may fit
                errors.append(e)
                continue
            if a in _SCALARS and not _scalar_fits(a, data):
                continue
            return value
        raise ValueError(f"{data!r} fits no member of {t}")
    if origin in (list, set, frozenset) or t in (list, set, frozenset):
        kind = origin or t
        return kind(from_json(args[0], x) if args else x for x in data)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], x) for x in data)
        return tuple(from_json(a, x) for a, x in zip(args, data))
    if origin is dict or t is dict:
        return {k: from_json(args[1], v) if args else v for k, v in data.items()}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return t(data)
    if _is_pydantic(t):
        return t.model_validate(data)
    if dataclasses.is_dataclass(t) and isinstance(t, type):
        hints = typing.get_type_hints(t)
        return t(**{f.name: from_json(hints[f.name], data[f.name])
                    for f in dataclasses.fields(t) if f.init and f.name in data})
    raise TypeError(f"cannot build a {t!r}")


def _scalar_fits(t: type, data: Any) -> bool:
    if t is float:
        return isinstance(data, (int, float)) and not isinstance(data, bool)
    if t is int:
        return isinstance(data, int) and not isinstance(data, bool)
    return isinstance(data, t)
