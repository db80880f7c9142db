"""What the router matches on: the text a call's prompt starts with, rendered on the client without a model,
and the form of a compiled query that travels to the replicas."""
from __future__ import annotations

import copy
from typing import Any

from ..language import ast

MAX_CHARS = 1 << 16  # enough to tell prefixes apart; longer texts are cut (the router needs no more)


def prompt_prefix(query, inputs: dict[str, Any]) -> str:
    """The literal text the query's prompt starts with for `inputs`: its leading prompt strings, their text
    and `{expressions}`, up to the first hole or the first statement that is not a prompt string. An
    expression that fails to evaluate here ends the text (the call itself reports the error)."""
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
                try:
                    parts.append(_interp_text(piece, env))
                except Exception:  # noqa: BLE001 - routing only: the replica raises the real error
                    return "".join(parts)[:MAX_CHARS]
            else:
                return "".join(parts)[:MAX_CHARS]
    return "".join(parts)[:MAX_CHARS]


_CONVERSIONS = {"r": repr, "s": str, "a": ascii}


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
