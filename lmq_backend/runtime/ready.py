"""A process made ready for queries when it loads a model, so that its first query's call does only that call's
work (`lmq_backend.get_backend`).

    get_backend("default") -> Backend     the registry's backend (loaded on first use), and `prepare()`
    prepare()                             once a process: the query front end's one-time set-up, now

The front end's one-time costs are its modules' imports, the parser (its LALR tables read from their cache
file) and the lexer's scanners (lark builds them at the first parse), and the first run of the compile path
(parse, checks, code generation of a query's body and of its constraints). A process that loads a model is
about to run queries on it; these costs belong with the load, not inside its first call (a new process's
warm start from the disk tier prefills only a few tokens: they would be most of its time to first token).
`lmq run` compiles its query before it loads the model, so it pays them where it did.
"""
from __future__ import annotations

import threading

from ..backend.protocol import Backend
from ..backend.registry import get_backend as registry_backend

# a query with what most queries have: an input in a prompt, holes under `in`, `len(TOKENS())` and stop
# constraints, a decoder clause and a `from` (compiled only, never run: no model is called)
PREPARE_SOURCE = '''argmax
    "Shared instructions. {x}\\nAnswer:[A]"
    "Why:[WHY]" where len(TOKENS(WHY)) < 8 and STOPS_AT(WHY, ".")
    if A == " yes":
        "!"
from "default"
where A in [" yes", " no"]
'''

_lock = threading.Lock()
_prepared = False


def prepare() -> None:
    """The query front end's one-time set-up in this process (imports, the parser and its lexer, the compile
    path), now; once a process (later calls return at once)."""
    global _prepared
    if _prepared:
        return
    with _lock:
        if _prepared:
            return
        from .query import Query

        Query(PREPARE_SOURCE, name="prepare", inputs=["x"])
        _prepared = True


def get_backend(name: str = "default") -> Backend:
    """The backend behind a name (`backend.registry.get_backend`: "default", "hf:<dir>" or a registered name),
    in a process made ready for queries (`prepare`)."""
    backend = registry_backend(name)
    prepare()
    return backend
