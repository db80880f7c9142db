"""The package's import graph, read from the source (ast; no module is imported): layers import downward only
(`LAYERS`: a module may import its own layer and those below it; an import under `if TYPE_CHECKING:` too),
no import circle (at run time: type-only imports aside), no private name of one module used in another
(imported, or read off an imported module), and every import of the package names a module it has."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lmq_backend": ROOT / "lmq_backend", "lmq_kernels": ROOT / "kernels", "lmq_grammar": ROOT / "grammar"}

# (module or package prefix, rank): the longest prefix of a module's name gives its rank
LAYERS = [
    ("lmq_kernels", 0),                # the kernels: tensors and page tables, nothing of queries or models
    ("lmq_grammar", 0),                # the grammar file, read by the language
    ("lmq_backend.errors", 0),         # the error types every layer raises
    ("lmq_backend.paths", 0),          # where lmq keeps its files
    ("lmq_backend.text", 1),           # token ids and their text: the vocabulary, token bytes, prefix encoding
    ("lmq_backend.cache", 2),          # the prefix cache and the K/V store: ids and slots, no model
    ("lmq_backend.engine", 3),         # the model's forwards over the cache: scheduler, runner, picks, fused steps
    ("lmq_backend.backend", 4),        # the backend protocol the runtime calls, and the HF backend on the engine
    ("lmq_backend.language", 5),       # query text to an AST and its static checks (no model, no backend)
    ("lmq_backend.runtime", 6),        # runs a query's AST over a backend: interpreter, constraints, decoders
    ("lmq_backend.lmql", 7),           # the integrations, on top: the LMQL plugin,
    ("lmq_backend.distributed", 7),    # Ray,
    ("lmq_backend.cli", 7),            # the command line,
    ("lmq_backend.profile", 7),        # profiling,
    ("lmq_backend", 7),                # and the package's own lazy names (`lmq_backend.query`, ...)
]

# What the package does not satisfy yet, in modules other areas own (each must still occur: remove an entry
# once its import is gone). Kinds: "circle" (modules in one import circle), "private" (module -> the private
# name it takes from another), "missing" (an import of a module the package does not have).
KNOWN = {
    ("private", "lmq_backend.distributed.serve -> lmq_backend.distributed.cluster._ray"),
    ("private", "lmq_backend.language.parser -> lmq_backend.language.source._Source"),
    ("private", "lmq_backend.language.python_code -> lmq_backend.language.source._Source"),
    ("private", "lmq_backend.language.templates -> lmq_backend.language.source._Source"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.python_code._PyText"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.source._Source"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.templates._literal"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.templates._merge_text"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.where._ConstraintBuilder"),
    ("private", "lmq_backend.language.transformer -> lmq_backend.language.where._combine"),
    ("private", "lmq_backend.language.where -> lmq_backend.language.python_code._PyText"),
    ("private", "lmq_backend.runtime.constraints.checks -> lmq_backend.runtime.constraints.llg._llg_validate"),
    ("private", "lmq_backend.runtime.constraints.checks -> lmq_backend.runtime.constraints.selection._conjuncts"),
    ("private", "lmq_backend.runtime.constraints.checks -> lmq_backend.runtime.constraints.selection._span"),
    *(("private", f"lmq_backend.runtime.constraints.compiler -> lmq_backend.runtime.constraints.{name}")
      for name in ("checks._check_limit_value", "checks._check_options_value", "checks._check_string_arg",
                   "checks._json_schema_text", "checks._max_len", "checks._mentions", "checks._static_test",
                   "checks._unsupported_nested", "llg._LLGNode", "masks._ChoiceNode", "masks._ContainsNode",
                   "masks._IntNode", "masks._LenNode", "masks._NotContainsNode", "masks._StartsWithNode",
                   "nodes._AndNode", "nodes._FreeNode", "nodes._Node", "nodes._NotNode", "nodes._OrNode",
                   "selection._conjuncts", "selection._span", "stops._StopString")),
    ("private", "lmq_backend.runtime.constraints.hole -> lmq_backend.runtime.constraints.nodes._Ctx"),
    ("private", "lmq_backend.runtime.constraints.hole -> lmq_backend.runtime.constraints.nodes._FreeNode"),
    ("private", "lmq_backend.runtime.constraints.hole -> lmq_backend.runtime.constraints.nodes._Node"),
    ("private", "lmq_backend.runtime.constraints.hole -> lmq_backend.runtime.constraints.stops._StopString"),
    ("private", "lmq_backend.runtime.constraints.llg -> lmq_backend.runtime.constraints.nodes._Node"),
    ("private", "lmq_backend.runtime.constraints.llg -> lmq_backend.runtime.constraints.nodes._State"),
    ("private", "lmq_backend.runtime.constraints.llg -> lmq_backend.runtime.constraints.selection._span"),
    ("private", "lmq_backend.runtime.constraints.masks -> lmq_backend.runtime.constraints.nodes._Ctx"),
    ("private", "lmq_backend.runtime.constraints.masks -> lmq_backend.runtime.constraints.nodes._Node"),
    ("private", "lmq_backend.runtime.constraints.masks -> lmq_backend.runtime.constraints.nodes._State"),
    ("private", "lmq_kernels.triton.decode_attention -> lmq_kernels.triton.decode_kernels._stage1_src"),
    ("private", "lmq_kernels.triton.decode_attention -> lmq_kernels.triton.decode_kernels._stage2_src"),
    ("circle", "lmq_backend.lmql.hook, lmq_backend.lmql.plugin, lmq_backend.lmql.process"),
    ("private", "lmq_backend.text.vocab_cache -> lmq_backend.text.vocab._ATTR"),
    ("private", "lmq_backend.text.vocab_cache -> lmq_backend.text.vocab._registry_lock"),
}


@dataclass(frozen=True)
class Import:
    source: str          # the importing module
    target: str          # the module (or package) imported from
    names: tuple[str, ...]
    type_only: bool      # under `if TYPE_CHECKING:` (no import at run time)
    line: int


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    found = {}
    for package, folder in PACKAGES.items():
        found[package] = folder  # (a namespace package, `lmq_grammar`: its folder, no __init__.py to read)
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[list[Import], list[tuple[str, str, int]]]:
    """The package imports of one module (`known`: every module), and its uses of a private attribute of a
    module it imported ((module imported, attribute, line))."""
    if path.is_dir():  # a namespace package: no code of its own
        return [], []
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    bound: dict[str, str] = {}  # local name -> the package module it is bound to

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.ImportFrom):
            target = _absolute(name, path, node)
            if target.split(".")[0] in PACKAGES:
                names = tuple(a.name for a in node.names)
                found.append(Import(name, target, names, type_only, node.lineno))
                for a in node.names:
                    if f"{target}.{a.name}" in known:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    found.append(Import(name, a.name, (), type_only, node.lineno))
                    if a.asname:
                        bound[a.asname] = a.name
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    private = [(bound[n.value.id], n.attr, n.lineno) for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
               and _private(n.attr)]
    return found, private


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def rank(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _resolve(target: str, names: tuple[str, ...], known: dict[str, Path]) -> list[str]:
    """The modules an import reaches: `from pkg import mod` reaches pkg.mod, `from mod import name` mod."""
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
    return subs if subs and len(subs) == len(names) else [target, *subs]


def findings() -> set[tuple[str, str]]:
    """("upward" | "circle" | "private" | "missing", what) for everything the package's imports break."""
    known = modules()
    edges, private_attrs = {}, {}
    for name, path in known.items():
        edges[name], private_attrs[name] = imports(name, path, known)
    out: set[tuple[str, str]] = set()
    runtime: dict[str, set[str]] = {m: set() for m in known}
    for source, found in edges.items():
        for imp in found:
            reached = _resolve(imp.target, imp.names, known)
            for target in reached:
                if target not in known:
                    out.add(("missing", f"{source} -> {target}"))
                    continue
                if rank(target) > rank(source):
                    out.add(("upward", f"{source} (rank {rank(source)}) -> {target} (rank {rank(target)}), "
                                       f"line {imp.line}"))
                if not imp.type_only and target != source:
                    runtime[source].add(target)
            if imp.target != source:
                for n in imp.names:
                    if _private(n) and f"{imp.target}.{n}" not in known:
                        out.add(("private", f"{source} -> {imp.target}.{n}"))
    for source, uses in private_attrs.items():
        for target, attr, _ in uses:
            if target != source:
                out.add(("private", f"{source} -> {target}.{attr}"))
    for circle in _circles(runtime):
        out.add(("circle", ", ".join(circle)))
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_every_module_has_a_layer():
    assert all(any(m == p or m.startswith(p + ".") for p, _ in LAYERS) for m in modules())


def test_imports_go_downward_without_circles_or_private_names():
    found = findings()
    new = sorted(f"{kind}: {what}" for kind, what in found - KNOWN)
    assert not new, "\n".join(new)


def test_the_known_exceptions_still_occur():
    """An entry of KNOWN whose import is gone goes from the list (so that the list only shrinks)."""
    gone = sorted(f"{kind}: {what}" for kind, what in KNOWN - findings())
    assert not gone, "fixed, remove from KNOWN:\n" + "\n".join(gone)
