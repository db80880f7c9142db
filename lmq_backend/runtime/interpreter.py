"""Runs one call of a compiled query: walks the statements, sends prompt text to the backend, fills
holes under their constraints, scores a `distribution`.

Python inside a query runs in one dict, `env`: the caller's globals, the inputs, the variables the
query assigns and the holes it has filled.

Prompt text (template chunks and interpolated values, which are always literal text) collects until the
next hole, and goes to the backend as one segment: so a chunk is tokenized as a whole, as the model saw
such text in training, and the same way on every call whatever the cache holds. Segment boundaries fall
only where a generated value begins or ends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..backend.protocol import Backend
from ..errors import LMQError, LMQRuntimeError
from ..language import ast
from .constraints import HoleConstraint, compile_hole_constraint, constraint_for_hole
from .decoders import Sampler


@dataclass
class Result:
    """One result of a query call: the filled prompt, the variables, the distribution if any; for a beam
    decoder, `score`: the sum of the log-probabilities of the tokens the decoder chose (runtime/beam.py)."""

    prompt: str
    variables: dict[str, Any]
    distribution: dict[str, float] | None = None
    value: Any = None  # what the query's `return` returned, if it returned
    score: float | None = None

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


@dataclass
class Run:
    """The state of one query call on one backend sequence."""

    query: ast.QueryAST
    backend: Backend
    env: dict[str, Any]
    sampler: Sampler
    template: str
    max_len: int
    variables: dict[str, Any] = field(default_factory=dict)
    distribution: dict[str, float] | None = None
    pending: list[str] = field(default_factory=list)  # prompt text not yet sent to the backend

    async def execute(self) -> Result:
        seq = self.backend.sequence(self.template, self.max_len)
        self.seq = seq
        value = None
        try:
            try:
                await self._block(self.query.body)
            except _Return as r:
                value = r.value
            except (_Break, _Continue):
                raise LMQRuntimeError("`break`/`continue` outside a loop") from None
            await self._flush()
        finally:
            self.backend.release(seq)
        return Result(prompt=seq.text, variables=dict(self.variables), distribution=self.distribution, value=value)

    # ----- statements ---------------------------------------------------------------------------------

    async def _block(self, stmts: tuple[ast.Stmt, ...]) -> None:
        for stmt in stmts:
            await self._stmt(stmt)

    async def _stmt(self, stmt: ast.Stmt) -> None:
        if isinstance(stmt, ast.Prompt):
            await self._prompt(stmt)
        elif isinstance(stmt, ast.Exec):
            self._exec(stmt.stmt)
        elif isinstance(stmt, ast.If):
            for test, body in stmt.branches:
                if self._eval(test):
                    await self._block(body)
                    return
            await self._block(stmt.orelse)
        elif isinstance(stmt, ast.For):
            for item in self._eval(stmt.iter):
                self.env["__lmq_item__"] = item
                self._exec(stmt.target)
                try:
                    await self._block(stmt.body)
                except _Break:
                    break
                except _Continue:
                    continue
        elif isinstance(stmt, ast.Return):
            raise _Return(None if stmt.value is None else self._eval(stmt.value))
        elif isinstance(stmt, ast.Break):
            raise _Break()
        elif isinstance(stmt, ast.Continue):
            raise _Continue()
        else:  # pragma: no cover - the parser produces nothing else
            raise LMQRuntimeError(f"unknown statement {stmt!r}")

    async def _prompt(self, stmt: ast.Prompt) -> None:
        where = _conjoin(stmt.where, self.query.where)
        for piece in stmt.pieces:
            if isinstance(piece, ast.Text):
                self.pending.append(piece.text)
            elif isinstance(piece, ast.Interp):
                self.pending.append(str(self._eval(piece.expr)))
            else:
                await self._flush()
                if self.query.distribution is not None and piece.name == self.query.distribution.var:
                    await self._distribution(self.query.distribution)
                else:
                    await self._hole(piece, where)

    async def _flush(self) -> None:
        if self.pending:
            text, self.pending = "".join(self.pending), []
            await self.backend.extend(self.seq, text)

    async def _hole(self, hole: ast.Hole, where: ast.Constraint | None) -> None:
        constraint = compile_hole_constraint(constraint_for_hole(where, hole.name), self._eval, self.backend.vocab)
        self._assign(hole.name, await self._fill(hole, constraint))

    async def _fill(self, hole: ast.Hole, constraint: HoleConstraint) -> str:
        """The hole's value, appended to the sequence (a beam decoder's run fills it its own way)."""
        return await self.backend.generate(self.seq, constraint.start(), self.sampler)

    async def _distribution(self, dist: ast.Distribution) -> None:
        options = self._eval(dist.options)
        options = [options] if isinstance(options, str) else list(options)
        if not options or not all(isinstance(o, str) for o in options):
            raise LMQRuntimeError(f"distribution {dist.var} needs a non-empty list of strings, got {options!r}")
        logps = await self.backend.score(self.seq, options)
        top = max(logps)
        weights = [math.exp(lp - top) for lp in logps]
        total = sum(weights)
        self.distribution = {o: w / total for o, w in zip(options, weights)}
        best = max(self.distribution, key=self.distribution.get)
        await self.backend.extend(self.seq, best)
        self._assign(dist.var, best)

    def _assign(self, name: str, value: str) -> None:
        self.env[name] = value
        self.variables[name] = value

    # ----- Python -------------------------------------------------------------------------------------

    def _eval(self, expr: ast.PyExpr) -> Any:
        try:
            return eval(expr.code, self.env)  # noqa: S307 - query code is the user's own program
        except LMQError:
            raise
        except Exception as e:  # noqa: BLE001 - report the user's expression and where it is
            raise LMQRuntimeError(
                f"line {expr.span.line}: `{expr.source}` raised {type(e).__name__}: {e}") from e

    def _exec(self, stmt: ast.PyStmt) -> None:
        try:
            exec(stmt.code, self.env)  # noqa: S102
        except LMQError:
            raise
        except Exception as e:  # noqa: BLE001
            raise LMQRuntimeError(
                f"line {stmt.span.line}: `{stmt.source}` raised {type(e).__name__}: {e}") from e
        for name in stmt.assigned & self.variables.keys():
            self.variables[name] = self.env[name]


def _conjoin(a: ast.Constraint | None, b: ast.Constraint | None) -> ast.Constraint | None:
    if a is None or b is None:
        return a if b is None else b
    return ast.And((a, b))
