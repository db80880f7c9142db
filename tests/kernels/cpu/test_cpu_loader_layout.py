"""The CPU kernels' Python side imports one way: the ops and the step import the loader (library.py) and the
modules below it, never the package back, and no module imports another's private names; the package
re-exports the public API."""
from __future__ import annotations

import ast
from pathlib import Path

import lmq_kernels.cpu as cpu

HERE = Path(cpu.__file__).parent


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each `from X import names` / `import X` in the file, X resolved inside lmq_kernels.cpu."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = "lmq_kernels.cpu" + ("." + module if module else "")
            out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


MODULES = {p.stem for p in HERE.glob("*.py")} - {"__init__"}


def test_no_module_imports_the_package_back_or_a_private_name():
    for path in sorted(HERE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for module, names in imports(path):
            back = (module == "lmq_kernels" and "cpu" in names) or \
                (module == "lmq_kernels.cpu" and not set(names) <= MODULES)   # `from . import sibling` only
            assert not back, f"{path.name} imports the package back"
            if module.startswith("lmq_kernels.cpu"):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path.name} imports {private} from {module}"


def test_the_modules_import_in_one_direction():
    """No import circle among the package's modules (each module's sibling imports, followed)."""
    graph = {p.stem: {m.rsplit(".", 1)[-1] if m != "lmq_kernels.cpu" else n
                      for m, names in imports(p) if m.startswith("lmq_kernels.cpu") for n in (names or [""])}
             for p in HERE.glob("*.py") if p.stem in MODULES}
    graph = {k: {v for v in vs if v in graph and v != k} for k, vs in graph.items()}
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        assert seen.get(node) != 1, f"import circle: {' -> '.join(path + [node])}"
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in graph[node]:
            visit(nxt, path + [node])
        seen[node] = 2

    for node in graph:
        visit(node, [])


def test_the_package_keeps_its_public_api():
    for name in cpu.__all__:
        assert hasattr(cpu, name), name
    assert callable(cpu.small_m_mm) and callable(cpu.choose) and callable(cpu.load)
