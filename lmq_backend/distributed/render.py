"""What the router matches on: the text a call's prompt starts with, rendered on the client without a model,
and the form of a compiled query that travels to the replicas."""
from __future__ import annotations

import ast as pyast
import copy
from typing import Any

from ..language import ast

MAX_CHARS = 1 << 16  # enough to tell prefixes apart; longer texts are cut (the router needs no more)


def prompt_prefix(query, inputs: dict[str, Any]) -> str:
    """The literal text the query's prompt starts with for `inputs`: its leading prompt strings, their text
    and `{expressions}`, up to the first hole or the first statement that is not a prompt string. An
    expression that fails to evaluate here ends the text (the call itself reports the error), and so does one
    that could change what it reads (`{todo.pop(0)}`: the call runs it on the replica, once; `_side_effect_free`)."""
    env = {k: query.scope[k] for k in query._needs if k in query.scope}
    env.update(inputs)
    parts: list[str] = []
    for stmt in query.ast.body:
        if not isinstance(stmt, ast.Prompt):
            break
        for piece in stmt.pieces:
            if isinstance(piece, ast.Text):
                parts.append(piece.text)
            elif isinstance(piece, ast.Interp):
                if not all(_side_effect_free(p.expr.source) for p in ast.interps([piece])):
                    return "".join(parts)[:MAX_CHARS]
                try:
                    parts.append(_interp_text(piece, env))
                except Exception:  # noqa: BLE001 - routing only: the replica raises the real error
                    return "".join(parts)[:MAX_CHARS]
            else:
                return "".join(parts)[:MAX_CHARS]
    return "".join(parts)[:MAX_CHARS]


_CONVERSIONS = {"r": repr, "s": str, "a": ascii}

# What a routing prefix may evaluate: names, constants, attributes, subscripts, operators, displays, and calls of
# builtins and str methods that change nothing (not a method such as `pop`, a generator's `next`, a comprehension
# that drains an iterator, or the user's own functions).
_PURE_NODES = (pyast.Expression, pyast.Name, pyast.Load, pyast.Constant, pyast.Attribute, pyast.Subscript,
               pyast.Slice, pyast.BinOp, pyast.UnaryOp, pyast.BoolOp, pyast.Compare, pyast.IfExp, pyast.Tuple,
               pyast.List, pyast.Dict, pyast.Set, pyast.JoinedStr, pyast.FormattedValue, pyast.keyword,
               pyast.operator, pyast.unaryop, pyast.boolop, pyast.cmpop, pyast.Call)
_PURE_FUNCTIONS = {"str", "repr", "len", "int", "float", "round", "abs", "min", "max", "sorted", "format", "bool"}
_PURE_METHODS = {"join", "strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "casefold",
                 "format", "replace", "split", "rsplit", "splitlines", "removeprefix", "removesuffix", "get",
                 "center", "ljust", "rjust", "zfill"}
_PURE: dict[str, bool] = {}


def _side_effect_free(source: str) -> bool:
    """Whether evaluating the expression `source` for a routing prefix leaves everything as it found it."""
    if source not in _PURE:
        try:
            tree = pyast.parse(source.strip(), mode="eval")
        except SyntaxError:
            _PURE[source] = False
            return False
        _PURE[source] = all(isinstance(node, _PURE_NODES) and (not isinstance(node, pyast.Call) or (
            isinstance(node.func, pyast.Name) and node.func.id in _PURE_FUNCTIONS) or (
            isinstance(node.func, pyast.Attribute) and node.func.attr in _PURE_METHODS))
            for node in pyast.walk(tree))
    return _PURE[source]


def _interp_text(piece: ast.Interp, env: dict[str, Any], nested: bool = False) -> str:
    """What `{expr}` writes: str(value); with a conversion or a format spec (and in a spec, a nested field),
    what Python's f-string writes."""
    value = eval(piece.expr.code, env)  # noqa: S307 - the user's own query
    if not (piece.formatted or nested):
        return str(value)
    if piece.conversion is not None:
        value = _CONVERSIONS[piece.conversion](value)
    spec = "".join(_interp_text(p, env, True) if isinstance(p, ast.Interp) else p.text for p in piece.spec or ())
    return format(value, spec)


def shippable(query, given: frozenset[str] = frozenset()):
    """A copy of a compiled query that pickles for a replica: only the scope names it reads and its calls
    do not give (not the caller's whole module), no backend object, no wrapped Python function."""
    out = copy.copy(query)
    out.scope = {k: v for k, v in query.scope.items() if k in query._needs - given}
    if not isinstance(query.model, str):
        out.model = "default"  # a replica runs on its own backend whatever the query names
    for attr in ("__wrapped__", "__doc__"):
        out.__dict__.pop(attr, None)
    return out
