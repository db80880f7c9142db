"""Prompt strings: string literals decoded as Python would (with each character's source offset), and
split into Text / Hole / Interp pieces."""
from __future__ import annotations

import ast
import re
import warnings
from typing import Any

from lark import Token

from .ast import Hole, Interp, Piece, Role, Span, Text
from .python_code import make_expr
from .source import _Source


_PREFIX = re.compile(r"[A-Za-z]*")
_ESCAPE = re.compile(r"\\(?:N\{[^}\n]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|\n|[\s\S])")
_HOLE = re.compile(r"\[([^\W\d]\w*)(\]|[ \t]*:)")
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


def _interp_end(s: str, start: int, close: str = "}") -> int:
    """Index of the `close` (`}`, or `]` for a hole's type) closing an expression that starts at `start`, or -1."""
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
        if c == close and depth == 0:
            return i
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    return -1


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
                raise src.error("'[' must start a hole [NAME] or [NAME: type] (write '[[' for a literal '[')", *at(i))
            flush()
            if m.group(2) == "]":
                pieces.append(Hole(m.group(1), Span(*at(i))))
                i = m.end()
                continue
            j = _interp_end(value, m.end(), "]")
            if j < 0:
                raise src.error("'[' was never closed in prompt string (write '[[' for a literal '[')", *at(i))
            inner = value[m.end():j]
            if not inner.strip():
                raise src.error(f"hole [{m.group(1)}: ...] needs a type after ':'", *at(m.end()))
            k = m.end() + (len(inner) - len(inner.lstrip()))
            pieces.append(Hole(m.group(1), Span(*at(i)), make_expr(inner.strip(), *at(k), src)))
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
