"""Static checks before any model call (`check_constraint`), and the argument checks that the compiler
repeats at run time on values that were not literals."""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from ...errors import (
    LMQCompileError, LMQConstraintConflictError, LMQError, LMQNotSupportedError, LMQUnknownConstraintError,
)
from ...language import ast
from .llg import _llg_validate
from .selection import _conjuncts, _span, hole_vars

NOT_LITERAL = object()
"""What an `evaluate_literal` function returns for an expression that is not a constant literal."""

KNOWN_FUNCS = {"STOPS_AT": 1, "STOPS_BEFORE": 1, "INT": 0, "REGEX": 1, "STARTS_WITH": 1, "JSON": 1, "GRAMMAR": 1}
STOP_FUNCS = {"STOPS_AT", "STOPS_BEFORE"}
LLG_FUNCS = {"REGEX", "JSON", "GRAMMAR"}


def _lit(evaluate_literal: Callable[[ast.PyExpr], Any], expr: ast.PyExpr) -> Any:
    try:
        return evaluate_literal(expr)
    except LMQError:
        raise
    except Exception:
        return NOT_LITERAL


def _max_len(op: str, n: int) -> int:
    return n - 1 if op == "<" else n


def _check_limit_value(n: Any, c: ast.LenLimit, err: type[LMQError]) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise err(f"the limit of len({'TOKENS(' + c.var + ')' if c.unit == 'tokens' else c.var}) must be an int, "
                  f"not {type(n).__name__} {n!r}{_span(c)}")
    return n


def _check_string_arg(func: str, s: Any, c: ast.Call, err: type[LMQError], allow_empty: bool = False) -> str:
    if not isinstance(s, str):
        raise err(f"{func}({c.var}, ...) needs a string, not {type(s).__name__} {s!r}{_span(c)}")
    if not s and not allow_empty:
        raise err(f"{func}({c.var}, ...) needs a non-empty string{_span(c)}")
    return s


def _check_options_value(opts: Any, c: ast.Choice, err: type[LMQError]) -> list[str]:
    if isinstance(opts, (str, bytes)):
        raise err(f"`{c.var} in ...` needs a list (or other iterable) of strings, not the string {opts!r}"
                  f"{_span(c)}")
    try:
        items = list(opts)
    except TypeError:
        raise err(f"`{c.var} in ...` needs a list (or other iterable) of strings, not {type(opts).__name__}"
                  f"{_span(c)}") from None
    for o in items:
        if not isinstance(o, str):
            raise err(f"the options of `{c.var} in ...` must be strings, not {type(o).__name__} {o!r}{_span(c)}")
    if not items:
        raise LMQConstraintConflictError(f"`{c.var} in ...` has no options: no value can satisfy it{_span(c)}")
    return list(dict.fromkeys(items))


def _unsupported_nested(c: ast.Constraint, where: str) -> None:
    """Stop rules, token limits and llguidance constraints cannot sit under `or` / `not`."""
    if isinstance(c, (ast.And, ast.Or)):
        for p in c.parts:
            _unsupported_nested(p, where)
    elif isinstance(c, ast.Not):
        _unsupported_nested(c.part, where)
    elif isinstance(c, ast.Call) and (c.func in STOP_FUNCS or c.func in LLG_FUNCS):
        raise LMQNotSupportedError(f"{c.func}({c.var}, ...) cannot be used under `{where}`{_span(c)}; "
                                   f"use it as a top-level `and`-ed condition")
    elif isinstance(c, ast.LenLimit) and c.unit == "tokens":
        raise LMQNotSupportedError(f"len(TOKENS({c.var})) limits cannot be used under `{where}`{_span(c)}; "
                                   f"use it as a top-level `and`-ed condition")


_INT_RE = re.compile(r" ?-?[0-9]+")
_INT_PREFIX_RE = re.compile(r" ?-?[0-9]*")


def _static_test(c: ast.Constraint, lit) -> Callable[[str], bool] | None:
    """A Python predicate on a complete value for a statically known constraint, else None."""
    if isinstance(c, ast.Call):
        if c.func == "INT":
            return lambda v: _INT_RE.fullmatch(v) is not None
        if c.func == "STARTS_WITH" and c.args:
            s = lit(c.args[0])
            if isinstance(s, str):
                return lambda v: v.startswith(s)
        if c.func == "REGEX" and c.args:
            r = lit(c.args[0])
            if isinstance(r, str):
                try:
                    rx = re.compile(r)
                except re.error:
                    return None
                return lambda v: rx.fullmatch(v) is not None
        return None
    if isinstance(c, ast.LenLimit) and c.unit == "chars":
        n = lit(c.limit)
        if isinstance(n, int) and not isinstance(n, bool):
            m = _max_len(c.op, n)
            return lambda v: len(v) <= m
        return None
    if isinstance(c, ast.Contains):
        s = lit(c.needle)
        if isinstance(s, str):
            return lambda v: s in v
        return None
    if isinstance(c, ast.Choice):
        opts = lit(c.options)
        if opts is not NOT_LITERAL and not isinstance(opts, (str, bytes)):
            try:
                allowed = set(opts)
            except TypeError:
                return None
            return lambda v: v in allowed
        return None
    if isinstance(c, ast.Not):
        inner = _static_test(c.part, lit)
        return None if inner is None else (lambda v: not inner(v))
    if isinstance(c, ast.Or):
        tests = [_static_test(p, lit) for p in c.parts]
        if any(t is None for t in tests):
            return None
        return lambda v: any(t(v) for t in tests)  # type: ignore[misc]
    if isinstance(c, ast.And):
        tests = [_static_test(p, lit) for p in c.parts]
        tests = [t for t in tests if t is not None]
        return lambda v: all(t(v) for t in tests)
    return None


def _mentions(c: ast.Constraint, funcs) -> bool:
    if isinstance(c, (ast.And, ast.Or)):
        return any(_mentions(p, funcs) for p in c.parts)
    if isinstance(c, ast.Not):
        return _mentions(c.part, funcs)
    return isinstance(c, ast.Call) and c.func in funcs


def _check_node(c: ast.Constraint, lit) -> None:
    if isinstance(c, ast.And):
        for p in c.parts:
            _check_node(p, lit)
        return
    if isinstance(c, ast.Or):
        for p in c.parts:
            _unsupported_nested(p, "or")
            _check_node(p, lit)
        return
    if isinstance(c, ast.Not):
        _unsupported_nested(c.part, "not")
        _check_node(c.part, lit)
        return
    if isinstance(c, ast.Call):
        if c.func not in KNOWN_FUNCS:
            raise LMQUnknownConstraintError(
                f"unknown constraint function {c.func}{_span(c)}; known: {', '.join(sorted(KNOWN_FUNCS))}")
        want = KNOWN_FUNCS[c.func]
        if len(c.args) != want:
            raise LMQCompileError(f"{c.func}({c.var}{', ...' if want else ''}) takes {want} argument"
                                  f"{'s' if want != 1 else ''} after the variable, not {len(c.args)}{_span(c)}")
        if not want:
            return
        v = lit(c.args[0])
        if v is NOT_LITERAL:
            return
        if c.func in STOP_FUNCS:
            _check_string_arg(c.func, v, c, LMQCompileError)
        elif c.func == "STARTS_WITH":
            _check_string_arg(c.func, v, c, LMQCompileError, allow_empty=True)
        elif c.func == "REGEX":
            _check_string_arg(c.func, v, c, LMQCompileError, allow_empty=True)
            try:
                re.compile(v)
            except re.error as e:
                raise LMQCompileError(f"REGEX({c.var}, {v!r}): the regular expression does not compile: {e}"
                                      f"{_span(c)}") from None
            _llg_validate("REGEX", v, c)
        elif c.func == "JSON":
            _llg_validate("JSON", _json_schema_text(v, c, LMQCompileError), c)
        elif c.func == "GRAMMAR":
            _check_string_arg(c.func, v, c, LMQCompileError)
            _llg_validate("GRAMMAR", v, c)
        return
    if isinstance(c, ast.Choice):
        v = lit(c.options)
        if v is not NOT_LITERAL:
            _check_options_value(v, c, LMQCompileError)
        return
    if isinstance(c, ast.Contains):
        v = lit(c.needle)
        if v is not NOT_LITERAL and not isinstance(v, str):
            raise LMQCompileError(f"`... in {c.var}` needs a string on the left, not {type(v).__name__} {v!r}"
                                  f"{_span(c)}")
        return
    if isinstance(c, ast.LenLimit):
        v = lit(c.limit)
        if v is not NOT_LITERAL:
            _check_limit_value(v, c, LMQCompileError)
        return
    raise LMQCompileError(f"unknown constraint {c!r}")


def _json_schema_text(v: Any, c: ast.Call, err: type[LMQError]) -> str:
    if isinstance(v, dict):
        try:
            return json.dumps(v)
        except (TypeError, ValueError) as e:
            raise err(f"JSON({c.var}, ...): the schema is not JSON-serialisable: {e}{_span(c)}") from None
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError as e:
            raise err(f"JSON({c.var}, ...): the schema string is not valid JSON: {e}{_span(c)}") from None
        if not isinstance(parsed, (dict, bool)):
            raise err(f"JSON({c.var}, ...): the schema must be a JSON object{_span(c)}")
        return v
    raise err(f"JSON({c.var}, ...) needs a schema (a dict or a JSON string), not {type(v).__name__}{_span(c)}")


def check_constraint(c: ast.Constraint, evaluate_literal: Callable[[ast.PyExpr], Any]) -> None:
    """Static checks before any model call: argument types of literal arguments (LMQCompileError), forms
    not supported under `or`/`not` (LMQNotSupportedError) and holes no value can satisfy
    (LMQConstraintConflictError)."""
    lit = lambda e: _lit(evaluate_literal, e)  # noqa: E731
    _check_node(c, lit)
    by_hole: dict[str, list[ast.Constraint]] = {}
    for part in _conjuncts(c):
        names = hole_vars(part)
        if len(names) == 1:
            by_hole.setdefault(next(iter(names)), []).append(part)
    for var, parts in by_hole.items():
        _check_conflicts(var, parts, lit)


def _check_conflicts(var: str, parts: list[ast.Constraint], lit) -> None:
    # length limits below zero
    for p in parts:
        if isinstance(p, ast.LenLimit):
            n = lit(p.limit)
            if isinstance(n, int) and not isinstance(n, bool) and _max_len(p.op, n) < 0:
                unit = f"len(TOKENS({var}))" if p.unit == "tokens" else f"len({var})"
                raise LMQConstraintConflictError(f"`{unit} {p.op} {n}` cannot hold for any value{_span(p)}")
        if isinstance(p, ast.Not) and isinstance(p.part, ast.Contains):
            s = lit(p.part.needle)
            if s == "":
                raise LMQConstraintConflictError(f'`not "" in {var}` cannot hold for any value{_span(p)}')
    # a prefix the other conditions rule out
    for p in parts:
        if isinstance(p, ast.Call) and p.func == "STARTS_WITH" and p.args:
            s = lit(p.args[0])
            if not isinstance(s, str):
                continue
            for q in parts:
                if q is p:
                    continue
                bad = False
                if isinstance(q, ast.Call) and q.func == "INT":
                    bad = _INT_PREFIX_RE.fullmatch(s) is None
                elif isinstance(q, ast.LenLimit) and q.unit == "chars":
                    n = lit(q.limit)
                    bad = isinstance(n, int) and not isinstance(n, bool) and len(s) > _max_len(q.op, n)
                elif isinstance(q, ast.Not) and isinstance(q.part, ast.Contains):
                    needle = lit(q.part.needle)
                    bad = isinstance(needle, str) and needle in s
                if bad:
                    raise LMQConstraintConflictError(
                        f"STARTS_WITH({var}, {s!r}) conflicts with another condition on {var}{_span(p)}")
    # choices none of whose options pass the other static conditions
    for p in parts:
        if not isinstance(p, ast.Choice):
            continue
        opts = lit(p.options)
        if opts is NOT_LITERAL:
            continue
        options = _check_options_value(opts, p, LMQCompileError)
        tests = [t for q in parts if q is not p for t in [_static_test(q, lit)] if t is not None]
        if tests and not any(all(t(o) for t in tests) for o in options):
            raise LMQConstraintConflictError(
                f"none of the options of `{var} in ...` satisfies the other conditions on {var}{_span(p)}")
