"""The query AST: what `grammar/lmq.lark` parses into, one class per grammar rule that matters.

The language knows nothing of torch or backends. Python expressions inside a query are kept as their
source text plus a code object compiled once at compile time (`PyExpr`); the runtime evaluates them with
`eval(expr.code, env)` where `env` is one dict holding the caller's globals, the inputs and the
variables assigned so far.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Iterable, Iterator, Union


@dataclass(frozen=True, slots=True)
class Span:
    """1-based position of a construct in the query source."""

    line: int
    column: int


@dataclass(frozen=True, slots=True)
class PyExpr:
    """A Python expression: `source` compiled in "eval" mode; `names` are the free names it reads."""

    source: str
    code: CodeType
    names: frozenset[str]
    span: Span


@dataclass(frozen=True, slots=True)
class PyStmt:
    """A Python simple statement (assignment, augmented assignment, expression, pass/break/continue
    excluded): `source` compiled in "exec" mode; `names` read, `assigned` names it binds."""

    source: str
    code: CodeType
    names: frozenset[str]
    assigned: frozenset[str]
    span: Span


# ----- prompt templates -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Text:
    """Literal prompt text (escapes `[[ ]] {{ }}` and Python string escapes already resolved)."""

    text: str


@dataclass(frozen=True, slots=True)
class Hole:
    """`[NAME]`: a variable the model fills; `[NAME: type]`: its value is of that type (`int`, `float`, `bool`,
    `str`, a regex string, a dataclass, a pydantic model, ...) or the return value of a nested query."""

    name: str
    span: Span
    type: PyExpr | None = None


@dataclass(frozen=True, slots=True)
class Interp:
    """`{expr}`: a Python expression whose `str()` is inserted as literal text. `{expr!conversion:spec}` is
    formatted as a Python f-string formats it: `conversion` "r", "s" or "a" (repr, str, ascii) or None, `spec`
    the format spec's pieces (Text, and an Interp for each nested field such as `{width}`) or None without `:`.
    (A field `{expr=}` is a Text of its source before this Interp.)"""

    expr: PyExpr
    conversion: str | None = None
    spec: tuple[Text | Interp, ...] | None = None

    @property
    def formatted(self) -> bool:
        """Whether the value goes through `format()` (a conversion or a spec) rather than `str()`."""
        return self.conversion is not None or self.spec is not None


def interps(pieces: Iterable[Piece]) -> Iterator[Interp]:
    """Every Interp among `pieces`, and the nested ones of their format specs, in source order."""
    for p in pieces:
        if isinstance(p, Interp):
            yield p
            if p.spec:
                yield from interps(p.spec)


@dataclass(frozen=True, slots=True)
class Role:
    """`{:system}`, `{:user}`, `{:assistant}` at the start of a prompt string: it opens that role's message.
    (The parser moves it to `Prompt.role`; it is never among a Prompt's pieces.)"""

    name: str
    span: Span


Piece = Union[Text, Hole, Interp]


# ----- constraints ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class And:
    parts: tuple["Constraint", ...]


@dataclass(frozen=True, slots=True)
class Or:
    parts: tuple["Constraint", ...]


@dataclass(frozen=True, slots=True)
class Not:
    part: "Constraint"


@dataclass(frozen=True, slots=True)
class Call:
    """A constraint function applied to a hole: STOPS_AT, STOPS_BEFORE, INT, REGEX, STARTS_WITH, JSON,
    GRAMMAR. `args` are the arguments after the hole, evaluated at run time."""

    func: str
    var: str
    args: tuple[PyExpr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Choice:
    """`VAR in <iterable of str>`: the value is exactly one of the options."""

    var: str
    options: PyExpr
    span: Span


@dataclass(frozen=True, slots=True)
class Contains:
    """`<str> in VAR`: the value contains the string (usually negated: `not "\\n" in VAR`)."""

    var: str
    needle: PyExpr
    span: Span


@dataclass(frozen=True, slots=True)
class LenLimit:
    """`len(VAR) < n` (unit "chars") or `len(TOKENS(VAR)) < n` (unit "tokens"); op is "<" or "<="."""

    var: str
    unit: str
    op: str
    limit: PyExpr
    span: Span


Constraint = Union[And, Or, Not, Call, Choice, Contains, LenLimit]


# ----- statements -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt string statement, with the constraints of its inline `where` (or None); `role`: the message
    its role tag opens (None: the text continues the message open before it, or a plain prompt);
    `distribution`: its inline `distribution VAR in [..]` (VAR a hole of this string)."""

    pieces: tuple[Piece, ...]
    where: Constraint | None
    span: Span
    role: str | None = None
    distribution: "Distribution | None" = None


@dataclass(frozen=True, slots=True)
class Exec:
    """A Python statement run for its effect: a simple statement (assignment, call, import, raise, ...), or a
    `def` / `class` (its body is plain Python)."""

    stmt: PyStmt


@dataclass(frozen=True, slots=True)
class If:
    """if/elif/else: the first branch whose test is true runs; `orelse` otherwise."""

    branches: tuple[tuple[PyExpr, tuple["Stmt", ...]], ...]
    orelse: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class For:
    """`[async] for TARGET in ITER: ... [else: ...]`. `target` is a PyStmt compiled from `TARGET = __lmq_item__`
    (its names; the code generator takes the target's own text)."""

    target: PyStmt
    iter: PyExpr
    body: tuple["Stmt", ...]
    span: Span
    orelse: tuple["Stmt", ...] = ()
    is_async: bool = False


@dataclass(frozen=True, slots=True)
class While:
    """`while TEST: ... [else: ...]`."""

    test: PyExpr
    body: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Handler:
    """`except [TYPE [as NAME]]: ...`."""

    type: PyExpr | None
    name: str | None
    body: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Try:
    """`try: ... except ...: ... [else: ...] [finally: ...]`."""

    body: tuple["Stmt", ...]
    handlers: tuple[Handler, ...]
    orelse: tuple["Stmt", ...]
    finalbody: tuple["Stmt", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class WithItem:
    """`CONTEXT [as TARGET]` of a with statement; `target` as For's."""

    context: PyExpr
    target: PyStmt | None


@dataclass(frozen=True, slots=True)
class With:
    """`[async] with ITEM, ...: ...`."""

    items: tuple[WithItem, ...]
    body: tuple["Stmt", ...]
    span: Span
    is_async: bool = False


@dataclass(frozen=True, slots=True)
class Return:
    value: PyExpr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Break:
    span: Span


@dataclass(frozen=True, slots=True)
class Continue:
    span: Span


Stmt = Union[Prompt, Exec, If, For, While, Try, With, Return, Break, Continue]


# ----- the query ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Decoder:
    """`argmax`, `sample(n=4, temperature=0.8)`, `beam(n=3)`: arguments are Python literals."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    span: Span = Span(1, 1)


@dataclass(frozen=True, slots=True)
class Distribution:
    """`distribution VAR in [..]`: after the body, score each option for VAR instead of generating."""

    var: str
    options: PyExpr
    span: Span


@dataclass(frozen=True, slots=True)
class QueryAST:
    """A parsed query; `chat`: a prompt string of it opens a chat message (a role tag)."""

    decoder: Decoder
    body: tuple[Stmt, ...]
    model: str | None
    where: Constraint | None
    distribution: Distribution | None
    source: str
    chat: bool = False
