"""Compiled queries: `lmq.compile(source)` and `@lmq.query`. A query parses and checks once; each call
runs it on its backend and returns a `Result` (or what its `return` returned; a list for `sample(n>1)` and
for beam decoders, best first)."""
from __future__ import annotations

import ast as pyast
import asyncio
import concurrent.futures
import contextlib
import inspect
import re
import textwrap
import time
from typing import Any, AsyncIterator, Callable, Iterable

from ..backend.protocol import Backend
from ..backend.registry import get_backend
from ..errors import LMQCompileError, LMQInputError, LMQUnknownVariableError
from ..language import ast, check_query, free_names, parse_query
from ..language.checks import BUILTIN_NAMES, bound_names, walk_stmts
from ..language.codegen import compile_program
from .constraints import NOT_LITERAL, check_constraint
from .decoders import DecoderSpec
from .beam import BeamSearch
from .interpreter import Run, call_parts, is_query
from .stream import Emit, StreamEvent
from .typed import hole_type

_LITERAL_CALLS = {"set": set, "frozenset": frozenset, "list": list, "tuple": tuple, "sorted": sorted}


def evaluate_literal(expr: ast.PyExpr) -> Any:
    """The value of a constant expression (literals, and set/list/tuple/sorted of literals), else NOT_LITERAL."""
    try:
        return pyast.literal_eval(expr.source)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        node = pyast.parse(expr.source, mode="eval").body
        if isinstance(node, pyast.Call) and isinstance(node.func, pyast.Name) and node.func.id in _LITERAL_CALLS \
                and not node.keywords and len(node.args) <= 1:
            args = [pyast.literal_eval(a) for a in node.args]
            return _LITERAL_CALLS[node.func.id](*args)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    return NOT_LITERAL


def _constraints(stmts: Iterable[ast.Stmt]):
    for stmt in walk_stmts(tuple(stmts)):
        if isinstance(stmt, ast.Prompt) and stmt.where is not None:
            yield stmt.where


class Query:
    """A compiled query. Call it with its inputs as keyword arguments (`await q(review="...")`)."""

    def __init__(self, source: str, *, name: str | None = None, model: str | Backend | None = None,
                 decoder: str | None = None, inputs: Iterable[str] | None = None,
                 scope: dict[str, Any] | None = None, signature: inspect.Signature | None = None):
        self.source = source
        self.ast = parse_query(source)
        self.scope = scope if scope is not None else {}  # live: a global defined or changed later is seen
        self.signature = signature
        self.inputs = set(inputs) if inputs is not None else None
        # a decorated query may name itself (a nested query that recurses)
        check_query(self.ast, self.inputs, set(self.scope) | ({name} if signature is not None else set()))
        for c in [*_constraints(self.ast.body), *([self.ast.where] if self.ast.where else [])]:
            check_constraint(c, evaluate_literal)
        self.decoder = (DecoderSpec.parse(decoder) if decoder is not None
                        else DecoderSpec.from_clause(self.ast.decoder.name, self.ast.decoder.args))
        self.model = model if model is not None else (self.ast.model or "default")
        self.name = name or _default_name(source, self.ast.decoder.name)
        self._needs = free_names(self.ast)
        self._returns = _has_return(self.ast.body)
        self.program = compile_program(self.ast, self.name)
        self._check_types()

    def _check_types(self) -> None:
        """A hole's type that names globals alone (`[X: int]`, `[P: Person]`) is checked now, before any call."""
        bound = set(self.inputs or ()) | bound_names(self.ast)
        scope = None
        for stmt in walk_stmts(self.ast.body):
            for piece in getattr(stmt, "pieces", ()):
                if not isinstance(piece, ast.Hole) or piece.type is None or call_parts(piece.type) is not None:
                    continue
                names = piece.type.names
                if names & bound or not names <= (self.scope.keys() | BUILTIN_NAMES):
                    continue
                scope = scope if scope is not None else dict(self.scope)
                try:
                    value = eval(piece.type.code, scope)  # noqa: S307 - the query's own type expression
                except Exception:  # noqa: BLE001 - reported when the query runs
                    continue
                if not is_query(value):
                    hole_type(value, piece)

    @property
    def backend(self) -> Backend:
        return self.model if isinstance(self.model, Backend) else get_backend(self.model)

    async def run(self, inputs: dict[str, Any], backend: Backend | None = None, stream: Emit | None = None):
        """Run once with `inputs`; returns a Result, the query's return value, or a list of them for n > 1.
        `stream`: called with each StreamEvent of the call but the last (`Query.stream`)."""
        self._check_inputs(inputs, "query")
        backend = backend or self.backend
        started = time.perf_counter()
        if self.decoder.beam:  # n results, best first, whatever n is (LMQL returns a list for beams)
            results = await BeamSearch(self.program, backend, {**self.scope, **inputs}, self.decoder, self.name).run()
            backend.record_call(self.name, time.perf_counter() - started)
            return [r.value if self._returns else r for r in results]
        runs = [Run(program=self.program, backend=backend, env={**self.scope, **inputs},
                    sampler=self.decoder.sampler(i), template=self.name, max_len=self.decoder.max_len,
                    stream=stream, index=i)
                for i in range(self.decoder.n)]
        # one run: awaited in this task (a task of its own per call costs more than the call's bookkeeping)
        results = [await runs[0].execute()] if len(runs) == 1 else await asyncio.gather(*(r.execute() for r in runs))
        backend.record_call(self.name, time.perf_counter() - started)
        out = [r.value if self._returns else r for r in results]
        return out[0] if self.decoder.n == 1 else out

    def _check_inputs(self, inputs: dict[str, Any], what: str) -> None:
        scope = self.scope
        missing = sorted(name for name in self._needs if name not in inputs and name not in scope)
        if not missing:
            return
        for stmt in walk_stmts(self.ast.body):
            for piece in getattr(stmt, "pieces", ()):
                if isinstance(piece, ast.Hole) and piece.type is not None and piece.type.names & set(missing):
                    name = sorted(piece.type.names & set(missing))[0]
                    raise LMQUnknownVariableError(
                        f"unknown type {name!r} of hole [{piece.name}: {piece.type.source}] at line "
                        f"{piece.type.span.line}, column {piece.type.span.column}: it is not an input or a global")
        raise LMQInputError(f"{what} {self.name!r} needs input(s) {', '.join(missing)}")

    @property
    def returns(self) -> bool:
        """Whether the query returns a value (nested, its prompt is then hidden once it has run)."""
        return self._returns

    def nested(self, parent: Run, args: tuple, kwargs: dict) -> Run:
        """A run of this query nested in `parent` (a hole `[X: this_query(args)]`): with the parent's backend,
        sampler and max_len; the parent gives it its sequence and transcript (`Run._nest`)."""
        inputs = self._bind(args, kwargs)
        self._check_inputs(inputs, "nested query")
        return Run(program=self.program, backend=parent.backend, env={**self.scope, **inputs}, sampler=parent.sampler,
                   template=self.name, max_len=parent.max_len)

    async def __call__(self, *args, **kwargs):
        return await self.run(self._bind(args, kwargs))

    async def stream(self, *args, **kwargs) -> AsyncIterator[StreamEvent]:
        """Run once, yielding StreamEvents as the prompt is written and its holes' tokens are decided, then a
        last event (`done`) with the result (runtime/stream.py). Closing or cancelling the iterator cancels
        the call (its cached prefixes are released)."""
        events: asyncio.Queue = asyncio.Queue()
        call = asyncio.ensure_future(self.run(self._bind(args, kwargs), stream=events.put_nowait))
        call.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                yield event
            yield StreamEvent(done=True, result=call.result())
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await call

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if self.signature is None:
            if args:
                raise LMQInputError(f"query {self.name!r} takes its inputs as keyword arguments")
            return kwargs
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise LMQInputError(f"query {self.name!r}: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def run_sync(self, *args, **kwargs):
        """Blocking call, for scripts and notebooks (where an event loop runs already: `await` the query there
        to run it alongside others; `run_sync` runs it in a thread of its own, with a loop of its own, and
        blocks the notebook's loop until it ends)."""
        return _run_sync(self(*args, **kwargs))

    async def map(self, inputs: Iterable[dict[str, Any]], concurrency: int = 32, progress: bool = False,
                  return_exceptions: bool = False) -> list:
        """Run over many inputs, at most `concurrency` at a time; results in input order. A failing input fails
        alone: with `return_exceptions` its exception takes its place in the list, else the first failure (in
        input order) is raised once every call has finished (as `Cluster.map`)."""
        from asyncio_pool import AioPool

        items = list(inputs)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(items), desc=self.name[:30])

        async def one(item):
            try:
                return await self.run(dict(item))
            finally:
                if bar is not None:
                    bar.update(1)

        try:
            async with AioPool(size=max(1, concurrency)) as pool:
                futures = [await pool.spawn(one(item)) for item in items]
            out = []
            for f in futures:
                error = f.exception()
                if error is not None and not return_exceptions:
                    raise error
                out.append(f.result() if error is None else error)
            return out
        finally:
            if bar is not None:
                bar.close()


def _has_return(stmts) -> bool:
    return any(isinstance(s, ast.Return) for s in walk_stmts(tuple(stmts)))


def _run_sync(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # a loop runs in this thread (a notebook's): the call runs to its end in a thread with its own loop (a backend
    # serves one loop at a time: one busy in this loop says so)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmq-run-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


def compile(source: str, *, name: str | None = None, model: str | Backend | None = None,
            inputs: Iterable[str] | None = None) -> Query:
    """Parse and check a query once. The caller's module globals are visible to the query."""
    caller = inspect.currentframe().f_back
    return Query(source, name=name, model=model, inputs=inputs, scope=caller.f_globals if caller else {})


def query(fn: Callable | None = None, *, model: str | Backend | None = None, decoder: str | None = None):
    """Decorate a function whose docstring is a query; its parameters are the query's inputs. The docstring is
    read as written in the source, as LMQL reads it (`"Q: {q}\\n"` is the query's own string with its escape, not a
    line break Python made of it); where the source is not at hand (code given to `exec`), as Python made it."""
    def wrap(f: Callable) -> Query:
        doc = f.__doc__
        if not doc or not doc.strip():
            raise LMQCompileError(f"@lmq.query function {f.__name__} has no query in its docstring")
        signature = inspect.signature(f)
        q = Query(textwrap.dedent(_docstring_as_written(f) or doc), name=f.__name__, model=model, decoder=decoder,
                  inputs=signature.parameters, scope=f.__globals__, signature=signature)
        q.__doc__, q.__name__, q.__wrapped__ = doc, f.__name__, f
        return q

    return wrap if fn is None else wrap(fn)


def _default_name(source: str, decoder: str) -> str:
    """A query's name where none is given: its first line (60 characters) that is not the decoder clause alone
    (`argmax`, `sample(n=4)`: many queries share it, and their statistics would merge)."""
    lines = [line.strip() for line in source.strip().splitlines() if line.strip() and not line.strip().startswith("#")]
    if len(lines) > 1 and re.fullmatch(rf"{re.escape(decoder)}\s*(\(.*\))?\s*:?", lines[0]):
        lines = lines[1:]
    return lines[0][:60] if lines else "query"


def _docstring_as_written(f: Callable) -> str | None:
    """`f`'s docstring as its source spells it (escapes as they stand), or None where the source is not at hand."""
    try:
        source = textwrap.dedent(inspect.getsource(f))
        tree = pyast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (pyast.FunctionDef, pyast.AsyncFunctionDef)) or not node.body:
        return None
    first = node.body[0]
    if not (isinstance(first, pyast.Expr) and isinstance(first.value, pyast.Constant)
            and isinstance(first.value.value, str)):
        return None
    literal = pyast.get_source_segment(source, first.value) or ""
    m = re.fullmatch(r"[rRuU]?('\'\'|\"\"\"|'|\")(.*)\1", literal, re.S)
    return m.group(2) if m is not None else None
