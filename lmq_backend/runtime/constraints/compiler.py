"""The compiler: a hole's constraint AST -> a `HoleConstraint` (a tree of mask nodes plus stop rules)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ...errors import (
    LMQCompileError, LMQConstraintConflictError, LMQError, LMQNotSupportedError, LMQRuntimeError,
    LMQUnknownConstraintError,
)
from ...language import ast
from ...text.vocab import VocabIndex
from .checks import (
    KNOWN_FUNCS, STOP_FUNCS, _check_limit_value, _check_options_value, _check_string_arg, _json_schema_text,
    _max_len, _mentions, _static_test, _unsupported_nested,
)
from .hole import HoleConstraint
from .llg import _LLGNode
from .masks import _ChoiceNode, _ContainsNode, _IntNode, _LenNode, _NotContainsNode, _StartsWithNode
from .nodes import _AndNode, _FreeNode, _Node, _NotNode, _OrNode
from .selection import _conjuncts, _span
from .stops import _StopString

LONG_CHOICES = 8
"""How many option lists of more than 64 options keep their compiled choice node (per vocabulary)."""


def _push_not(c: ast.Constraint, negate: bool = False) -> ast.Constraint:
    """Negation normal form: `not` only directly above leaves."""
    if isinstance(c, ast.Not):
        return _push_not(c.part, not negate)
    if isinstance(c, ast.And):
        parts = tuple(_push_not(p, negate) for p in c.parts)
        return ast.Or(parts) if negate else ast.And(parts)
    if isinstance(c, ast.Or):
        parts = tuple(_push_not(p, negate) for p in c.parts)
        return ast.And(parts) if negate else ast.Or(parts)
    return ast.Not(c) if negate else c


class _Compiler:
    def __init__(self, evaluate: Callable[[ast.PyExpr], Any], vocab: VocabIndex):
        self.evaluate, self.vocab = evaluate, vocab
        self.stops: list[_StopString] = []
        self.max_tokens: int | None = None
        self.values: dict[int, tuple[ast.PyExpr, Any]] = {}

    def value(self, expr: ast.PyExpr) -> Any:
        """The value of an argument (evaluated once per compilation; an iterator is materialized)."""
        key = id(expr)
        if key in self.values:
            return self.values[key][1]
        try:
            v = self.evaluate(expr)
        except LMQError:
            raise
        except Exception as e:
            raise LMQRuntimeError(f"evaluating `{expr.source}` failed: {type(e).__name__}: {e}") from e
        if hasattr(v, "__next__"):
            try:
                v = list(v)
            except Exception as e:
                raise LMQRuntimeError(f"iterating `{expr.source}` failed: {type(e).__name__}: {e}") from e
        self.values[key] = (expr, v)
        return v

    def top(self, c: ast.Constraint | None) -> _Node:
        if c is None:
            return _FreeNode()
        parts = []
        for p in _conjuncts(_push_not(c)):
            if isinstance(p, ast.Call) and p.func in STOP_FUNCS:
                self.call_check(p)
                s = _check_string_arg(p.func, self.value(p.args[0]), p, LMQRuntimeError)
                self.stops.append(_StopString(s, before=p.func == "STOPS_BEFORE"))
            elif isinstance(p, ast.LenLimit) and p.unit == "tokens":
                n = _check_limit_value(self.value(p.limit), p, LMQRuntimeError)
                m = _max_len(p.op, n)
                if m < 0:
                    raise LMQConstraintConflictError(f"`len(TOKENS({p.var})) {p.op} {n}` cannot hold{_span(p)}")
                self.max_tokens = m if self.max_tokens is None else min(self.max_tokens, m)
            else:
                parts.append(p)
        parts = self.and_parts(parts)
        parts = [p for p in parts if not isinstance(p, _FreeNode)]
        if not parts:
            return _FreeNode()
        return parts[0] if len(parts) == 1 else _AndNode(parts)

    def call_check(self, c: ast.Call) -> None:
        if c.func not in KNOWN_FUNCS:
            raise LMQUnknownConstraintError(f"unknown constraint function {c.func}{_span(c)}")
        if len(c.args) != KNOWN_FUNCS[c.func]:
            raise LMQCompileError(f"{c.func} takes {KNOWN_FUNCS[c.func]} argument(s) after the variable{_span(c)}")

    def and_parts(self, conjs: list[ast.Constraint]) -> list[_Node]:
        """The nodes of `and`-ed constraints. The options of a choice are first filtered by the other
        conjuncts that can be tested on a whole value in Python (so that a choice never starts down an
        option that can never end; REGEX is left out: its syntax is llguidance's)."""
        out = []
        for p in conjs:
            if isinstance(p, ast.Choice):
                tests = []
                for q in conjs:
                    if q is p or _mentions(q, ("REGEX", "JSON", "GRAMMAR", "STOPS_AT", "STOPS_BEFORE")):
                        continue
                    if isinstance(q, ast.LenLimit) and q.unit == "tokens":
                        continue
                    t = _static_test(q, self.value)
                    if t is not None:
                        tests.append(t)
                options = _check_options_value(self.value(p.options), p, LMQRuntimeError)
                if tests:
                    options = [o for o in options if all(t(o) for t in tests)]
                    if not options:
                        raise LMQConstraintConflictError(
                            f"none of the options of `{p.var} in ...` satisfies the other conditions on "
                            f"{p.var}{_span(p)}")
                out.append(self.choice(options))
            else:
                out.append(self.node(p))
        return out

    def choice(self, options: list[str]) -> _Node:
        """The choice node of `options`, shared by the calls that give the same options (its byte trie and
        masks are built once): lists of up to 64 options are kept on the vocabulary index, longer ones
        among the last `LONG_CHOICES` (a long list is typically a data set's labels, the same every call)."""
        vocab = self.vocab
        key = tuple(options)
        if len(options) <= 64:
            return vocab.memo(("choice", key), lambda: _ChoiceNode(options, vocab))
        recent: OrderedDict[tuple[str, ...], _ChoiceNode] = vocab.memo("choice-long", OrderedDict)
        node = recent.get(key)
        if node is None:
            node = recent[key] = _ChoiceNode(options, vocab)
            if len(recent) > LONG_CHOICES:
                recent.popitem(last=False)
        else:
            recent.move_to_end(key)
        return node

    def node(self, c: ast.Constraint) -> _Node:
        vocab = self.vocab
        if isinstance(c, ast.And):
            return _AndNode(self.and_parts(_conjuncts(c)))
        if isinstance(c, ast.Or):
            for p in c.parts:
                _unsupported_nested(p, "or")
            return _OrNode([self.node(p) for p in c.parts])
        if isinstance(c, ast.Not):
            inner = c.part
            _unsupported_nested(inner, "not")
            if isinstance(inner, ast.Contains):
                s = self.value(inner.needle)
                if not isinstance(s, str):
                    raise LMQRuntimeError(f"`... in {inner.var}` needs a string, not {type(s).__name__}{_span(inner)}")
                if not s:
                    raise LMQConstraintConflictError(f'`not "" in {inner.var}` cannot hold{_span(inner)}')
                return _NotContainsNode(s, vocab)
            if isinstance(inner, ast.LenLimit):  # not len(X) < n  ==  len(X) >= n
                n = _check_limit_value(self.value(inner.limit), inner, LMQRuntimeError)
                return _LenNode(vocab, min_chars=_max_len(inner.op, n) + 1)
            return _NotNode(self.node(inner))
        if isinstance(c, ast.Choice):
            return self.choice(_check_options_value(self.value(c.options), c, LMQRuntimeError))
        if isinstance(c, ast.Contains):
            s = self.value(c.needle)
            if not isinstance(s, str):
                raise LMQRuntimeError(f"`... in {c.var}` needs a string, not {type(s).__name__}{_span(c)}")
            return _ContainsNode(s, vocab) if s else _FreeNode()
        if isinstance(c, ast.LenLimit):
            if c.unit == "tokens":
                raise LMQNotSupportedError(f"len(TOKENS({c.var})) must be a top-level condition{_span(c)}")
            n = _check_limit_value(self.value(c.limit), c, LMQRuntimeError)
            m = _max_len(c.op, n)
            if m < 0:
                raise LMQConstraintConflictError(f"`len({c.var}) {c.op} {n}` cannot hold{_span(c)}")
            return _LenNode(vocab, max_chars=m)
        if isinstance(c, ast.Call):
            self.call_check(c)
            if c.func == "INT":
                return _IntNode(vocab)
            if c.func in STOP_FUNCS:
                raise LMQNotSupportedError(f"{c.func} must be a top-level condition{_span(c)}")
            arg = self.value(c.args[0])
            if c.func == "STARTS_WITH":
                s = _check_string_arg(c.func, arg, c, LMQRuntimeError, allow_empty=True)
                return _StartsWithNode(s, vocab) if s else _FreeNode()
            if c.func == "REGEX":
                s = _check_string_arg(c.func, arg, c, LMQRuntimeError, allow_empty=True)
                return _LLGNode("REGEX", s, vocab, c)
            if c.func == "JSON":
                return _LLGNode("JSON", _json_schema_text(arg, c, LMQRuntimeError), vocab, c)
            if c.func == "GRAMMAR":
                s = _check_string_arg(c.func, arg, c, LMQRuntimeError)
                return _LLGNode("GRAMMAR", s, vocab, c)
        raise LMQCompileError(f"unknown constraint {c!r}")


MAX_COMPILED = 256
"""How many compiled constraints are kept for reuse (per vocabulary; all dropped when full)."""

_PLAIN = (type(None), bool, int, float, str)


def compile_hole_constraint(c: ast.Constraint | None, evaluate: Callable[[ast.PyExpr], Any],
                            vocab: VocabIndex) -> HoleConstraint:
    """The run-time constraint of one hole (`c` as given by `constraint_for_hole`; None: free text).
    `evaluate` evaluates argument expressions in the query's scope.

    Compiling is a function of the constraint and the values of its arguments, and a `HoleConstraint` is
    stateless (`start()` gives each generation its own state): so an equal constraint (the syntax trees are
    values: a hole's conjuncts and a query's global `where` come as a new `And` each call) whose arguments
    evaluate again to equal plain values (None, bool, int, float, str, tuples and frozensets of them:
    compared with their types) gets the constraint compiled before (a query called over a data set compiles
    its holes once). Any other value (a list, a dict: mutable) compiles every call."""
    memo: dict[ast.Constraint, tuple] = vocab.memo("compiled", dict)  # c -> ([(expr, key of its value)], compiled)
    hit = memo.get(c)
    if hit is not None:
        try:
            if all(_plain_key(evaluate(expr)) == key for expr, key in hit[0]):
                return hit[1]
        except Exception:  # noqa: BLE001 - the compiler below reports it as it does
            pass
    comp = _Compiler(evaluate, vocab)
    node = comp.top(c)
    compiled = HoleConstraint(node, vocab, comp.stops, comp.max_tokens)
    keys = [(expr, _plain_key(v)) for expr, v in comp.values.values()]
    if all(key is not None for _, key in keys):
        if len(memo) >= MAX_COMPILED:
            memo.clear()
        memo[c] = (keys, compiled)
    return compiled


def _plain_key(v: Any) -> Any:
    """A plain value with its types (True and 1, 1 and 1.0 differ), or None for any other value."""
    if type(v) in _PLAIN:
        return type(v), v
    if type(v) in (tuple, frozenset):
        keys = [_plain_key(x) for x in v]
        return None if None in keys else (type(v), tuple(keys) if type(v) is tuple else frozenset(keys))
    return None
