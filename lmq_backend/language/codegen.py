"""Compiles a query body into a Python coroutine function: `compile_program(query, name) -> Program`.

The body becomes

    async def __lmq_query__(__lmq__):
        global <every name the body binds>
        <the body's statements>

where Python statements stay as they are (their positions are the query's: tracebacks and errors name the
query's lines) and a prompt statement becomes calls on `__lmq__`, the runtime's run of the call
(`runtime/interpreter.py`):

    "{:user} Q: {q} [A]" where ...     __lmq__.prompt(k)             # statement k of `Program.prompts`: its role
                                       __lmq__.write("Q: ")          # template text
                                       __lmq__.interp(q)             # an interpolated value: its str()
                                                                     # (`{q:>8}`: f"{q:>8}", Python's own)
                                       A = await __lmq__.hole(k, 2)  # piece 2 of statement k: a hole

So `while`, `try`, `with`, `def`, `import`, `await` and the rest are Python's own, with Python's semantics,
and prompt statements may stand anywhere in the body's blocks (a `def`'s body is plain Python). Every name the
body binds is a global of the function: its globals are the call's `env` (the defining scope, the inputs, the
holes' values), which the runtime reads to evaluate constraints and to report variables, and a function
defined in the query sees the query's variables as a module's function sees the module's.
"""
from __future__ import annotations

import ast as pyast
from dataclasses import dataclass, field
from types import CodeType

from ..errors import LMQSyntaxError
from .ast import (
    Break, Continue, Exec, For, Hole, If, Interp, Prompt, PyExpr, PyStmt, QueryAST, Return, Span, Stmt, Text,
    Try, While, With,
)

RUN = "__lmq__"
FUNCTION = "__lmq_query__"


@dataclass(frozen=True, slots=True)
class Program:
    """A compiled query body: `code` is the code object of `async def __lmq_query__(__lmq__)`; the calls
    it makes name prompt statements by their index in `prompts`. `memo`: what the runtime derives once from
    the program for all its calls (each hole's constraint)."""

    query: QueryAST
    code: CodeType
    prompts: tuple[Prompt, ...]
    filename: str
    memo: dict = field(default_factory=dict, compare=False, repr=False)


def compile_program(query: QueryAST, name: str = "query") -> Program:
    """Compile the query's body. Raises LMQSyntaxError where Python refuses it (`break` outside a loop, ...)."""
    gen = _Generator()
    body = gen.block(query.body)
    filename = f"<lmq {name}>"
    # the names the body binds: the function's locals (those a function defined in it reads too: cells)
    # once compiled without the global declaration
    first = _function_code(_module(body, []), filename, query.source)
    local = (set(first.co_varnames) | set(first.co_cellvars)) - {RUN}
    body = [stmt for stmt in body if not isinstance(stmt, pyast.Global)]  # every name is global already
    code = _function_code(_module(body, sorted(local)), filename, query.source)
    return Program(query, code, tuple(gen.prompts), filename)


def _module(body: list[pyast.stmt], names: list[str]) -> pyast.Module:
    head = [pyast.Global(names, lineno=1, col_offset=0, end_lineno=1, end_col_offset=0)] if names else []
    args = pyast.arguments([], [pyast.arg(RUN)], None, [], [], None, [])
    fn = pyast.AsyncFunctionDef(FUNCTION, args, head + (body or [pyast.Pass()]), [], None, lineno=1, col_offset=0,
                                end_lineno=1, end_col_offset=0)
    module = pyast.Module([fn], [])
    pyast.fix_missing_locations(module)
    return module


def _function_code(module: pyast.Module, filename: str, source: str) -> CodeType:
    try:
        code = compile(module, filename, "exec")
    except SyntaxError as e:
        raise LMQSyntaxError(e.msg, source, e.lineno or 0, e.offset or 0) from None
    return next(c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == FUNCTION)


class _Generator:
    """QueryAST statements -> Python statements (a list per block); collects the prompt statements."""

    def __init__(self) -> None:
        self.prompts: list[Prompt] = []

    def block(self, stmts: tuple[Stmt, ...]) -> list[pyast.stmt]:
        out: list[pyast.stmt] = []
        for s in stmts:
            out.extend(self.stmt(s))
        return out

    def body(self, stmts: tuple[Stmt, ...], span: Span) -> list[pyast.stmt]:
        return self.block(stmts) or [_at(pyast.Pass(), span)]

    def stmt(self, s: Stmt) -> list[pyast.stmt]:
        if isinstance(s, Prompt):
            return self.prompt(s)
        if isinstance(s, Exec):
            return _statements(s.stmt)
        if isinstance(s, If):
            orelse = self.block(s.orelse)
            for test, body in reversed(s.branches):
                node = _at(pyast.If(_expression(test), self.body(body, test.span), orelse), test.span)
                orelse = [node]
            return orelse
        if isinstance(s, For):
            kind = pyast.AsyncFor if s.is_async else pyast.For
            return [_at(kind(_target(s.target), _expression(s.iter), self.body(s.body, s.span), self.block(s.orelse)),
                        s.span)]
        if isinstance(s, While):
            return [_at(pyast.While(_expression(s.test), self.body(s.body, s.span), self.block(s.orelse)), s.span)]
        if isinstance(s, Try):
            handlers = [_at(pyast.ExceptHandler(_expression(h.type) if h.type is not None else None, h.name,
                                                self.body(h.body, h.span)), h.span) for h in s.handlers]
            return [_at(pyast.Try(self.body(s.body, s.span), handlers, self.block(s.orelse), self.block(s.finalbody)),
                        s.span)]
        if isinstance(s, With):
            kind = pyast.AsyncWith if s.is_async else pyast.With
            items = [pyast.withitem(_expression(i.context), _target(i.target) if i.target is not None else None)
                     for i in s.items]
            return [_at(kind(items, self.body(s.body, s.span)), s.span)]
        if isinstance(s, Return):
            return [_at(pyast.Return(_expression(s.value) if s.value is not None else None), s.span)]
        if isinstance(s, Break):
            return [_at(pyast.Break(), s.span)]
        if isinstance(s, Continue):
            return [_at(pyast.Continue(), s.span)]
        raise AssertionError(f"unknown statement {s!r}")  # pragma: no cover - the parser makes no other

    def prompt(self, s: Prompt) -> list[pyast.stmt]:
        k = len(self.prompts)
        self.prompts.append(s)
        out = [_call_stmt("prompt", [_const(k)], s.span)]
        for i, piece in enumerate(s.pieces):
            if isinstance(piece, Text):
                out.append(_call_stmt("write", [_const(piece.text)], s.span))
            elif isinstance(piece, Interp):
                out.append(_call_stmt("interp", [_interpolation(piece)], piece.expr.span))
            elif isinstance(piece, Hole):
                value = pyast.Await(_call("hole", [_const(k), _const(i)]))
                out.append(_at(pyast.Assign([pyast.Name(piece.name, pyast.Store())], value), piece.span))
        return out


# ----- Python nodes from the query's text ----------------------------------------------------------------------

def _parse(source: str, mode: str) -> tuple[pyast.AST, int]:
    """The tree of `source`, and the lines it was shifted by (an expression over several lines is parsed in
    parentheses, as the parser compiled it: python_code.py)."""
    try:
        return pyast.parse(source, "<lmq>", mode), 0
    except SyntaxError:
        if mode != "eval":
            raise
        return pyast.parse("(\n" + source + "\n)", "<lmq>", mode), -1


def _placed(tree: pyast.AST, span: Span, shift: int) -> pyast.AST:
    pyast.increment_lineno(tree, span.line - 1 + shift)
    return tree


def _expression(expr: PyExpr) -> pyast.expr:
    tree, shift = _parse(expr.source, "eval")
    return _placed(tree, expr.span, shift).body


def _interpolation(piece: Interp) -> pyast.expr:
    """The value `{expr}` inserts (its str() is taken at run time); a field with a conversion or a format spec is
    Python's own f-string of it: `{x!r:>{w}}` -> f"{x!r:>{w}}"."""
    if not piece.formatted:
        return _expression(piece.expr)
    return pyast.JoinedStr([_formatted_value(piece)])


def _formatted_value(piece: Interp) -> pyast.FormattedValue:
    spec = None
    if piece.spec is not None:
        spec = pyast.JoinedStr([_formatted_value(p) if isinstance(p, Interp) else _const(p.text) for p in piece.spec])
    conversion = ord(piece.conversion) if piece.conversion is not None else -1
    return pyast.FormattedValue(_expression(piece.expr), conversion, spec)


def _statements(stmt: PyStmt) -> list[pyast.stmt]:
    tree, shift = _parse(stmt.source, "exec")
    return _placed(tree, stmt.span, shift).body


def _target(stmt: PyStmt) -> pyast.expr:
    """The target of a `TARGET = __lmq_item__` statement (a for's, a with's)."""
    (assign,) = _statements(stmt)
    return assign.targets[0]


def _at(node: pyast.AST, span: Span) -> pyast.AST:
    node.lineno = node.end_lineno = span.line
    node.col_offset = node.end_col_offset = max(span.column - 1, 0)
    return node


def _const(value) -> pyast.Constant:
    return pyast.Constant(value)


def _call(method: str, args: list[pyast.expr]) -> pyast.Call:
    return pyast.Call(pyast.Attribute(pyast.Name(RUN, pyast.Load()), method, pyast.Load()), args, [])


def _call_stmt(method: str, args: list[pyast.expr], span: Span) -> pyast.stmt:
    return _at(pyast.Expr(_call(method, args)), span)
