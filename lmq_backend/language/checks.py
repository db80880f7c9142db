"""Compile-time checks of a parsed query, and walks over the QueryAST.

`check_query` runs after `parse_query` and before any model call. It raises:

- `LMQUnknownVariableError` when a constraint (inline or global where) or the distribution clause names
  a variable that is not a hole of the query, or (when `inputs` is given) when the query reads a free
  name that is not an input, a known global or a builtin;
- `LMQConstraintConflictError` for a literal empty choice (`X in []`, `X in ()`, `X in set()`, ...);
- `LMQNotSupportedError` for an unknown decoder or an unknown decoder argument;
- `LMQCompileError` for a decoding knob's value out of its range (`check_knobs`);
- `LMQUnknownVariableError` when an inline `distribution VAR in [..]` names no hole of its own prompt string.
"""
from __future__ import annotations

import ast
import builtins
from typing import Iterator

from ..errors import (
    LMQCompileError, LMQConstraintConflictError, LMQNotSupportedError, LMQUnknownVariableError,
)
from .ast import (
    And, Call, Choice, Constraint, Contains, Exec, For, Hole, If, Interp, LenLimit, Not, Or, Prompt, PyExpr,
    PyStmt, QueryAST, Return, Stmt, Try, While, With, interps,
)

__all__ = ["check_query", "holes_of", "free_names", "uses_roles", "BUILTIN_NAMES", "DECODER_ARGS", "KNOBS",
           "check_knobs", "walk_stmts", "bodies", "iter_constraints", "iter_code", "bound_names"]

BUILTIN_NAMES: frozenset[str] = frozenset(dir(builtins))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # (not NaN)


# the decoding knobs of argmax and sample (`engine.picks.Knobs` says what each does): name -> (test, range)
KNOBS: dict[str, tuple] = {
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "repetition_penalty": (lambda v: _number(v) and 0 < v < float("inf"), "a number > 0"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
}

# decoder -> allowed keyword arguments
DECODER_ARGS: dict[str, frozenset[str]] = {
    "argmax": frozenset({"max_len", *KNOBS}),
    "sample": frozenset({"n", "temperature", "top_p", "seed", "max_len", *KNOBS}),
    "beam": frozenset({"n", "max_len"}),
    "beam_sample": frozenset({"n", "temperature", "seed", "max_len"}),
    "beam_var": frozenset({"n", "max_len"}),
    "var": frozenset({"b", "n", "max_len"}),
    "best_k": frozenset({"k", "budget", "kappa", "beta", "gamma", "max_heap_size", "top_k_continuations", "max_len"}),
}


def _pos(span) -> str:
    return f"line {span.line}, column {span.column}"


# ----- walks ----------------------------------------------------------------------------------------

def walk_stmts(body: tuple[Stmt, ...]) -> Iterator[Stmt]:
    """Every statement, in source order, recursively through the bodies of compound statements."""
    for s in body:
        yield s
        for b in bodies(s):
            yield from walk_stmts(b)


def bodies(s: Stmt) -> list[tuple[Stmt, ...]]:
    """The bodies a statement holds, in source order."""
    if isinstance(s, If):
        return [b for _, b in s.branches] + [s.orelse]
    if isinstance(s, (For, While)):
        return [s.body, s.orelse]
    if isinstance(s, Try):
        return [s.body, *(h.body for h in s.handlers), s.orelse, s.finalbody]
    if isinstance(s, With):
        return [s.body]
    return []


def _all_holes(q: QueryAST) -> list:
    return [p for s in walk_stmts(q.body) if isinstance(s, Prompt) for p in s.pieces if isinstance(p, Hole)]


def holes_of(q: QueryAST) -> list[str]:
    """Hole names in order of first appearance (recursively through if/for bodies)."""
    seen: dict[str, None] = {}
    for h in _all_holes(q):
        seen.setdefault(h.name, None)
    return list(seen)


def uses_roles(q: QueryAST) -> bool:
    """Whether a prompt string of the query opens a chat message (`{:system}`, `{:user}`, `{:assistant}`)."""
    return any(isinstance(s, Prompt) and s.role is not None for s in walk_stmts(q.body))


def iter_constraints(c: Constraint | None, negated: bool = False) -> Iterator[tuple[Constraint, bool]]:
    """The leaf constraints of `c` with whether they sit under an odd number of `Not`s."""
    if c is None:
        return
    if isinstance(c, (And, Or)):
        for p in c.parts:
            yield from iter_constraints(p, negated)
    elif isinstance(c, Not):
        yield from iter_constraints(c.part, not negated)
    else:
        yield c, negated


def _constraint_exprs(c: Constraint) -> list[PyExpr]:
    if isinstance(c, Choice):
        return [c.options]
    if isinstance(c, Contains):
        return [c.needle]
    if isinstance(c, LenLimit):
        return [c.limit]
    if isinstance(c, Call):
        return list(c.args)
    return []


def _where_of(q: QueryAST) -> Iterator[Constraint]:
    for s in walk_stmts(q.body):
        if isinstance(s, Prompt) and s.where is not None:
            yield s.where
    if q.where is not None:
        yield q.where


def iter_code(q: QueryAST) -> Iterator[PyExpr | PyStmt]:
    """Every PyExpr / PyStmt of the query, in source order (global where and distribution last)."""
    for s in walk_stmts(q.body):
        if isinstance(s, Prompt):
            for p in s.pieces:
                if isinstance(p, Interp):
                    yield from (i.expr for i in interps([p]))
                elif isinstance(p, Hole) and p.type is not None:
                    yield p.type
            for leaf, _ in iter_constraints(s.where):
                yield from _constraint_exprs(leaf)
            if s.distribution is not None:
                yield s.distribution.options
        elif isinstance(s, Exec):
            yield s.stmt
        elif isinstance(s, If):
            for test, _ in s.branches:
                yield test
        elif isinstance(s, For):
            yield s.iter
            yield s.target
        elif isinstance(s, While):
            yield s.test
        elif isinstance(s, Try):
            yield from (h.type for h in s.handlers if h.type is not None)
        elif isinstance(s, With):
            for item in s.items:
                yield item.context
                if item.target is not None:
                    yield item.target
        elif isinstance(s, Return) and s.value is not None:
            yield s.value
    for leaf, _ in iter_constraints(q.where):
        yield from _constraint_exprs(leaf)
    if q.distribution is not None:
        yield q.distribution.options


def bound_names(q: QueryAST) -> set[str]:
    """Names the query binds itself: holes, assignment and `for` targets, `:=` anywhere."""
    bound = set(holes_of(q))
    for code in iter_code(q):
        bound |= _walrus_targets(code)
    for s in walk_stmts(q.body):
        if isinstance(s, Exec):
            bound |= s.stmt.assigned
        elif isinstance(s, For):
            bound |= s.target.assigned
        elif isinstance(s, Try):
            bound |= {h.name for h in s.handlers if h.name is not None}
        elif isinstance(s, With):
            bound |= {n for item in s.items if item.target is not None for n in item.target.assigned}
    return bound


def _walrus_targets(code: PyExpr | PyStmt) -> set[str]:
    """The names `code` binds with `:=` (`"{(n := len(xs))} items, {n}"`)."""
    if ":=" not in code.source:
        return set()
    try:
        tree = ast.parse(code.source.strip(), mode="eval" if isinstance(code, PyExpr) else "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    return {n.target.id for n in ast.walk(tree) if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)}


def free_names(q: QueryAST) -> set[str]:
    """Names the query reads but does not bind itself (not holes, not assigned, not for targets, not
    builtins): the inputs and globals it needs. A builtin's name written alone into a prompt (`{input}`,
    `{id}`, `{type}`: a data set's field, never the function) is an input too."""
    names: set[str] = set()
    for code in iter_code(q):
        names |= code.names
    return names - bound_names(q) - (BUILTIN_NAMES - _interpolated_names(q))


def _interpolated_names(q: QueryAST) -> set[str]:
    """The names written alone in `{...}` of a prompt string."""
    return {p.expr.source.strip() for s in walk_stmts(q.body) if isinstance(s, Prompt) for p in interps(s.pieces)}


# ----- checks ---------------------------------------------------------------------------------------

def _is_empty_literal(expr: PyExpr) -> bool:
    try:
        node = ast.parse(expr.source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    if isinstance(node, ast.Constant):
        return node.value in ("", b"")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in {"set", "list", "tuple", "frozenset", "dict"} and not node.keywords):
        if not node.args:
            return True
        if len(node.args) == 1:
            a = node.args[0]
            return isinstance(a, (ast.List, ast.Tuple, ast.Set)) and not a.elts
    return False


def check_knobs(decoder: str, args: dict, where: str = "") -> None:
    """Raise LMQCompileError naming the first decoding knob of `args` whose value is out of its range
    (`KNOBS`); `where` (e.g. " (line 1, column 1)") follows the decoder's name."""
    for name, value in args.items():
        if name in KNOBS and not KNOBS[name][0](value):
            raise LMQCompileError(f"decoder {decoder}{where}: {name} must be {KNOBS[name][1]}, got {value!r}")


def _check_decoder(q: QueryAST) -> None:
    d = q.decoder
    if d.name not in DECODER_ARGS:
        raise LMQNotSupportedError(
            f"unknown decoder {d.name!r} ({_pos(d.span)}); supported decoders: {', '.join(DECODER_ARGS)}")
    allowed = DECODER_ARGS[d.name]
    for k in d.args:
        if k not in allowed:
            raise LMQNotSupportedError(
                f"unknown argument {k!r} for decoder {d.name} ({_pos(d.span)}); "
                f"allowed: {', '.join(sorted(allowed))}")
    check_knobs(d.name, d.args, f" ({_pos(d.span)})")


def check_query(q: QueryAST, inputs: set[str] | None = None, known_globals: set[str] = frozenset()) -> None:
    """Compile-time checks; see the module docstring. Raises only LMQError subclasses."""
    _check_decoder(q)
    holes = holes_of(q)
    hole_set = set(holes)
    listing = ", ".join(holes) if holes else "none"

    for c in _where_of(q):
        for leaf, negated in iter_constraints(c):
            var = getattr(leaf, "var", None)
            if var is not None and var not in hole_set:
                raise LMQUnknownVariableError(
                    f"constraint at {_pos(leaf.span)}: {var!r} is not a hole of this query (holes: {listing})")
            if isinstance(leaf, Choice) and not negated and _is_empty_literal(leaf.options):
                raise LMQConstraintConflictError(
                    f"constraint at {_pos(leaf.span)}: {leaf.var} in {leaf.options.source} has no options, "
                    f"no value can satisfy it")

    dist = q.distribution
    if dist is not None:
        if dist.var not in hole_set:
            raise LMQUnknownVariableError(
                f"distribution at {_pos(dist.span)}: {dist.var!r} is not a hole of this query (holes: {listing})")
        if _is_empty_literal(dist.options):
            raise LMQConstraintConflictError(
                f"distribution at {_pos(dist.span)}: {dist.var} in {dist.options.source} has no options")
    for s in walk_stmts(q.body):
        dist = s.distribution if isinstance(s, Prompt) else None
        if dist is None:
            continue
        own = [p.name for p in s.pieces if isinstance(p, Hole)]
        if dist.var not in own:
            raise LMQUnknownVariableError(
                f"distribution at {_pos(dist.span)}: {dist.var!r} is not a hole of its prompt string "
                f"(its holes: {', '.join(own) or 'none'})")
        if _is_empty_literal(dist.options):
            raise LMQConstraintConflictError(
                f"distribution at {_pos(dist.span)}: {dist.var} in {dist.options.source} has no options")

    if inputs is not None:
        allowed = set(inputs) | set(known_globals) | BUILTIN_NAMES | bound_names(q)
        types = {id(h.type): h for h in _all_holes(q) if h.type is not None}
        for code in iter_code(q):
            unknown = sorted(code.names - allowed)
            if unknown and id(code) in types:
                h = types[id(code)]
                raise LMQUnknownVariableError(
                    f"unknown type {unknown[0]!r} of hole [{h.name}: {code.source}] at {_pos(code.span)}: it is not "
                    f"an input, a global or a variable of the query")
            if unknown:
                name = unknown[0]
                known = ", ".join(sorted(inputs)) if inputs else "none"
                raise LMQUnknownVariableError(
                    f"unknown variable {name!r} at {_pos(code.span)}: it is not an input, a global, a hole or "
                    f"a variable assigned by the query (inputs: {known})")
