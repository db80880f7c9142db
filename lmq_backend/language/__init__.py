"""The lmq query language: grammar (grammar/lmq.lark), parser and compile-time checks.

- `parse_query(source) -> QueryAST`: syntax, prompt templates, constraint forms.
- `check_query(q, inputs=None, known_globals=frozenset())`: semantic checks (holes, decoder, ...).
- `holes_of(q)`, `free_names(q)`, `uses_roles(q)`: walks over the AST.
- `codegen.compile_program(q, name)`: the body compiled to a Python coroutine function that the runtime runs.
"""
from .checks import check_query, free_names, holes_of, uses_roles
from .parser import parse_query

__all__ = ["parse_query", "check_query", "holes_of", "free_names", "uses_roles"]
