"""The kernels' folder is `kernels/` at the repository's root, installed as `lmq_kernels`: it has no __init__.py
of its own, so a process started at the root still imports PyPI's `kernels` package (which transformers
imports) and never the folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_folder_is_not_a_package():
    assert (ROOT / "kernels" / "cpu").is_dir() and (ROOT / "kernels" / "triton").is_dir()
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "grammar" / "__init__.py").exists()


def test_import_kernels_at_the_root_gets_the_installed_package(tmp_path):
    """With the root first on sys.path (as `python -c` from the root) and a regular package `kernels` installed
    later on the path (PyPI's, or a stand-in here), `import kernels` gets the installed package, and lmq's
    kernels import as `lmq_kernels`."""
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("WHO = 'installed'\n")
    code = "import kernels, lmq_kernels.cpu, lmq_kernels.triton; print(kernels.WHO); print(lmq_kernels.cpu.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    who, ours = done.stdout.split()
    assert who == "installed"
    assert Path(ours).name == "__init__.py" and Path(ours).parent.name == "cpu"


def test_the_grammar_ships_with_the_package():
    from lmq_backend.language.parser import grammar_path, grammar_text

    assert grammar_path().parent.name == "grammar" or grammar_path().parent.name == "lmq_grammar"
    assert "start:" in grammar_text()
