"""Python expressions and statements inside a query: parsed and compiled with Python's own `ast` and
`compile`, positions mapped back to the query source, the free names they read."""
from __future__ import annotations

import ast
import re
import symtable
import warnings
from types import CodeType

from ..errors import LMQSyntaxError
from .ast import PyExpr, PyStmt, Span
from .source import _Source


_LINE_END = re.compile(r"(\r\n|\r|\n)")


class _Lines:
    """A parsed text's lines, split once, each encoded to UTF-8 when first asked for: ast's positions
    (1-based line, column in UTF-8 bytes) -> character columns and source segments, in time proportional
    to the answer. (`ast.get_source_segment` splits and encodes the whole text on every call: a `where`
    of n conjuncts was quadratic in n.)"""

    def __init__(self, text: str):
        parts = _LINE_END.split(text)    # where ast starts a new line: \r\n, \r or \n
        self.lines, self.ends = parts[0::2], parts[1::2] + [""]
        self._bytes: dict[int, bytes] = {}
        self._chars: dict[int, list[int]] = {}  # non-ASCII lines: byte offset -> characters before it

    def encoded(self, i: int) -> bytes:
        b = self._bytes.get(i)
        if b is None:
            b = self._bytes[i] = self.lines[i].encode("utf-8")
        return b

    def char_col(self, lineno: int, byte_col: int) -> tuple[int, int]:
        """(line 1-based, char column 0-based): the characters wholly inside the first byte_col bytes."""
        byte_col = max(byte_col, 0)
        if not 1 <= lineno <= len(self.lines):
            return lineno, byte_col
        b = self.encoded(lineno - 1)
        byte_col = min(byte_col, len(b))
        if len(b) == len(self.lines[lineno - 1]):
            return lineno, byte_col
        chars = self._chars.get(lineno - 1)
        if chars is None:
            chars, n = [0], 0
            for ch in self.lines[lineno - 1]:
                width = len(ch.encode("utf-8"))
                chars.extend([n] * (width - 1))
                n += 1
                chars.append(n)
            self._chars[lineno - 1] = chars
        return lineno, chars[byte_col]

    def segment(self, node: ast.AST) -> str:
        """The source text of `node`, as `ast.get_source_segment(text, node) or ""` gives it."""
        end_lineno, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
        if end_lineno is None or end_col is None:
            return ""
        first, last = node.lineno - 1, end_lineno - 1
        if first == last:
            return self.encoded(first)[node.col_offset:end_col].decode()
        middle = "".join(self.lines[i] + self.ends[i] for i in range(first + 1, last))
        return (self.encoded(first)[node.col_offset:].decode() + self.ends[first] + middle
                + self.encoded(last)[:end_col].decode())


class _PyText:
    """A Python expression's text with its position in the query source; parses it with `ast`."""

    def __init__(self, text: str, line: int, column: int, src: _Source, mode: str = "eval"):
        self.text, self.line, self.column, self.src, self.mode = text, line, column, src, mode
        self.wrapped = False
        self.parsed_text = text
        self.tree = self._parse()
        self.lines = _Lines(self.parsed_text)

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
            lineno, col = self.lines.char_col(lineno, col)
        if self.wrapped:
            lineno -= 1
        lineno = max(lineno, 1)
        if lineno == 1:
            return self.line, self.column + col
        return self.line + lineno - 1, col + 1

    def node_pos(self, node: ast.AST) -> tuple[int, int]:
        return self.to_source(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))

    def segment(self, node: ast.AST) -> str:
        return self.lines.segment(node)

    def compile(self, tree: ast.AST | None = None) -> CodeType:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return compile(tree if tree is not None else self.tree, "<lmq>", self.mode,
                               flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
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
    """Compile a Python statement (a simple one, a def or a class) into a PyStmt (`names` read, `assigned`
    names bound)."""
    py = _PyText(text, line, column, src, mode="exec")
    assigned: set[str] = set()
    scoped = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in ast.walk(py.tree))
    reads = set(_scoped_reads(py.parsed_text) if scoped else free_names_of(py.tree))
    for st in py.tree.body:
        if isinstance(st, ast.Assign):
            for t in st.targets:
                assigned |= _targets(t)
        elif isinstance(st, (ast.AugAssign, ast.AnnAssign)):
            assigned |= _targets(st.target)
            if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                reads.add(st.target.id)
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(st.name)
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            assigned |= {a.asname or a.name.split(".")[0] for a in st.names if a.name != "*"}
    return PyStmt(text, py.compile(), frozenset(reads - ignore), frozenset(assigned), Span(line, column))


def _scoped_reads(text: str) -> set[str]:
    """The names a statement with functions or classes inside reads from the scope it runs in: at its own
    level, those it loads; inside, those its functions and classes leave to the globals (Python's symbol
    tables say which)."""
    out: set[str] = set()

    def walk(table: symtable.SymbolTable, top: bool) -> None:
        for sym in table.get_symbols():
            if sym.is_referenced() and (top or sym.is_global()):
                out.add(sym.get_name())
        for child in table.get_children():
            walk(child, False)

    walk(symtable.symtable(text, "<lmq>", "exec"), True)
    return out
