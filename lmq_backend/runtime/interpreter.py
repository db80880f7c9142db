"""Runs one call of a compiled query: the query's body compiled to a Python coroutine function
(`language/codegen.py`) runs with the call's `Run` as its `__lmq__`; the Run sends prompt text to the
backend, fills holes under their constraints (typed holes, nested queries), scores distributions.

The body's names are globals of one dict, `env`: the defining scope, the inputs, the variables the query
assigns and the holes it has filled; constraints' arguments are evaluated in it. What the query writes goes
to the backend through its transcript (`transcript.py`): as written, or for a query with role tags, as the
model's chat template renders the conversation. A Python exception in the query's code fails the call with
an LMQRuntimeError naming the query's line.
"""
from __future__ import annotations

import ast as pyast
import math
import os
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

from ..backend.protocol import Backend, Sequence
from ..errors import LMQBackendError, LMQCompileError, LMQError, LMQRuntimeError, LMQUnsatisfiedError
from ..language import ast
from ..language.codegen import FUNCTION, Program
from .constraints import HoleConstraint, compile_hole_constraint, constraint_for_hole
from .decoders import Sampler
from .stream import Emit, HoleStream, StreamEvent
from .transcript import ChatTranscript, Transcript
from .typed import build_value, hole_type


@dataclass
class Result:
    """One result of a query call: the filled prompt, the variables, the distribution if any; for a beam
    decoder, `score`: the sum of the log-probabilities of the tokens the decoder chose (runtime/beam.py);
    for a chat, `rerenders`: how often the model's template rendered an earlier message differently once a
    later one existed, so that the prompt was sent again whole (transcript.py). `distribution`: the last
    distribution the query scored; `distributions`: each one, by variable."""

    prompt: str
    variables: dict[str, Any]
    distribution: dict[str, float] | None = None
    value: Any = None  # what the query's `return` returned, if it returned
    score: float | None = None
    rerenders: int = 0
    distributions: dict[str, dict[str, float]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]


MAX_NESTING = 32
"""How deep nested queries may go (a query that nests itself without end fails at this depth)."""


@dataclass
class Run:
    """The state of one query call on one backend sequence. A nested query's run (`_nest`) works on a fork of
    its parent's sequence and a copy of its transcript; `root` is the outermost run, which fills every hole
    (a beam decoder's run fills them its own way: beam.py)."""

    program: Program
    backend: Backend
    env: dict[str, Any]
    sampler: Sampler
    template: str
    max_len: int
    variables: dict[str, Any] = field(default_factory=dict)
    distribution: dict[str, float] | None = None
    distributions: dict[str, dict[str, float]] = field(default_factory=dict)
    depth: int = 0
    root: "Run | None" = None
    written: list[str] | None = None  # a nested run's: the text it writes (X of a nested query without return)
    stream: Emit | None = None  # where a streamed call's events go (stream.py)
    index: int = 0  # which of a call's results this run is (sample(n > 1))
    role: str | None = None  # the chat message open now

    async def execute(self) -> Result:
        self.transcript = self._transcript()
        self.seq = self.backend.sequence(self.template, self.max_len)
        try:
            value = await self._body()
            await self._flush(final=True)
        finally:
            self.backend.release(self.seq)
        return Result(prompt=self.seq.text, variables=dict(self.variables), distribution=self.distribution,
                      value=value, rerenders=getattr(self.transcript, "rerenders", 0),
                      distributions=dict(self.distributions))

    @property
    def query(self) -> ast.QueryAST:
        return self.program.query

    async def _body(self) -> Any:
        """Run the query's body (its compiled function, with this run as `__lmq__`); the value it returned."""
        body = FunctionType(self.program.code, self.env, FUNCTION)
        try:
            value = await body(self)
        except LMQError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: fails this call, at its line
            if _from_lmq(e, self.program):
                raise  # the engine's own failure (a step, a kernel): the call gets it as it is
            raise _located(e, self.program) from e
        for name in self.variables:  # a hole's variable the query assigned again
            if name in self.env:
                self.variables[name] = self.env[name]
        return value

    def _transcript(self) -> Transcript:
        if not self.query.chat:
            return Transcript()
        render = self.backend.chat_template()
        if render is None:
            raise LMQCompileError(f"model {self.backend.name!r} has no chat template (its tokenizer's "
                                  f"chat_template is not set): role tags such as {{:user}} need one")
        return ChatTranscript(render)

    # ----- what the compiled body calls (language/codegen.py) -----------------------------------------

    def prompt(self, k: int) -> None:
        """Prompt statement k begins: it may open a chat message."""
        stmt = self.program.prompts[k]
        if stmt.role is not None:
            self.transcript.open(stmt.role)
            self.role = stmt.role
            if self.stream is not None:
                self.stream(StreamEvent(None, "", stmt.role, self.index))
        elif stmt.pieces and not self.transcript.has_message:
            raise LMQRuntimeError(f"line {stmt.span.line}: prompt text before any role tag: in a query with role "
                                  f"tags, every prompt string belongs to a message ({{:system}}, {{:user}}, "
                                  f"{{:assistant}})")

    def write(self, text: str) -> None:
        """Template text."""
        self._write(text)

    def interp(self, value: Any) -> None:
        """An interpolated value: its str(), as literal text."""
        self._write(str(value), literal=True)

    async def hole(self, k: int, i: int) -> Any:
        """The value of piece i of prompt statement k, a hole: generated, scored (a distribution), or a nested
        query's."""
        stmt = self.program.prompts[k]
        piece = stmt.pieces[i]
        for dist in (stmt.distribution, self.query.distribution):
            if dist is not None and dist.var == piece.name:
                await self._flush()
                return await self._distribution(dist)
        return await self._hole(piece, self._constraint(k, i))

    def _constraint(self, k: int, i: int) -> ast.Constraint | None:
        """The constraint of piece i of prompt statement k, a hole: the conjuncts of its `where` and the query's
        that concern it (`constraint_for_hole`), found once a program."""
        memo = self.program.memo
        key = ("constraint", k, i)
        if key not in memo:
            stmt = self.program.prompts[k]
            memo[key] = constraint_for_hole(_conjoin(stmt.where, self.query.where), stmt.pieces[i].name)
        return memo[key]

    def _write(self, text: str, variable: str | None = None, literal: bool = False) -> None:
        """Prompt text (`variable`: the nested query whose value it is; `literal`: an interpolated value)."""
        self.transcript.write(text, literal)
        if self.written is not None:
            self.written.append(text)
        if self.stream is not None and text:
            self.stream(StreamEvent(variable, text, None if variable else self.role, self.index))

    def _generated(self, text: str, variable: str | None = None) -> None:
        """A value the backend appended to the sequence (`variable`: a distribution's, streamed at once)."""
        self.transcript.generated(text)
        if self.written is not None:
            self.written.append(text)
        if self.stream is not None and variable is not None:
            self.stream(StreamEvent(variable, text, index=self.index))

    async def _flush(self, final: bool = False) -> None:
        self.seq = await self.transcript.flush(self.backend, self.seq, final)

    async def _hole(self, hole: ast.Hole, c: ast.Constraint | None) -> Any:
        """The value of `hole` under its constraint `c` (`_constraint`), and its type's."""
        typed = None
        if hole.type is not None:
            t, call = self._hole_type_value(hole)
            if is_query(t):
                if c is not None:
                    raise LMQRuntimeError(
                        f"line {hole.span.line}: hole [{hole.name}: {hole.type.source}]: a nested query's hole takes "
                        f"no constraint (its value is what the query returns): constrain the holes inside the query")
                return self._assign(hole.name, await self._nest(hole, t, *(call or ((), {}))))
            if call is not None:
                t = t(*call[0], **call[1])
            typed = hole_type(t, hole)
            if typed.constraint is not None:
                c = typed.constraint if c is None else ast.And((typed.constraint, c))
        constraint = compile_hole_constraint(c, self._eval, self.backend.vocab)
        await self._flush()
        try:
            text = await (self.root or self)._fill(self.seq, hole, constraint)
        except LMQUnsatisfiedError as e:
            if typed is not None:  # (the type's own error, naming it, where its value cannot be built either)
                build_value(typed, e.text, hole)
            raise LMQUnsatisfiedError(f"line {hole.span.line}: hole [{hole.name}]: {e}", e.text) from None
        self._generated(text)
        return self._assign(hole.name, text if typed is None else build_value(typed, text, hole))

    async def _fill(self, seq: Sequence, hole: ast.Hole, constraint: HoleConstraint) -> str:
        """The hole's value, appended to `seq` (a beam decoder's run fills it its own way)."""
        state = constraint.start()
        if self.stream is None:
            return await self.backend.generate(seq, state, self.sampler)
        seq.on_token = stream = HoleStream(self.stream, hole.name, constraint, state, self.index)
        try:
            value = await self.backend.generate(seq, state, self.sampler)
        finally:
            seq.on_token = None
        stream.finish(value)
        return value

    def _hole_type_value(self, hole: ast.Hole) -> tuple[Any, tuple[tuple, dict] | None]:
        """The value of the hole's type; for a call `f(args)`, the value of `f` and the arguments, uncalled
        (`[X: one_of(options)]` runs the query `one_of` with `options`)."""
        parts = call_parts(hole.type)
        if parts is None:
            return self._eval(hole.type), None
        func, args = parts
        return self._eval(func), self._eval(args)

    async def _nest(self, hole: ast.Hole, query: Any, args: tuple, kwargs: dict) -> Any:
        """Run a nested query on a fork of the sequence, with a copy of the transcript (the text not sent yet
        included, so that a nested prompt is tokenized as the same text written in the outer query is): its
        prompt is context while it runs; if it returns a value, its prompt is hidden afterwards and the outer
        prompt goes on with the value's text (the value is X), else its prompt stays, and X is the text it
        wrote (LMQL's semantics)."""
        if self.depth >= MAX_NESTING:
            raise LMQRuntimeError(f"line {hole.span.line}: hole [{hole.name}: {hole.type.source}]: nested queries "
                                  f"go deeper than {MAX_NESTING} levels (a query that nests itself without end?)")
        try:
            child = query.nested(self, args, kwargs)
        except LMQError as e:
            raise _inside(e, hole)
        child.depth, child.root, child.written = self.depth + 1, self.root or self, []
        child.stream, child.index, child.role = self.stream, self.index, self.role
        child.transcript = self.transcript.copy()
        child.seq = self.backend.fork(self.seq)
        try:
            value = await child._body()
            if not query.returns:
                await child._flush()
        except BaseException as e:
            self.backend.release(child.seq)
            if isinstance(e, LMQError) and not isinstance(e, LMQBackendError):
                raise _inside(e, hole)
            raise
        if query.returns:
            self.backend.release(child.seq)
            self._write(str(value), hole.name)
            return value
        self.backend.release(self.seq)
        self.seq, self.transcript = child.seq, child.transcript
        written = "".join(child.written)
        if self.written is not None:
            self.written.append(written)
        return written

    async def _distribution(self, dist: ast.Distribution) -> str:
        options = self._eval(dist.options)
        options = [options] if isinstance(options, str) else list(options)
        if not options or not all(isinstance(o, str) for o in options):
            raise LMQRuntimeError(f"distribution {dist.var} needs a non-empty list of strings, got {options!r}")
        options = list(dict.fromkeys(options))  # (an option twice is one value: its probability once)
        logps = await self.backend.score(self.seq, options)
        top = max(logps)
        weights = [math.exp(lp - top) for lp in logps]
        total = sum(weights)
        self.distribution = self.distributions[dist.var] = {o: w / total for o, w in zip(options, weights)}
        best = max(self.distribution, key=self.distribution.get)
        await self.backend.extend(self.seq, best)
        self._generated(best, dist.var)
        return self._assign(dist.var, best)

    def _assign(self, name: str, value: Any) -> Any:
        """Record a hole's value (the compiled body assigns it to the variable)."""
        self.variables[name] = value
        return value

    # ----- Python -------------------------------------------------------------------------------------

    def _eval(self, expr: ast.PyExpr) -> Any:
        try:
            return eval(expr.code, self.env)  # noqa: S307 - query code is the user's own program
        except LMQError:
            raise
        except Exception as e:  # noqa: BLE001 - report the user's expression and where it is
            raise LMQRuntimeError(
                f"line {expr.span.line}: `{expr.source}` raised {type(e).__name__}: {e}") from e


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _from_lmq(e: Exception, program: Program) -> bool:
    """Whether `e` was raised inside lmq (a hole's generation, its engine step) rather than by the query's
    own Python: the frame the query's code last called into is lmq's."""
    after, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == program.filename:
            after = tb.tb_next
        tb = tb.tb_next
    return after is not None and os.path.abspath(after.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


def _inside(e: LMQError, hole: ast.Hole) -> LMQError:
    """An error of a nested query's call (its arguments, its lines: theirs are the nested query's own), naming
    the outer hole that called it first (once: a query that nests itself fails at the same hole at every level)."""
    where = f"line {hole.span.line}: hole [{hole.name}: {hole.type.source}]: "
    if e.args and isinstance(e.args[0], str) and not e.args[0].startswith(where):
        e.args = (where + e.args[0], *e.args[1:])
    return e


def _located(e: Exception, program: Program) -> LMQRuntimeError:
    """A Python exception of the query's code, as an error naming the query's line."""
    line, tb = 0, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == program.filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    lines = program.query.source.splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    if isinstance(e, TypeError) and "can't be used in 'await' expression" in str(e):
        return LMQRuntimeError(f"line {line}: `{text}`: `await` on a value that is not awaitable ({e})")
    return LMQRuntimeError(f"line {line}: `{text}` raised {type(e).__name__}: {e}")


def is_query(value: Any) -> bool:
    """Whether `value` is a query that a hole's type may name (`Query`: query.py)."""
    return callable(getattr(value, "nested", None)) and hasattr(value, "returns")


_CALL_PARTS: dict[ast.PyExpr, tuple[ast.PyExpr, ast.PyExpr] | None] = {}


def call_parts(expr: ast.PyExpr) -> tuple[ast.PyExpr, ast.PyExpr] | None:
    """For a call `f(a, k=b)`: `f`, and an expression whose value is `((a,), {"k": b})`; else None."""
    if expr in _CALL_PARTS:
        return _CALL_PARTS[expr]
    node = pyast.parse(expr.source.strip(), mode="eval").body
    parts = None
    if isinstance(node, pyast.Call):
        pack = pyast.Lambda(pyast.arguments([], [], pyast.arg("a"), [], [], pyast.arg("k"), []),
                            pyast.Tuple([pyast.Name("a", pyast.Load()), pyast.Name("k", pyast.Load())], pyast.Load()))
        func, args = pyast.unparse(node.func), pyast.unparse(pyast.Call(pack, node.args, node.keywords))
        parts = tuple(ast.PyExpr(src, compile(src, "<lmq>", "eval"), expr.names, expr.span) for src in (func, args))
    if len(_CALL_PARTS) > 4096:
        _CALL_PARTS.clear()
    _CALL_PARTS[expr] = parts
    return parts


def _conjoin(a: ast.Constraint | None, b: ast.Constraint | None) -> ast.Constraint | None:
    if a is None or b is None:
        return a if b is None else b
    return ast.And((a, b))
