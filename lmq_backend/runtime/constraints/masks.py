"""Constraints at run time: a hole's constraint AST becomes token masks plus stop rules.

`constraint_for_hole` picks the conjuncts of a query's `where` that concern one hole, `check_constraint`
does the static checks before any model call, and `compile_hole_constraint` turns a hole's constraint into
a `HoleConstraint` whose `start()` gives the per-generation `HoleState` the engine drives:

    allowed()  -> bool[vocab.size] of the tokens that validly extend the value (None: every non-special one)
    can_end()  -> the value satisfies the constraint now
    advance(t) -> append a token from allowed(); a `Stop` when a stop rule fires

Values are bytes inside. Masks are numpy operations over the vocabulary or lookups proportional to the
option / string lengths, using the tables of `VocabIndex`; regular expressions, JSON schemas and grammars
run on llguidance. Special tokens and EOS are never in a mask: ending is what `can_end()` says.

Mask kinds, per constraint:
  X in options       exact: value + token must be a prefix of an option (a byte trie over the options)
  INT(X)             ^ ?-?[0-9]+$ (one optional leading space); a 4-state DFA, one mask per state
  STARTS_WITH(X, s)  value + token is a prefix of s or starts with s
  s in X             allowed: all; can_end: s occurs in the value
  not s in X         allowed: tokens t with s not in value + t; can_end: True
  len(X) < n         characters (non-continuation UTF-8 bytes, additive per token)
  not len(X) < n     allowed: all; can_end: len(value) >= n
  REGEX/JSON/GRAMMAR llguidance LLMatcher
  not A              (A a choice, INT or STARTS_WITH): allowed: all non-special; can_end: not A.can_end()
  and / or           intersection + all / union + any
Stop rules (only as top-level conjuncts): STOPS_AT, STOPS_BEFORE, len(TOKENS(X)) < n.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import (
    LMQCompileError, LMQConstraintConflictError, LMQError, LMQNotSupportedError, LMQRuntimeError,
    LMQUnknownConstraintError,
)
from ...language import ast
from ..vocab import VocabIndex

__all__ = [
    "NOT_LITERAL", "Stop", "HoleConstraint", "HoleState", "constraint_for_hole", "check_constraint",
    "compile_hole_constraint", "hole_vars",
]

NOT_LITERAL = object()
"""What an `evaluate_literal` function returns for an expression that is not a constant literal."""

KNOWN_FUNCS = {"STOPS_AT": 1, "STOPS_BEFORE": 1, "INT": 0, "REGEX": 1, "STARTS_WITH": 1, "JSON": 1, "GRAMMAR": 1}
STOP_FUNCS = {"STOPS_AT", "STOPS_BEFORE"}
LLG_FUNCS = {"REGEX", "JSON", "GRAMMAR"}


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop rule fired: the hole's final value `text`; the first `keep` appended tokens lie wholly inside
    it and `tail` is the rest of `text` after them (part of a later token's text), "" if none."""

    text: str
    keep: int
    tail: str


# ======================================================================================================
# structure: which hole, which conjuncts
# ======================================================================================================

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


# ======================================================================================================
# static checks
# ======================================================================================================

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


def _llg_grammar(kind: str, arg: str) -> str:
    import llguidance

    if kind == "REGEX":
        return llguidance.LLMatcher.grammar_from_regex(arg)
    if kind == "JSON":
        return llguidance.LLMatcher.grammar_from_json_schema(arg)
    return llguidance.LLMatcher.grammar_from_lark(arg)


def _llg_validate(kind: str, arg: str, c: ast.Call) -> None:
    """llguidance's own check of a regex / schema / grammar (no tokenizer needed)."""
    import llguidance

    try:
        msg = llguidance.LLMatcher.validate_grammar(_llg_grammar(kind, arg))
    except Exception as e:  # noqa: BLE001 - a malformed argument
        msg = str(e) or type(e).__name__
    if msg and not msg.startswith("WARNING"):
        raise LMQCompileError(f"{kind}({c.var}, ...) cannot be used: {msg.strip()}{_span(c)}")


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


# ======================================================================================================
# run time: nodes (compiled, reusable) and their states (one per generation)
# ======================================================================================================

class _Ctx:
    """The shared value of one generation: the bytes so far and the token ends."""

    __slots__ = ("value", "ends", "tokens")

    def __init__(self) -> None:
        self.value = bytearray()
        self.ends: list[int] = []
        self.tokens: list[int] = []


class _Node:
    def state(self, ctx: _Ctx) -> "_State":
        raise NotImplementedError


class _State:
    """allowed(): bool mask (non-special only) or None for every non-special token. can_end().
    advance(tok, old_len): the token's bytes are ctx.value[old_len:]; returns False if the token breaks
    this part (it is dead from then on)."""

    dead = False

    def allowed(self) -> np.ndarray | None:
        raise NotImplementedError

    def can_end(self) -> bool:
        raise NotImplementedError

    def advance(self, tok: int, old_len: int) -> bool:
        raise NotImplementedError


# ----- free text -----------------------------------------------------------------------------------------

class _FreeNode(_Node):
    def state(self, ctx):
        return _FreeState()


class _FreeState(_State):
    def allowed(self):
        return None

    def can_end(self):
        return True

    def advance(self, tok, old_len):
        return True


# ----- choice: a byte trie over the options --------------------------------------------------------------

_END = b""  # key of the terminal mark in a trie node


class _ChoiceNode(_Node):
    def __init__(self, options: list[str], vocab: VocabIndex):
        self.vocab = vocab
        self.root: dict = {}
        for o in options:
            node = self.root
            for b in o.encode("utf-8"):
                node = node.setdefault(bytes((b,)), {})
            node[_END] = True
        self._cache: OrderedDict[int, tuple[dict, np.ndarray]] = OrderedDict()

    def ids_at(self, node: dict) -> np.ndarray:
        """The tokens whose bytes walk from `node` to some trie node (memoized per node, LRU)."""
        key = id(node)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is node:
            self._cache.move_to_end(key)
            return hit[1]
        prefixes = self.vocab.token_prefixes
        get = self.vocab.bytes_to_ids.get
        found: list[np.ndarray] = []
        stack: list[tuple[dict, bytes]] = [(node, b"")]
        while stack:
            n, acc = stack.pop()
            for k, child in n.items():
                if k is _END or not k:
                    continue
                p = acc + k
                if p not in prefixes:
                    continue
                ids = get(p)
                if ids is not None:
                    found.append(ids)
                stack.append((child, p))
        ids = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        self._cache[key] = (node, ids)
        if len(self._cache) > 4096:
            self._cache.popitem(last=False)
        return ids

    def state(self, ctx):
        return _ChoiceState(self, ctx)


class _ChoiceState(_State):
    def __init__(self, node: _ChoiceNode, ctx: _Ctx):
        self.node, self.ctx, self.at, self.dead = node, ctx, node.root, False

    def allowed(self):
        mask = np.zeros(self.node.vocab.size, dtype=bool)
        if not self.dead:
            mask[self.node.ids_at(self.at)] = True
        return mask

    def can_end(self):
        return not self.dead and _END in self.at

    def advance(self, tok, old_len):
        if self.dead:
            return False
        at = self.at
        for b in bytes(self.ctx.value[old_len:]):
            at = at.get(bytes((b,)))
            if at is None:
                self.dead = True
                return False
        self.at = at
        return True


# ----- INT -----------------------------------------------------------------------------------------------

def _int_tables(vocab: VocabIndex):
    def build():
        masks = [
            vocab.tokens_matching(rb" ?-?[0-9]*"),  # start
            vocab.tokens_matching(rb"-?[0-9]*"),    # after the space
            vocab.tokens_matching(rb"[0-9]+"),      # after the minus
            vocab.tokens_matching(rb"[0-9]+"),      # digits
        ]
        return masks
    return vocab.memo("int-masks", build)


def _int_step(state: int, data: bytes) -> int:
    """The INT DFA: 0 start, 1 after ' ', 2 after '-', 3 digits; -1 dead."""
    for c in data:
        if 0x30 <= c <= 0x39:
            state = 3
        elif c == 0x20 and state == 0:
            state = 1
        elif c == 0x2D and state in (0, 1):
            state = 2
        else:
            return -1
    return state


class _IntNode(_Node):
    def __init__(self, vocab: VocabIndex):
        self.vocab = vocab
        self.masks = _int_tables(vocab)

    def state(self, ctx):
        return _IntState(self, ctx)


class _IntState(_State):
    def __init__(self, node: _IntNode, ctx: _Ctx):
        self.node, self.ctx, self.q, self.dead = node, ctx, 0, False

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.masks[self.q]

    def can_end(self):
        return not self.dead and self.q == 3

    def advance(self, tok, old_len):
        if self.dead:
            return False
        self.q = _int_step(self.q, bytes(self.ctx.value[old_len:]))
        if self.q < 0:
            self.dead = True
        return not self.dead


# ----- STARTS_WITH ---------------------------------------------------------------------------------------

class _StartsWithNode(_Node):
    def __init__(self, prefix: str, vocab: VocabIndex):
        self.vocab = vocab
        self.prefix = prefix.encode("utf-8")
        self._masks: dict[int, np.ndarray] = {}

    def mask_at(self, n: int) -> np.ndarray:
        """The mask after the first n bytes of the prefix."""
        hit = self._masks.get(n)
        if hit is None:
            vocab = self.vocab
            rest = self.prefix[n:]
            hit = np.zeros(vocab.size, dtype=bool)
            for ids in vocab.ids_prefix_of(rest):
                hit[ids] = True
            hit[vocab.ids_starting_with(rest)] = True
            hit.flags.writeable = False
            self._masks[n] = hit
        return hit

    def state(self, ctx):
        return _StartsWithState(self, ctx)


class _StartsWithState(_State):
    def __init__(self, node: _StartsWithNode, ctx: _Ctx):
        self.node, self.ctx, self.dead = node, ctx, False

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        n = len(self.ctx.value)
        if n >= len(self.node.prefix):
            return None
        return self.node.mask_at(n)

    def can_end(self):
        return not self.dead and len(self.ctx.value) >= len(self.node.prefix)

    def advance(self, tok, old_len):
        if self.dead:
            return False
        p = self.node.prefix
        if old_len < len(p):
            v = self.ctx.value
            m = min(len(v), len(p))
            if bytes(v[old_len:m]) != p[old_len:m]:
                self.dead = True
        return not self.dead


# ----- contains / not contains ---------------------------------------------------------------------------

class _ContainsNode(_Node):
    def __init__(self, needle: str, vocab: VocabIndex):
        self.vocab, self.needle = vocab, needle.encode("utf-8")

    def state(self, ctx):
        return _ContainsState(self, ctx)


class _ContainsState(_State):
    def __init__(self, node: _ContainsNode, ctx: _Ctx):
        self.node, self.ctx, self.found = node, ctx, not node.needle

    def allowed(self):
        return None

    def can_end(self):
        return self.found

    def advance(self, tok, old_len):
        if not self.found:
            s = self.node.needle
            self.found = self.ctx.value.find(s, max(0, old_len - len(s) + 1)) >= 0
        return True


class _NotContainsNode(_Node):
    def __init__(self, needle: str, vocab: VocabIndex):
        self.vocab, self.needle = vocab, needle.encode("utf-8")
        self.base = ~vocab.tokens_containing(self.needle) & vocab.nonspecial if self.needle else \
            np.zeros(vocab.size, dtype=bool)
        self.base.flags.writeable = False
        self._masks: dict[int, np.ndarray] = {}  # keyed by the set of k (as a bitmask) the value ends with

    def mask_for(self, value: bytearray) -> np.ndarray:
        s = self.needle
        key = 0
        for k in range(1, len(s)):
            if value.endswith(s[:k]):
                key |= 1 << k
        if not key:
            return self.base
        hit = self._masks.get(key)
        if hit is None:
            hit = self.base.copy()
            for k in range(1, len(s)):
                if key >> k & 1:
                    hit[self.vocab.ids_starting_with(s[k:])] = False
            hit.flags.writeable = False
            if len(self._masks) < 1024:
                self._masks[key] = hit
        return hit

    def state(self, ctx):
        return _NotContainsState(self, ctx)


class _NotContainsState(_State):
    def __init__(self, node: _NotContainsNode, ctx: _Ctx):
        self.node, self.ctx, self.dead = node, ctx, not node.needle

    def allowed(self):
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.mask_for(self.ctx.value)

    def can_end(self):
        return not self.dead

    def advance(self, tok, old_len):
        if not self.dead:
            s = self.node.needle
            if self.ctx.value.find(s, max(0, old_len - len(s) + 1)) >= 0:
                self.dead = True
        return not self.dead


# ----- length in characters ------------------------------------------------------------------------------

class _LenNode(_Node):
    """max_chars: the value has at most that many characters; min_chars: can_end only from there on.
    Characters are counted as `len(value.decode("utf-8", errors="replace"))` counts them, token by token
    (`VocabIndex.utf8_tables`: the count a token adds depends on the continuation bytes still expected)."""

    def __init__(self, vocab: VocabIndex, max_chars: int | None = None, min_chars: int | None = None):
        self.vocab, self.max_chars, self.min_chars = vocab, max_chars, min_chars
        self._masks: dict[tuple[int, int], np.ndarray] = {}

    def mask_for(self, pending: int, budget: int) -> np.ndarray:
        key = (pending, budget)
        hit = self._masks.get(key)
        if hit is None:
            hit = (self.vocab.utf8_tables(pending)[0] <= budget) & self.vocab.nonspecial
            hit.flags.writeable = False
            if len(self._masks) < 512:
                self._masks[key] = hit
        return hit

    def state(self, ctx):
        return _LenState(self)


class _LenState(_State):
    def __init__(self, node: _LenNode):
        self.node, self.chars, self.pending, self.dead = node, 0, 0, False

    def allowed(self):
        if self.node.max_chars is None:
            return None
        if self.dead:
            return np.zeros(self.node.vocab.size, dtype=bool)
        return self.node.mask_for(self.pending, self.node.max_chars - self.chars)

    def can_end(self):
        return not self.dead and (self.node.min_chars is None or self.chars >= self.node.min_chars)

    def advance(self, tok, old_len):
        chars, nxt = self.node.vocab.utf8_tables(self.pending)
        self.chars += int(chars[tok])
        self.pending = int(nxt[tok])
        if self.node.max_chars is not None and self.chars > self.node.max_chars:
            self.dead = True
        return not self.dead


# ----- llguidance: REGEX, JSON, GRAMMAR ------------------------------------------------------------------

class _LLGNode(_Node):
    def __init__(self, kind: str, arg: Any, vocab: VocabIndex, where: ast.Call):
        self.vocab = vocab
        try:
            grammar = _llg_grammar(kind, arg)
        except Exception as e:  # noqa: BLE001
            raise LMQRuntimeError(f"{kind}({where.var}, ...) cannot be used: {e}{_span(where)}") from None
        self.template = vocab.memo(("llg", kind, arg), lambda: _new_matcher(vocab, grammar, kind, where))
        self.ll_size = vocab.ll_tokenizer().vocab_size

    def state(self, ctx):
        return _LLGState(self, self.template.deep_copy())


def _new_matcher(vocab: VocabIndex, grammar: str, kind: str, where: ast.Call):
    import llguidance

    m = llguidance.LLMatcher(vocab.ll_tokenizer(), grammar, log_level=0)
    if m.is_error():
        raise LMQRuntimeError(f"{kind}({where.var}, ...): llguidance cannot use it: {m.get_error()}{_span(where)}")
    return m


class _LLGState(_State):
    def __init__(self, node: _LLGNode, matcher: Any):
        self.node, self.m, self.dead = node, matcher, False
        self._mask: np.ndarray | None = None

    def allowed(self):
        if self._mask is None:
            size = self.node.vocab.size
            if self.dead or self.m.is_stopped():
                self._mask = np.zeros(size, dtype=bool)
            else:
                bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
                mask = np.unpackbits(bits, bitorder="little").view(bool)
                if len(mask) >= size:
                    mask = mask[:size]
                else:
                    mask = np.concatenate([mask, np.zeros(size - len(mask), dtype=bool)])
                mask &= self.node.vocab.nonspecial
                self._mask = mask
        return self._mask

    def can_end(self):
        return not self.dead and not self.m.is_error() and self.m.is_accepting()

    def advance(self, tok, old_len):
        self._mask = None
        if not self.dead and not self.m.consume_token(int(tok)):
            self.dead = True
        return not self.dead


# ----- and / or / not ------------------------------------------------------------------------------------

class _AndNode(_Node):
    def __init__(self, parts: list[_Node]):
        self.parts = parts

    def state(self, ctx):
        return _AndState([p.state(ctx) for p in self.parts])


class _AndState(_State):
    def __init__(self, parts: list[_State]):
        self.parts = parts

    def allowed(self):
        out = None
        for p in self.parts:
            m = p.allowed()
            if m is None:
                continue
            if out is None:
                out = m
            else:
                out = out & m
        return out

    def can_end(self):
        return all(p.can_end() for p in self.parts)

    def advance(self, tok, old_len):
        ok = True
        for p in self.parts:
            ok = p.advance(tok, old_len) and ok
        return ok


class _OrNode(_Node):
    def __init__(self, parts: list[_Node]):
        self.parts = parts

    def state(self, ctx):
        return _OrState([p.state(ctx) for p in self.parts])


class _OrState(_State):
    def __init__(self, parts: list[_State]):
        self.parts = parts

    def allowed(self):
        out = None
        for p in self.parts:
            if p.dead:
                continue
            m = p.allowed()
            if m is None:
                return None
            out = m if out is None else out | m
        return out

    def can_end(self):
        return any(not p.dead and p.can_end() for p in self.parts)

    @property
    def dead(self):  # type: ignore[override]
        return all(p.dead for p in self.parts)

    def advance(self, tok, old_len):
        alive = False
        for p in self.parts:
            if not p.dead:
                alive = p.advance(tok, old_len) or alive
        return alive


class _NotNode(_Node):
    """`not A` for a choice, INT or STARTS_WITH: every non-special token, can_end iff A cannot end."""

    def __init__(self, part: _Node):
        self.part = part

    def state(self, ctx):
        return _NotState(self.part.state(ctx))


class _NotState(_State):
    def __init__(self, inner: _State):
        self.inner = inner

    def allowed(self):
        return None

    def can_end(self):
        return not self.inner.can_end()

    def advance(self, tok, old_len):
        self.inner.advance(tok, old_len)
        return True


# ----- stop rules ----------------------------------------------------------------------------------------

class _StopString:
    def __init__(self, s: str, before: bool):
        self.s, self.before = s.encode("utf-8"), before

    def end(self, value: bytearray, old_len: int) -> int | None:
        """The end (in bytes) of the final value if the stop string now occurs, else None."""
        i = value.find(self.s, max(0, old_len - len(self.s) + 1))
        if i < 0:
            return None
        return i if self.before else i + len(self.s)


# ======================================================================================================
# the public objects
# ======================================================================================================

class HoleConstraint:
    """The compiled constraint of one hole; `start()` gives a fresh `HoleState` (cheap, reusable)."""

    def __init__(self, node: _Node, vocab: VocabIndex, stops: list[_StopString], max_tokens: int | None):
        self.node, self.vocab, self.stops, self.max_tokens = node, vocab, stops, max_tokens
        self.unconstrained = isinstance(node, _FreeNode) and not stops and max_tokens is None

    def start(self) -> "HoleState":
        return HoleState(self)


class HoleState:
    """One generation of a hole: see the module docstring."""

    def __init__(self, hc: HoleConstraint):
        self.hc = hc
        self.ctx = _Ctx()
        self.root = hc.node.state(self.ctx)
        self._allowed: Any = False  # False: not computed yet
        self._stopped: Stop | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.ctx.tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self.ctx.tokens)

    @property
    def value_bytes(self) -> bytes:
        return bytes(self.ctx.value)

    @property
    def text(self) -> str:
        return self.ctx.value.decode("utf-8", errors="replace")

    def allowed(self) -> np.ndarray | None:
        if self._allowed is False:
            if self._stopped is not None or (self.hc.max_tokens is not None and self.n_tokens >= self.hc.max_tokens):
                mask = np.zeros(self.hc.vocab.size, dtype=bool)
            else:
                mask = self.root.allowed()
                if mask is not None and not mask.flags.writeable:
                    mask = mask.copy()
            self._allowed = mask
        mask = self._allowed
        return None if mask is None else mask.copy()

    def can_end(self) -> bool:
        return self.root.can_end()

    def advance(self, token_id: int) -> Stop | None:
        if self._stopped is not None:
            raise LMQRuntimeError("advance() after the hole stopped")
        token_id = int(token_id)
        vocab = self.hc.vocab
        if not 0 <= token_id < vocab.size or vocab.special[token_id]:
            raise LMQRuntimeError(f"token {token_id} cannot be part of a value (special or out of range)")
        ctx = self.ctx
        old_len = len(ctx.value)
        ctx.value += vocab.token_bytes[token_id]
        ctx.ends.append(len(ctx.value))
        ctx.tokens.append(token_id)
        self._allowed = False
        self.root.advance(token_id, old_len)
        end: int | None = None
        for rule in self.hc.stops:
            e = rule.end(ctx.value, old_len)
            if e is not None and (end is None or e < end):
                end = e
        if end is None and self.hc.max_tokens is not None and self.n_tokens >= self.hc.max_tokens:
            end = len(ctx.value)
        if end is None:
            return None
        self._stopped = self._make_stop(end)
        return self._stopped

    def _make_stop(self, end: int) -> Stop:
        value = self.ctx.value
        keep = 0
        for i, e in enumerate(self.ctx.ends):
            if e > end:
                break
            # a kept token must end on a character boundary, so that the tail is a whole string
            if e == len(value) or e == end or value[e] & 0xC0 != 0x80:
                keep = i + 1
        start = self.ctx.ends[keep - 1] if keep else 0
        return Stop(text=bytes(value[:end]).decode("utf-8", errors="replace"), keep=keep,
                    tail=bytes(value[start:end]).decode("utf-8", errors="replace"))


# ----- compilation ---------------------------------------------------------------------------------------

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
        vocab = self.vocab
        if len(options) <= 64:
            return vocab.memo(("choice", tuple(options)), lambda: _ChoiceNode(options, vocab))
        return _ChoiceNode(options, vocab)

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


def compile_hole_constraint(c: ast.Constraint | None, evaluate: Callable[[ast.PyExpr], Any],
                            vocab: VocabIndex) -> HoleConstraint:
    """The run-time constraint of one hole (`c` as given by `constraint_for_hole`; None: free text).
    `evaluate` evaluates argument expressions in the query's scope."""
    comp = _Compiler(evaluate, vocab)
    node = comp.top(c)
    return HoleConstraint(node, vocab, comp.stops, comp.max_tokens)
