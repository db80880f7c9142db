"""Which conjuncts of a query's `where` concern one hole."""
from __future__ import annotations

from ...errors import LMQNotSupportedError
from ...language import ast


def hole_vars(c: ast.Constraint) -> set[str]:
    """The hole variables a constraint mentions."""
    if isinstance(c, (ast.And, ast.Or)):
        out: set[str] = set()
        for p in c.parts:
            out |= hole_vars(p)
        return out
    if isinstance(c, ast.Not):
        return hole_vars(c.part)
    return {c.var}


def _conjuncts(c: ast.Constraint | None) -> list[ast.Constraint]:
    if c is None:
        return []
    if isinstance(c, ast.And):
        out: list[ast.Constraint] = []
        for p in c.parts:
            out += _conjuncts(p)
        return out
    return [c]


def _span(c: ast.Constraint) -> str:
    while isinstance(c, (ast.And, ast.Or, ast.Not)):
        c = c.parts[0] if isinstance(c, (ast.And, ast.Or)) else c.part
    s = getattr(c, "span", None)
    return f" (line {s.line}, column {s.column})" if s else ""


def constraint_for_hole(where: ast.Constraint | None, hole: str) -> ast.Constraint | None:
    """The top-level conjuncts of `where` that concern only `hole` (None if there are none). A conjunct
    that ties two different holes together raises LMQNotSupportedError."""
    parts = []
    for c in _conjuncts(where):
        names = hole_vars(c)
        if len(names) > 1:
            raise LMQNotSupportedError(
                f"a constraint may concern only one hole, but this one mentions {', '.join(sorted(names))}"
                f"{_span(c)}: split it into one `and`-ed condition per hole")
        if names == {hole}:
            parts.append(c)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ast.And(tuple(parts))
