"""The lmq parser's front end: query source text -> `QueryAST`.

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

Files: this one (steps 1-2 and the entry point: the indenter, lark, syntax errors), `source.py` (the
normalised text and its positions), `transformer.py` (step 3, mirroring `grammar/lmq.lark` rule by
rule), `python_code.py` (Python expressions and statements), `templates.py` (prompt strings),
`where.py` (step 4).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lark import PostLex

from ..errors import LMQError, LMQSyntaxError
from ..paths import cache_dir
from .ast import QueryAST
from .source import _Source, normalize_source
from .templates import parse_template
from .transformer import QueryTransformer
from .where import CONSTRAINT_FUNCS, SUPPORTED_CONSTRAINTS

__all__ = ["parse_query", "parse_template", "normalize_source", "QueryTransformer", "CONSTRAINT_FUNCS",
           "SUPPORTED_CONSTRAINTS", "grammar_text"]

MAX_PAREN_DEPTH = 200     # as CPython's tokenizer
MAX_INDENT_DEPTH = 100    # as CPython's tokenizer


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


def grammar_path() -> Path:
    """grammar/lmq.lark, installed as the namespace package `lmq_grammar` (searched entry by entry: an editable
    install adds a placeholder entry that importlib.resources cannot read)."""
    import lmq_grammar

    for entry in lmq_grammar.__path__:
        path = Path(entry) / "lmq.lark"
        if path.is_file():
            return path
    raise LMQError(f"the query grammar lmq.lark is missing from {list(lmq_grammar.__path__)}")


def grammar_text() -> str:
    return grammar_path().read_text(encoding="utf-8")


def _get_lark() -> Lark:
    """The parser. Its LALR tables come from `<cache_dir>/lark/lmq.lark-cache` after the first build (lark
    checks the file against a hash of the grammar, the options and lark's version, and rebuilds on any
    difference): building them is most of a first compile's time (~0.6 CPU s)."""
    global _lark
    if _lark is None:
        with _lark_lock:
            if _lark is None:
                _lark = Lark(grammar_text(), parser="lalr", lexer="contextual", postlex=_indenter,
                             propagate_positions=True, maybe_placeholders=True, start="start",
                             cache=_tables_file())
    return _lark


def _tables_file() -> str | bool:
    folder = cache_dir() / "lark"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # no cache directory: build the tables every time
        return False
    return str(folder / "lmq.lark-cache")


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
