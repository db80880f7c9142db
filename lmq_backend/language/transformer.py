"""`QueryTransformer`: lark's statement-level parse tree -> `QueryAST`, one method per rule of
`grammar/lmq.lark`."""
from __future__ import annotations

import ast
import textwrap
from dataclasses import replace
from typing import Any

from lark import Token, Transformer, Tree, v_args

from ..errors import LMQCompileError
from .ast import (
    Break, Continue, Decoder, Distribution, Exec, For, Handler, Hole, If, Piece, Prompt, PyExpr, PyStmt, QueryAST,
    Return, Role, Span, Stmt, Text, Try, While, With, WithItem,
)
from .checks import uses_roles
from .python_code import _PyText, make_expr, make_stmt
from .source import _Source
from .templates import _literal, _merge_text, decode_string_token, parse_template
from .where import _combine, _ConstraintBuilder


class _PendingWhere:
    """The expression of a where (inline or global), converted once all holes are known."""

    def __init__(self, py: _PyText):
        self.py = py


_DECODERS_AT_TOP = {"argmax", "sample", "beam", "beam_sample", "beam_var", "var", "best_k"}


@v_args(meta=True)
class QueryTransformer(Transformer):
    """Mirrors the statement- and clause-level rules of lmq.lark one to one. Python expression
    subtrees are left untransformed (not even visited) and turned into PyExpr from their source text."""

    RULES = frozenset({
        "start", "decoder_block", "from_clause", "where_clause", "distribution_clause",
        "expr_stmt", "assign_stmt", "augassign_stmt", "annassign_stmt", "prompt_stmt", "distribution_stmt",
        "return_stmt", "pass_stmt", "break_stmt", "continue_stmt", "import_stmt", "raise_stmt", "assert_stmt",
        "del_stmt", "global_stmt", "nonlocal_stmt", "if_stmt", "elif_clause", "else_clause", "for_stmt",
        "while_stmt", "try_stmt", "except_clause", "finally_clause", "with_stmt", "def_stmt", "class_stmt",
        "decorated_stmt", "suite", "yield_stmt",
    })
    # plain Python as a whole: their bodies are not query statements (a docstring is no prompt)
    OPAQUE = frozenset({"def_stmt", "class_stmt", "decorated_stmt"})

    def __init__(self, src: _Source):
        super().__init__(visit_tokens=False)
        self.src = src
        self.holes: list[str] = []
        self.pending: dict[int, _PendingWhere] = {}   # id(Prompt) -> its inline where

    # lark hook: do not descend into Python expression subtrees
    def _transform_tree(self, tree: Tree) -> Any:
        if tree.data in self.OPAQUE:
            return self._call_userfunc(tree, list(tree.children))
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
        pieces: list[Piece | Role] = []
        for tok in strings.children:
            value, offsets = decode_string_token(tok, self.src)
            pieces.extend(parse_template(value, offsets, self.src))
        role = None
        if pieces and isinstance(pieces[0], Role):
            role = pieces.pop(0).name
            if pieces and isinstance(pieces[0], Text):  # the message starts at its first non-blank character
                pieces[0] = Text(pieces[0].text.lstrip())
        for p in pieces:
            if isinstance(p, Hole):
                self.holes.append(p.name)
            elif isinstance(p, Role):
                raise self.src.error(f"a role tag {{:{p.name}}} must start its prompt string (a message ends where "
                                     f"the next role tag begins)", p.span.line, p.span.column)
        first = strings.children[0]
        prompt = Prompt(_merge_text(pieces), None, Span(first.line, first.column), role)
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

    def distribution_stmt(self, meta, children):
        strings, test = children
        return replace(self._prompt(strings, None), distribution=self._distribution(test))

    def _exec(self, meta, children):
        return Exec(self._stmt(meta))

    import_stmt = raise_stmt = assert_stmt = del_stmt = global_stmt = nonlocal_stmt = yield_stmt = _exec

    def _block_stmt(self, meta, children):
        """A def or a class (decorated or not): one Python statement, its text re-indented as written."""
        start, end = meta.start_pos, meta.end_pos
        indent = self.src.text[self.src.offset(meta.line, 1):start]
        text = textwrap.dedent(indent + self.src.text[start:end])
        return Exec(make_stmt(text, meta.line, meta.column, self.src))

    def_stmt = class_stmt = decorated_stmt = _block_stmt

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

    def _target(self, node: Tree | Token) -> PyStmt:
        """An assignment target (of a for, a with) as the statement `TARGET = __lmq_item__`."""
        ttext, tline, tcol = self._text(node)
        return make_stmt(f"{ttext} = __lmq_item__", tline, tcol, self.src, ignore=frozenset({"__lmq_item__"}))

    def for_stmt(self, meta, children):
        is_async, target, iterable, body, *rest = children
        orelse = rest[0][1] if rest and rest[0] is not None else ()
        return For(self._target(target), self._expr(iterable), body, Span(meta.line, meta.column), orelse,
                   is_async is not None)

    def while_stmt(self, meta, children):
        test, body, *rest = children
        orelse = rest[0][1] if rest and rest[0] is not None else ()
        return While(self._expr(test), body, orelse, Span(meta.line, meta.column))

    def except_clause(self, meta, children):
        kind, name, body = children
        return Handler(self._expr(kind) if kind is not None else None, str(name) if name is not None else None,
                       body, Span(meta.line, meta.column))

    def finally_clause(self, meta, children):
        return ("finally", children[0])

    def try_stmt(self, meta, children):
        body, *rest = children
        handlers = tuple(r for r in rest if isinstance(r, Handler))
        orelse = next((r[1] for r in rest if isinstance(r, tuple) and r[0] == "else"), ())
        finalbody = next((r[1] for r in rest if isinstance(r, tuple) and r[0] == "finally"), ())
        return Try(body, handlers, orelse, finalbody, Span(meta.line, meta.column))

    def with_stmt(self, meta, children):
        is_async, *items, body = children
        out = []
        for item in items:
            context, target = item.children
            out.append(WithItem(self._expr(context), self._target(target) if target is not None else None))
        return With(tuple(out), body, Span(meta.line, meta.column), is_async is not None)

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
        return ("distribution", self._distribution(test))

    def _distribution(self, test: Tree | Token) -> Distribution:
        """`VAR in <options>` of a distribution clause (global or inline)."""
        py = _PyText(*self._text(test), self.src)
        node = py.tree.body
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                and isinstance(node.left, ast.Name)):
            line, col = py.node_pos(node)
            raise LMQCompileError(f"the distribution clause must have the form `VAR in <options>` "
                                  f"(line {line}, column {col})")
        b = _ConstraintBuilder(py, set())
        return Distribution(node.left.id, b.expr(node.comparators[0]), Span(*py.node_pos(node)))

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
        query = QueryAST(decoder or Decoder("argmax", {}, Span(1, 1)), body_t, model, where, dist, self.src.text)
        return replace(query, chat=uses_roles(query))

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
            elif isinstance(s, (For, While)):
                s = replace(s, body=self._resolve(s.body, holes), orelse=self._resolve(s.orelse, holes))
            elif isinstance(s, Try):
                s = replace(s, body=self._resolve(s.body, holes), orelse=self._resolve(s.orelse, holes),
                            finalbody=self._resolve(s.finalbody, holes),
                            handlers=tuple(replace(h, body=self._resolve(h.body, holes)) for h in s.handlers))
            elif isinstance(s, With):
                s = replace(s, body=self._resolve(s.body, holes))
            out.append(s)
        return tuple(out)
