"""`where` expressions (inline and global), parsed by Python's `ast`, into `Constraint` trees."""
from __future__ import annotations

import ast

from ..errors import LMQUnknownConstraintError
from .ast import And, Call, Choice, Constraint, Contains, LenLimit, Not, Or, PyExpr, Span
from .python_code import _PyText, make_expr

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
