"""The lmq parser: query source text -> `QueryAST`.

`parse_query(source)` does, in order:

1. normalise the text (line endings, `textwrap.dedent`, a leading `lmql`/`lmq` marker line blanked out,
   trailing blank lines dropped);
2. parse it with the LALR grammar `grammar/lmq.lark` and the indenter `_LMQIndenter`;
3. transform the statement-level tree with `QueryTransformer` (one method per grammar rule); Python
   expressions are sliced out of the source and compiled with Python's own `compile` (a Python
   `SyntaxError` becomes an `LMQSyntaxError` at the expression's position); prompt strings are
   decoded with `ast.literal_eval` and split into Text/Hole/Interp pieces by `parse_template`;
4. convert `where` expressions (inline and global) into `Constraint` trees
   (unknown forms raise `LMQUnknownConstraintError`).

Semantic checks (constraint subjects are holes, empty choices, decoder name/arguments, distribution,
unknown inputs) are in `checks.check_query`, which the caller runs after `parse_query` and before any
model call. Both only ever raise `LMQError` subclasses.
"""
from __future__ import annotations

import ast
import bisect
import importlib.resources
import re
import textwrap
import threading
import warnings
from dataclasses import replace
from types import CodeType
from typing import Any, Iterator

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lark import PostLex

from ..errors import LMQCompileError, LMQError, LMQSyntaxError, LMQUnknownConstraintError
from .ast import (
    And, Break, Call, Choice, Constraint, Contains, Continue, Decoder, Distribution, Exec, For, Hole, If,
    Interp, LenLimit, Not, Or, Piece, Prompt, PyExpr, PyStmt, QueryAST, Return, Span, Stmt, Text,
)

__all__ = ["parse_query", "parse_template", "normalize_source", "QueryTransformer", "CONSTRAINT_FUNCS",
           "SUPPORTED_CONSTRAINTS"]

MAX_PAREN_DEPTH = 200     # as CPython's tokenizer
MAX_INDENT_DEPTH = 100    # as CPython's tokenizer

# constraint function -> number of arguments after the hole
CONSTRAINT_FUNCS: dict[str, int] = {
    "STOPS_AT": 1, "STOPS_BEFORE": 1, "INT": 0, "REGEX": 1, "STARTS_WITH": 1, "JSON": 1, "GRAMMAR": 1,
}
SUPPORTED_CONSTRAINTS = (
    "VAR in <options>, <str> in VAR, <str> not in VAR, not C, C and C, C or C, "
    "len(VAR) < n, len(VAR) <= n, len(TOKENS(VAR)) < n, len(TOKENS(VAR)) <= n, "
    "STOPS_AT(VAR, s), STOPS_BEFORE(VAR, s), INT(VAR), REGEX(VAR, pattern), STARTS_WITH(VAR, s), "
    "JSON(VAR, schema), GRAMMAR(VAR, grammar)"
)


# ----- source positions -----------------------------------------------------------------------------

class _Source:
    """The normalised source text, with offset -> (line, column) conversion (both 1-based)."""

    def __init__(self, text: str):
        self.text = text
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def pos(self, offset: int) -> tuple[int, int]:
        offset = max(0, min(offset, len(self.text)))
        i = bisect.bisect_right(self.line_starts, offset) - 1
        return i + 1, offset - self.line_starts[i] + 1

    def offset(self, line: int, column: int) -> int:
        line = max(1, min(line, len(self.line_starts)))
        return self.line_starts[line - 1] + max(column - 1, 0)

    def error(self, message: str, line: int, column: int) -> LMQSyntaxError:
        return LMQSyntaxError(message, self.text, line, column)


# ----- normalisation --------------------------------------------------------------------------------

_MARKER = re.compile(r"[ \t]*(lmql|lmq)[ \t]*")


def normalize_source(source: str) -> str:
    """Line endings to `\\n`, a first non-blank line `lmql`/`lmq` blanked (line numbers are kept),
    `textwrap.dedent`, trailing whitespace dropped."""
    if isinstance(source, bytes):
        source = source.decode("utf-8")
    if not isinstance(source, str):
        raise LMQSyntaxError(f"a query must be a string, not {type(source).__name__}")
    text = source.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip():
            if _MARKER.fullmatch(line):
                lines[i] = ""
            break
    text = textwrap.dedent("\n".join(lines))
    return text.rstrip()


# ----- the indenter (postlex) -----------------------------------------------------------------------

class _LMQIndenter(PostLex):
    """Python-style _INDENT/_DEDENT injection. Newlines inside brackets and after a trailing
    `and`/`or` are dropped (line continuation). Raises LMQSyntaxError on bad dedents, too deep nesting
    and unclosed brackets."""

    OPEN = {"LPAR": ")", "LSQB": "]", "LBRACE": "}"}
    CLOSE = {"RPAR", "RSQB", "RBRACE"}
    CONTINUE_AFTER = {"AND", "OR"}
    always_accept = ("_NEWLINE",)

    def __init__(self) -> None:
        self.src: _Source | None = None

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        src = self.src
        opened: list[Token] = []
        levels = [0]
        prev: Token | None = None
        last: Token | None = None
        for tok in stream:
            last = tok
            if tok.type == "_NEWLINE":
                if opened or (prev is not None and prev.type in self.CONTINUE_AFTER):
                    continue
                yield tok
                indent_str = tok.value.rsplit("\n", 1)[-1]
                indent = len(indent_str.expandtabs(8))
                line, col = tok.end_line, tok.end_column
                if indent > levels[-1]:
                    if len(levels) > MAX_INDENT_DEPTH:
                        raise src.error("too many levels of indentation", line, col)
                    levels.append(indent)
                    yield self._tok("_INDENT", indent_str, tok)
                else:
                    while indent < levels[-1]:
                        levels.pop()
                        yield self._tok("_DEDENT", indent_str, tok)
                    if indent != levels[-1]:
                        raise src.error("unindent does not match any outer indentation level", line, col)
            else:
                yield tok
                if tok.type in self.OPEN:
                    opened.append(tok)
                    if len(opened) > MAX_PAREN_DEPTH:
                        raise src.error("too many nested parentheses", tok.line, tok.column)
                elif tok.type in self.CLOSE and opened:
                    opened.pop()
            prev = tok
        if opened:
            t = opened[-1]
            raise src.error(f"'{t.value}' was never closed", t.line, t.column)
        while len(levels) > 1:
            levels.pop()
            yield self._tok("_DEDENT", "", last) if last is not None else Token("_DEDENT", "")

    @staticmethod
    def _tok(type_: str, value: str, nl: Token) -> Token:
        return Token(type_, value, start_pos=nl.end_pos, line=nl.end_line, column=nl.end_column,
                     end_line=nl.end_line, end_column=nl.end_column, end_pos=nl.end_pos)


# ----- the lark parser (a lazy, module-level singleton) ---------------------------------------------

_lark: Lark | None = None
_lark_lock = threading.Lock()
_parse_lock = threading.Lock()   # the postlex instance holds per-parse state
_indenter = _LMQIndenter()


def grammar_text() -> str:
    return (importlib.resources.files("lmq_grammar") / "lmq.lark").read_text(encoding="utf-8")


def _get_lark() -> Lark:
    global _lark
    if _lark is None:
        with _lark_lock:
            if _lark is None:
                _lark = Lark(grammar_text(), parser="lalr", lexer="contextual", postlex=_indenter,
                             propagate_positions=True, maybe_placeholders=True, start="start")
    return _lark


_TOKEN_NAMES = {
    "_NEWLINE": "end of line", "_INDENT": "indent", "_DEDENT": "dedent", "$END": "end of input",
    "NAME": "name", "STRING": "string", "LONG_STRING": "string", "DEC_NUMBER": "number",
}


def _describe_expected(expected: set[str]) -> str:
    lark = _get_lark()
    shown = set()
    for name in expected:
        if name in _TOKEN_NAMES:
            shown.add(_TOKEN_NAMES[name])
            continue
        try:
            term = lark.get_terminal(name)
            if term.pattern.type == "str":
                shown.add(repr(term.pattern.value))
                continue
        except Exception:  # noqa: BLE001 - best effort only
            pass
        if not name.startswith("_") and not name.endswith("NUMBER"):
            shown.add(name)
    items = sorted(shown)
    if len(items) > 10:
        items = items[:10] + ["..."]
    return ", ".join(items)


def _previous_code_line(src: _Source, line: int) -> str:
    """The last non-blank line before `line`, without a trailing comment (roughly), right-stripped."""
    lines = src.text.split("\n")
    for i in range(min(line - 1, len(lines)) - 1, -1, -1):
        text = lines[i].split("#", 1)[0].rstrip()
        if text:
            return text
    return ""


def _convert_lark_error(e: UnexpectedInput, src: _Source) -> LMQSyntaxError:
    if isinstance(e, UnexpectedCharacters):
        ch = src.text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(src.text) else ""
        if ch in "\"'":
            msg = "unterminated string literal"
        else:
            msg = f"unexpected character {ch!r}"
        return src.error(msg, e.line, e.column)
    if isinstance(e, UnexpectedToken):
        tok = e.token
        kind = tok.type
        if kind == "$END":
            msg = "unexpected end of input"
            line, col = src.pos(len(src.text))
        else:
            prev_line = _previous_code_line(src, tok.line or 1)
            if kind != "_INDENT" and prev_line.endswith(":") and "_INDENT" not in (e.expected or ()):
                msg = "expected an indented block after ':'"
                return src.error(msg, tok.line or 1, tok.column or 1)
            if kind == "_INDENT":
                msg = "unexpected indent"
            elif kind == "_DEDENT":
                msg = "unexpected dedent"
            elif kind == "_NEWLINE":
                msg = "unexpected end of line"
            else:
                msg = f"unexpected {tok.value!r}"
            line, col = (tok.line or 1), (tok.column or 1)
            if line > len(src.line_starts):     # a dedent at the end of the input
                msg = "unexpected end of input"
                line, col = src.pos(len(src.text))
        expected = _describe_expected(set(e.expected or ()))
        if expected:
            msg += f"; expected one of: {expected}"
        return src.error(msg, line, col)
    line = getattr(e, "line", 0) or 0
    col = getattr(e, "column", 0) or 0
    return src.error(f"invalid syntax: {type(e).__name__}", line if line > 0 else 0, col if col > 0 else 0)


# ----- Python expressions ---------------------------------------------------------------------------

def _line_col(text: str, lineno: int, byte_col: int) -> tuple[int, int]:
    """ast (lineno 1-based, col_offset in UTF-8 bytes) -> (line 1-based, char column 0-based)."""
    lines = text.split("\n")
    if 1 <= lineno <= len(lines):
        b = lines[lineno - 1].encode("utf-8")[:max(byte_col, 0)]
        return lineno, len(b.decode("utf-8", "ignore"))
    return lineno, max(byte_col, 0)


class _PyText:
    """A Python expression's text with its position in the query source; parses it with `ast`."""

    def __init__(self, text: str, line: int, column: int, src: _Source, mode: str = "eval"):
        self.text, self.line, self.column, self.src, self.mode = text, line, column, src, mode
        self.wrapped = False
        self.parsed_text = text
        self.tree = self._parse()

    def _parse(self) -> ast.AST:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return ast.parse(self.text, "<lmq>", self.mode)
            except SyntaxError as first:
                if self.mode == "eval":
                    try:
                        wrapped = "(\n" + self.text + "\n)"
                        tree = ast.parse(wrapped, "<lmq>", "eval")
                        self.wrapped, self.parsed_text = True, wrapped
                        return tree
                    except (SyntaxError, ValueError):
                        pass
                raise self._syntax_error(first) from None
            except ValueError as e:  # null bytes
                raise self.src.error(f"invalid expression: {e}", self.line, self.column) from None

    def _syntax_error(self, e: SyntaxError) -> LMQSyntaxError:
        lineno = e.lineno or 1
        col = (e.offset or 1) - 1
        line, column = self.to_source(lineno, col, chars=True)
        return self.src.error(f"invalid Python expression: {e.msg}", line, column)

    def to_source(self, lineno: int, col: int, chars: bool = False) -> tuple[int, int]:
        """Position in the parsed text (ast lineno, col) -> (line, column) in the query, 1-based."""
        if not chars:
            lineno, col = _line_col(self.parsed_text, lineno, col)
        if self.wrapped:
            lineno -= 1
        lineno = max(lineno, 1)
        if lineno == 1:
            return self.line, self.column + col
        return self.line + lineno - 1, col + 1

    def node_pos(self, node: ast.AST) -> tuple[int, int]:
        return self.to_source(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))

    def segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.parsed_text, node) or ""

    def compile(self, tree: ast.AST | None = None) -> CodeType:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return compile(tree if tree is not None else self.tree, "<lmq>", self.mode)
            except (SyntaxError, ValueError, TypeError) as e:
                if isinstance(e, SyntaxError):
                    raise self._syntax_error(e) from None
                raise self.src.error(f"invalid Python expression: {e}", self.line, self.column) from None


def _targets(node: ast.AST) -> set[str]:
    """Names bound by an assignment target."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Tuple, ast.List)):
        out: set[str] = set()
        for e in node.elts:
            out |= _targets(e)
        return out
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return set()


def _reads(node: ast.AST, bound: frozenset[str], out: set[str]) -> None:
    """Free names loaded by `node`, minus names bound by comprehensions and lambdas inside it."""
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id not in bound:
            out.add(node.id)
        return
    if isinstance(node, ast.Lambda):
        a = node.args
        for d in list(a.defaults) + [d for d in a.kw_defaults if d is not None]:
            _reads(d, bound, out)
        names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
        _reads(node.body, bound | names, out)
        return
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        inner = set(bound)
        for k, gen in enumerate(node.generators):
            _reads(gen.iter, bound if k == 0 else frozenset(inner), out)
            inner |= _targets(gen.target)
            for cond in gen.ifs:
                _reads(cond, frozenset(inner), out)
        elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for e in elts:
            _reads(e, frozenset(inner), out)
        return
    for child in ast.iter_child_nodes(node):
        _reads(child, bound, out)


def free_names_of(tree: ast.AST) -> frozenset[str]:
    out: set[str] = set()
    _reads(tree, frozenset(), out)
    return frozenset(out)


def make_expr(text: str, line: int, column: int, src: _Source) -> PyExpr:
    """Compile a Python expression (its exact source text) into a PyExpr."""
    py = _PyText(text, line, column, src)
    return PyExpr(text, py.compile(), free_names_of(py.tree), Span(line, column))


def make_stmt(text: str, line: int, column: int, src: _Source, ignore: frozenset[str] = frozenset()) -> PyStmt:
    """Compile a Python simple statement into a PyStmt (`names` read, `assigned` names bound)."""
    py = _PyText(text, line, column, src, mode="exec")
    assigned: set[str] = set()
    reads = set(free_names_of(py.tree))
    for st in py.tree.body:
        if isinstance(st, ast.Assign):
            for t in st.targets:
                assigned |= _targets(t)
        elif isinstance(st, (ast.AugAssign, ast.AnnAssign)):
            assigned |= _targets(st.target)
            if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                reads.add(st.target.id)
    return PyStmt(text, py.compile(), frozenset(reads - ignore), frozenset(assigned), Span(line, column))


# ----- prompt strings and templates -----------------------------------------------------------------

_PREFIX = re.compile(r"[A-Za-z]*")
_ESCAPE = re.compile(r"\\(?:N\{[^}\n]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|\n|[\s\S])")
_HOLE = re.compile(r"\[([^\W\d]\w*)\]")


def _literal(text: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(text)


def decode_string_token(tok: Token, src: _Source, allow_f: bool = True) -> tuple[str, list[int]]:
    """Decode one string literal token as Python would. Returns the value and, for each character of
    the value (plus one past the end), its offset in the source (approximate around escapes)."""
    raw = tok.value
    prefix = _PREFIX.match(raw).group(0)
    lower = prefix.lower()
    if "b" in lower:
        raise src.error("a prompt string cannot be a bytes literal", tok.line, tok.column)
    if "f" in lower and not allow_f:
        raise src.error("an f-string is not allowed here", tok.line, tok.column)
    clean_prefix = "".join(c for c in prefix if c.lower() != "f")
    rest = raw[len(prefix):]
    try:
        value = _literal(clean_prefix + rest)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise src.error(f"invalid string literal: {getattr(e, 'msg', e)}", tok.line, tok.column) from None
    if not isinstance(value, str):
        raise src.error("expected a string literal", tok.line, tok.column)
    q = 3 if rest[:3] in ('"""', "'''") else 1
    body_start = tok.start_pos + len(prefix) + q
    body = rest[q:len(rest) - q]
    offsets: list[int] = []
    if "r" in lower:
        offsets = [body_start + i for i in range(len(body))]
    else:
        i = 0
        for m in _ESCAPE.finditer(body):
            offsets.extend(body_start + k for k in range(i, m.start()))
            try:
                piece = _literal('"""' + m.group(0) + ' """')[:-1]
            except (SyntaxError, ValueError):
                piece = m.group(0)
            offsets.extend([body_start + m.start()] * len(piece))
            i = m.end()
        offsets.extend(body_start + k for k in range(i, len(body)))
    if len(offsets) != len(value):
        offsets = [tok.start_pos] * len(value)
    offsets.append(tok.end_pos - q)
    return value, offsets


def _interp_end(s: str, start: int) -> int:
    """Index of the `}` closing an interpolation whose expression starts at `start`, or -1."""
    depth = 0
    i, n = start, len(s)
    while i < n:
        c = s[i]
        if c in "\"'":
            quote = s[i:i + 3] if s[i:i + 3] in ('"""', "'''") else c
            i += len(quote)
            while i < n and not s.startswith(quote, i):
                i += 2 if s[i] == "\\" else 1
            if i >= n:
                return -1
            i += len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]":
            depth = max(depth - 1, 0)
        elif c == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return -1


def parse_template(value: str, offsets: list[int], src: _Source) -> list[Piece]:
    """Split a decoded prompt string into Text / Hole / Interp pieces."""
    pieces: list[Piece] = []
    buf: list[str] = []

    def at(i: int) -> tuple[int, int]:
        return src.pos(offsets[min(i, len(offsets) - 1)])

    def flush() -> None:
        if buf:
            pieces.append(Text("".join(buf)))
            buf.clear()

    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if c == "[":
            if value.startswith("[[", i):
                buf.append("[")
                i += 2
                continue
            m = _HOLE.match(value, i)
            if m is None:
                raise src.error("'[' must start a hole [NAME] (write '[[' for a literal '[')", *at(i))
            flush()
            pieces.append(Hole(m.group(1), Span(*at(i))))
            i = m.end()
        elif c == "]":
            buf.append("]")
            i += 2 if value.startswith("]]", i) else 1
        elif c == "{":
            if value.startswith("{{", i):
                buf.append("{")
                i += 2
                continue
            j = _interp_end(value, i + 1)
            if j < 0:
                raise src.error("'{' was never closed in prompt string (write '{{' for a literal '{')", *at(i))
            inner = value[i + 1:j]
            stripped = inner.strip()
            if not stripped:
                raise src.error("empty expression in '{}' (write '{{' for a literal '{')", *at(i))
            k = i + 1 + (len(inner) - len(inner.lstrip()))
            flush()
            pieces.append(Interp(make_expr(stripped, *at(k), src)))
            i = j + 1
        elif c == "}":
            if value.startswith("}}", i):
                buf.append("}")
                i += 2
                continue
            raise src.error("single '}' is not allowed in a prompt string (write '}}')", *at(i))
        else:
            buf.append(c)
            i += 1
    flush()
    return pieces


def _merge_text(pieces: list[Piece]) -> tuple[Piece, ...]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, Text):
            if not p.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + p.text)
                continue
        out.append(p)
    return tuple(out)


# ----- constraints ----------------------------------------------------------------------------------

class _ConstraintBuilder:
    """Converts a where expression (parsed by Python's `ast`) into the Constraint classes."""

    def __init__(self, py: _PyText, holes: set[str]):
        self.py, self.holes, self.src = py, holes, py.src

    def expr(self, node: ast.AST) -> PyExpr:
        line, col = self.py.node_pos(node)
        return make_expr(self.py.segment(node), line, col, self.src)

    def unknown(self, node: ast.AST, what: str) -> LMQUnknownConstraintError:
        line, col = self.py.node_pos(node)
        seg = self.py.segment(node)
        if len(seg) > 80:
            seg = seg[:77] + "..."
        return LMQUnknownConstraintError(
            f"{what}: {seg!r} (line {line}, column {col}); supported constraint forms: {SUPPORTED_CONSTRAINTS}")

    def convert(self, node: ast.AST) -> Constraint:
        if isinstance(node, ast.Expression):
            node = node.body
        if isinstance(node, ast.BoolOp):
            cls = And if isinstance(node.op, ast.And) else Or
            parts: list[Constraint] = []
            for v in node.values:
                c = self.convert(v)
                if isinstance(c, cls):
                    parts.extend(c.parts)
                else:
                    parts.append(c)
            return cls(tuple(parts))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Not(self.convert(node.operand))
        span = Span(*self.py.node_pos(node))
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1:
                raise self.unknown(node, "chained comparison is not a supported constraint")
            op, left, right = node.ops[0], node.left, node.comparators[0]
            if isinstance(op, (ast.In, ast.NotIn)):
                c = self._in(node, left, right, span)
                return Not(c) if isinstance(op, ast.NotIn) else c
            if isinstance(op, (ast.Lt, ast.LtE)):
                ln = self._len(left)
                if ln is not None:
                    return LenLimit(ln[0], ln[1], "<" if isinstance(op, ast.Lt) else "<=", self.expr(right), span)
            if isinstance(op, (ast.Gt, ast.GtE)):
                ln = self._len(right)
                if ln is not None:
                    return LenLimit(ln[0], ln[1], "<" if isinstance(op, ast.Gt) else "<=", self.expr(left), span)
            raise self.unknown(node, "unsupported comparison in constraint")
        if isinstance(node, ast.Call):
            fname = node.func.id if isinstance(node.func, ast.Name) else None
            if fname not in CONSTRAINT_FUNCS:
                what = f"unknown constraint function {fname}" if fname else "unsupported call in constraint"
                raise self.unknown(node, what)
            nargs = CONSTRAINT_FUNCS[fname]
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise self.unknown(node, f"{fname} takes positional arguments only")
            if not node.args or not isinstance(node.args[0], ast.Name):
                raise self.unknown(node, f"the first argument of {fname} must be a hole name")
            if len(node.args) - 1 != nargs:
                shape = f"{fname}(VAR)" if nargs == 0 else f"{fname}(VAR, x)"
                raise self.unknown(node, f"{fname} takes exactly {nargs + 1} argument(s): {shape}")
            return Call(fname, node.args[0].id, tuple(self.expr(a) for a in node.args[1:]), span)
        raise self.unknown(node, "unsupported constraint")

    def _in(self, node: ast.AST, left: ast.AST, right: ast.AST, span: Span) -> Constraint:
        lname = left.id if isinstance(left, ast.Name) else None
        rname = right.id if isinstance(right, ast.Name) else None
        if lname is not None and (lname in self.holes or rname not in self.holes):
            return Choice(lname, self.expr(right), span)
        if rname is not None:
            return Contains(rname, self.expr(left), span)
        raise self.unknown(node, "an 'in' constraint needs a hole on one side")

    @staticmethod
    def _len(node: ast.AST) -> tuple[str, str] | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
                and len(node.args) == 1 and not node.keywords):
            return None
        arg = node.args[0]
        if isinstance(arg, ast.Name):
            return arg.id, "chars"
        if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "TOKENS"
                and len(arg.args) == 1 and not arg.keywords and isinstance(arg.args[0], ast.Name)):
            return arg.args[0].id, "tokens"
        return None


def _combine(parts: list[Constraint]) -> Constraint | None:
    flat: list[Constraint] = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, And) else [p])
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else And(tuple(flat))


# ----- the transformer ------------------------------------------------------------------------------

class _PendingWhere:
    """The expression of a where (inline or global), converted once all holes are known."""

    def __init__(self, py: _PyText):
        self.py = py


_DECODERS_AT_TOP = {"argmax", "sample", "beam"}


@v_args(meta=True)
class QueryTransformer(Transformer):
    """Mirrors the statement- and clause-level rules of lmq.lark one to one. Python expression
    subtrees are left untransformed (not even visited) and turned into PyExpr from their source text."""

    RULES = frozenset({
        "start", "decoder_block", "from_clause", "where_clause", "distribution_clause",
        "expr_stmt", "assign_stmt", "augassign_stmt", "annassign_stmt", "prompt_stmt", "return_stmt", "pass_stmt",
        "break_stmt", "continue_stmt", "if_stmt", "elif_clause", "else_clause", "for_stmt", "suite",
    })

    def __init__(self, src: _Source):
        super().__init__(visit_tokens=False)
        self.src = src
        self.holes: list[str] = []
        self.pending: dict[int, _PendingWhere] = {}   # id(Prompt) -> its inline where

    # lark hook: do not descend into Python expression subtrees
    def _transform_tree(self, tree: Tree) -> Any:
        if tree.data in self.RULES:
            return super()._transform_tree(tree)
        return tree

    # -- helpers --
    def _span_of(self, node: Tree | Token) -> tuple[int, int, int, int]:
        if isinstance(node, Token):
            return node.start_pos, node.end_pos, node.line, node.column
        m = node.meta
        if m.empty:
            raise self.src.error("empty expression", 0, 0)
        return m.start_pos, m.end_pos, m.line, m.column

    def _text(self, node: Tree | Token) -> tuple[str, int, int]:
        start, end, line, col = self._span_of(node)
        return self.src.text[start:end], line, col

    def _expr(self, node: Tree | Token) -> PyExpr:
        return make_expr(*self._text(node), self.src)

    def _stmt(self, meta: Any) -> PyStmt:
        return make_stmt(self.src.text[meta.start_pos:meta.end_pos], meta.line, meta.column, self.src)

    def _where(self, node: Tree | Token) -> _PendingWhere:
        text, line, col = self._text(node)
        return _PendingWhere(_PyText(text, line, col, self.src))

    def _prompt(self, strings: Tree, where: _PendingWhere | None) -> Prompt:
        pieces: list[Piece] = []
        for tok in strings.children:
            value, offsets = decode_string_token(tok, self.src)
            pieces.extend(parse_template(value, offsets, self.src))
        for p in pieces:
            if isinstance(p, Hole):
                self.holes.append(p.name)
        first = strings.children[0]
        prompt = Prompt(_merge_text(pieces), None, Span(first.line, first.column))
        if where is not None:
            self.pending[id(prompt)] = where
        return prompt

    @staticmethod
    def _is_strings(node: Any) -> bool:
        return isinstance(node, Tree) and node.data == "strings"

    # -- statements --
    def expr_stmt(self, meta, children):
        (node,) = children
        if self._is_strings(node):
            return self._prompt(node, None)
        return Exec(self._stmt(meta))

    def assign_stmt(self, meta, children):
        return Exec(self._stmt(meta))

    def augassign_stmt(self, meta, children):
        return Exec(self._stmt(meta))

    def annassign_stmt(self, meta, children):
        return Exec(self._stmt(meta))

    def prompt_stmt(self, meta, children):
        strings, test = children
        return self._prompt(strings, self._where(test))

    def return_stmt(self, meta, children):
        value = children[0] if children else None
        return Return(self._expr(value) if value is not None else None, Span(meta.line, meta.column))

    def pass_stmt(self, meta, children):
        return None

    def break_stmt(self, meta, children):
        return Break(Span(meta.line, meta.column))

    def continue_stmt(self, meta, children):
        return Continue(Span(meta.line, meta.column))

    def suite(self, meta, children):
        return tuple(c for c in children if c is not None)

    def elif_clause(self, meta, children):
        test, body = children
        return ("elif", self._expr(test), body)

    def else_clause(self, meta, children):
        return ("else", children[0])

    def if_stmt(self, meta, children):
        test, body, *rest = children
        branches = [(self._expr(test), body)]
        orelse: tuple = ()
        for r in rest:
            if r is None:
                continue
            if r[0] == "elif":
                branches.append((r[1], r[2]))
            else:
                orelse = r[1]
        return If(tuple(branches), orelse, Span(meta.line, meta.column))

    def for_stmt(self, meta, children):
        target, iterable, body = children
        ttext, tline, tcol = self._text(target)
        tstmt = make_stmt(f"{ttext} = __lmq_item__", tline, tcol, self.src, ignore=frozenset({"__lmq_item__"}))
        return For(tstmt, self._expr(iterable), body, Span(meta.line, meta.column))

    # -- decoder and clauses --
    def _decoder(self, head: Any, body_span: Span | None, meta: Any) -> Decoder:
        """A decoder from the head statement of a decoder block (an Exec of `NAME` or `NAME(k=v, ...)`)."""
        if not isinstance(head, Exec):
            line, col = (body_span.line, body_span.column) if body_span else (meta.line, meta.column)
            raise self.src.error("unexpected indent", line, col)
        st = head.stmt
        try:
            node = ast.parse(st.source, mode="eval").body
        except SyntaxError:
            node = None
        line, col = st.span.line, st.span.column
        if isinstance(node, ast.Name):
            return Decoder(node.id, {}, Span(line, col))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.args:
                raise self.src.error("decoder arguments must be keyword arguments, e.g. sample(n=2)", line, col)
            args: dict[str, Any] = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise self.src.error("decoder arguments must be keyword arguments, e.g. sample(n=2)", line, col)
                try:
                    args[kw.arg] = _literal(kw.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    raise self.src.error(f"decoder argument {kw.arg!r} must be a Python literal", line, col) from None
            return Decoder(node.func.id, args, Span(line, col))
        if body_span is None:
            raise self.src.error("invalid decoder", line, col)
        raise self.src.error("unexpected indent (a decoder line such as `argmax` or `sample(n=2)` "
                             "must come before an indented body)", body_span.line, body_span.column)

    def decoder_block(self, meta, children):
        head, *body = children
        body = [b for b in body if b is not None]
        first = next((getattr(b, "span", None) for b in body if getattr(b, "span", None)), None)
        if first is None and body and isinstance(body[0], Exec):
            first = body[0].stmt.span
        return ("decoder", self._decoder(head, first, meta), tuple(body))

    def from_clause(self, meta, children):
        (strings,) = children
        value = "".join(decode_string_token(t, self.src, allow_f=False)[0] for t in strings.children)
        return ("from", value)

    def where_clause(self, meta, children):
        return ("where", [self._where(c) for c in children])

    def distribution_clause(self, meta, children):
        (test,) = children
        py = _PyText(*self._text(test), self.src)
        node = py.tree.body
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                and isinstance(node.left, ast.Name)):
            line, col = py.node_pos(node)
            raise LMQCompileError(f"the distribution clause must have the form `VAR in <options>` "
                                  f"(line {line}, column {col})")
        b = _ConstraintBuilder(py, set())
        return ("distribution", Distribution(node.left.id, b.expr(node.comparators[0]), Span(*py.node_pos(node))))

    def start(self, meta, children):
        decoder: Decoder | None = None
        body: list[Stmt] = []
        model = None
        wheres: list[_PendingWhere] = []
        dist = None
        for c in children:
            if c is None:
                continue
            if isinstance(c, tuple) and c and isinstance(c[0], str):
                kind = c[0]
                if kind == "decoder":
                    if decoder is not None or body:
                        span = c[1].span
                        raise self.src.error("the decoder block must be the only top-level statement "
                                             "before from/where/distribution", span.line, span.column)
                    decoder = c[1]
                    body.extend(c[2])
                elif kind == "from":
                    model = c[1]
                elif kind == "where":
                    wheres = c[1]
                elif kind == "distribution":
                    dist = c[1]
                continue
            if decoder is not None:
                span = getattr(c, "span", None) or getattr(getattr(c, "stmt", None), "span", Span(0, 0))
                raise self.src.error("statement after the indented query body", span.line, span.column)
            body.append(c)
        # lenient: a first top-level statement `argmax` / `sample(...)` / `beam(...)` with an unindented body
        if decoder is None and body and isinstance(body[0], Exec):
            try:
                node = ast.parse(body[0].stmt.source, mode="eval").body
            except SyntaxError:
                node = None
            fname = node.id if isinstance(node, ast.Name) else (
                node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args else None)
            if fname in _DECODERS_AT_TOP:
                decoder = self._decoder(body[0], None, meta)
                body = body[1:]
        holes = set(self.holes)
        body_t = self._resolve(tuple(body), holes)
        where = _combine([_ConstraintBuilder(w.py, holes).convert(w.py.tree) for w in wheres])
        return QueryAST(decoder or Decoder("argmax", {}, Span(1, 1)), body_t, model, where, dist, self.src.text)

    def _resolve(self, body: tuple, holes: set[str]) -> tuple:
        """Convert the pending inline wheres now that every hole of the query is known."""
        out = []
        for s in body:
            if isinstance(s, Prompt) and id(s) in self.pending:
                w = self.pending[id(s)]
                s = replace(s, where=_ConstraintBuilder(w.py, holes).convert(w.py.tree))
            elif isinstance(s, If):
                s = replace(s, branches=tuple((t, self._resolve(b, holes)) for t, b in s.branches),
                            orelse=self._resolve(s.orelse, holes))
            elif isinstance(s, For):
                s = replace(s, body=self._resolve(s.body, holes))
            out.append(s)
        return tuple(out)


# ----- entry point ----------------------------------------------------------------------------------

def parse_query(source: str) -> QueryAST:
    """Parse lmq query text into a QueryAST. Raises only LMQError subclasses (LMQSyntaxError for
    anything that does not parse, LMQUnknownConstraintError for unsupported where forms,
    LMQCompileError for a malformed distribution clause)."""
    text = ""
    try:
        text = normalize_source(source)
        src = _Source(text)
        lark = _get_lark()
        with _parse_lock:
            _indenter.src = src
            tree = lark.parse(text + "\n")
        return QueryTransformer(src).transform(tree)
    except LMQError:
        raise
    except VisitError as e:
        if isinstance(e.orig_exc, LMQError):
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):
            raise LMQSyntaxError("query is nested too deeply", text) from None
        raise LMQSyntaxError(f"could not parse query: {type(e.orig_exc).__name__}: {e.orig_exc}", text) from None
    except UnexpectedInput as e:
        raise _convert_lark_error(e, _Source(text)) from None
    except RecursionError:
        raise LMQSyntaxError("query is nested too deeply", text) from None
    except Exception as e:  # noqa: BLE001 - the parser only ever raises LMQError
        raise LMQSyntaxError(f"could not parse query: {type(e).__name__}: {e}", text) from None
