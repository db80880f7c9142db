"""Prompt strings: string literals decoded as Python would (with each character's source offset), and
split into Text / Hole / Interp pieces."""
from __future__ import annotations

import ast
import re
import warnings
from typing import Any

from lark import Token

from ..errors import LMQSyntaxError
from .ast import Hole, Interp, Piece, Role, Span, Text
from .python_code import make_expr
from .source import _Source


_PREFIX = re.compile(r"[A-Za-z]*")
_ESCAPE = re.compile(r"\\(?:N\{[^}\n]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|\n|[\s\S])")
_HOLE = re.compile(r"\[([^\W\d]\w*)(\]|[ \t]*:)")
_HOLE_FORMAT = re.compile(r"\[([^\W\d]\w*)[ \t]*([!=])")  # `[X!r]`, `[X=]`: a replacement field's syntax
_ROLE = re.compile(r"\{:([^{}]*)\}")
ROLES = ("system", "user", "assistant")


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


def _expression_end(s: str, start: int, stops: str) -> int:
    """Index of the first character of `stops` outside brackets and string literals in the expression that starts
    at `start`, or -1. The `!` of `!=` and the `=` of `==`, `<=`, `>=`, `!=` are operators, never a stop."""
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
        if depth == 0:
            if c in "!=<>" and s.startswith("=", i + 1):
                i += 2
                continue
            if c in stops:
                return i
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    return -1


# Python's format spec mini-language: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?[0-9]*[_,]?(?:\.[0-9]+)?[bcdeEfFgGnosxX%]?", re.S)


def _field(value: str, start: int, at, src: _Source) -> tuple[list[Piece], int]:
    """The replacement field `{expr[=][!conversion][:spec]}` whose `{` is at `start`, as a Python f-string reads
    it: its pieces (an `expr=` field's source text, then the Interp) and the index after its `}`."""
    n = len(value)
    j = _expression_end(value, start + 1, "}!:=")
    if j < 0:
        raise src.error("'{' was never closed in prompt string (write '{{' for a literal '{')", *at(start))
    inner = value[start + 1:j]
    stripped = inner.strip()
    if not stripped:
        where = "in '{}'" if value[j] == "}" else f"before {value[j]!r}"
        raise src.error(f"empty expression {where} (write '{{{{' for a literal '{{')", *at(start))
    expr = make_expr(stripped, *at(start + 1 + len(inner) - len(inner.lstrip())), src)
    pieces: list[Piece] = []
    k = j
    if value[k] == "=":  # `{x=}`: the field's source, then its value (repr unless a spec or conversion says)
        k += 1
        while k < n and value[k].isspace():
            k += 1
        pieces.append(Text(value[start + 1:k]))
        if k < n and value[k] not in "}!:":
            raise src.error("expected '}', '!' or ':' after '=' in '{...}'", *at(k))
    conversion = None
    if k < n and value[k] == "!":
        conversion = value[k + 1:k + 2]
        if conversion not in ("r", "s", "a") or value[k + 2:k + 3] not in (":", "}"):
            raise src.error("a conversion is '!r', '!s' or '!a', right before ':' or '}'", *at(k))
        k += 2
    spec = None
    if k < n and value[k] == ":":
        spec, k = _format_spec(value, k + 1, at, src)
    if k >= n:
        raise src.error("'{' was never closed in prompt string (write '{{' for a literal '{')", *at(start))
    if pieces and conversion is None and spec is None:
        conversion = "r"
    pieces.append(Interp(expr, conversion, spec))
    return pieces, k + 1


def _format_spec(value: str, start: int, at, src: _Source) -> tuple[tuple[Piece, ...], int]:
    """The format spec that starts at `start`, up to the `}` closing its field: its text and nested fields
    (`{x:>{width}}`), and the index of that `}` (len(value) where there is none)."""
    pieces: list[Piece] = []
    i, n = start, len(value)
    while i < n and value[i] != "}":
        if value[i] == "{":
            field, i = _field(value, i, at, src)
            pieces.extend(field)
        else:
            j = i
            while j < n and value[j] not in "{}":
                j += 1
            pieces.append(Text(value[i:j]))
            i = j
    return tuple(pieces), i


def parse_template(value: str, offsets: list[int], src: _Source) -> list[Piece | Role]:
    """Split a decoded prompt string into Text / Hole / Interp pieces, and Role tags (`{:user}`: the caller
    checks where they stand)."""
    pieces: list[Piece | Role] = []
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
                if (field := _HOLE_FORMAT.match(value, i)) is not None:
                    raise src.error(f"a hole [{field.group(1)}] takes no conversion or format spec: the model writes "
                                    "its text (format a value in '{...}', as '{value!r}')", *at(field.start(2)))
                raise src.error("'[' must start a hole [NAME] or [NAME: type] (write '[[' for a literal '[')", *at(i))
            flush()
            if m.group(2) == "]":
                pieces.append(Hole(m.group(1), Span(*at(i))))
                i = m.end()
                continue
            j = _expression_end(value, m.end(), "]")
            if j < 0:
                raise src.error("'[' was never closed in prompt string (write '[[' for a literal '[')", *at(i))
            inner = value[m.end():j]
            if not inner.strip():
                raise src.error(f"hole [{m.group(1)}: ...] needs a type after ':'", *at(m.end()))
            k = m.end() + (len(inner) - len(inner.lstrip()))
            try:
                type_ = make_expr(inner.strip(), *at(k), src)
            except LMQSyntaxError:
                if _FORMAT_SPEC.fullmatch(inner):
                    raise src.error(f"a hole takes a type after ':', not a format spec: the model writes the text of "
                                    f"[{m.group(1)}] (format a value in '{{...}}', as '{{value:{inner}}}')",
                                    *at(m.end())) from None
                raise
            pieces.append(Hole(m.group(1), Span(*at(i)), type_))
            i = j + 1
        elif c == "]":
            buf.append("]")
            i += 2 if value.startswith("]]", i) else 1
        elif c == "{":
            if value.startswith("{{", i):
                buf.append("{")
                i += 2
                continue
            if value.startswith("{:", i):
                m = _ROLE.match(value, i)
                if m is None:
                    raise src.error("'{:' must start a role tag such as {:user}", *at(i))
                name = m.group(1).strip()
                if name not in ROLES:
                    raise src.error(f"unknown role {{:{name}}}: use {{:system}}, {{:user}} or {{:assistant}}", *at(i))
                flush()
                pieces.append(Role(name, Span(*at(i))))
                i = m.end()
                continue
            field, end = _field(value, i, at, src)
            flush()
            pieces.extend(field)
            i = end
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
