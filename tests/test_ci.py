"""CI cannot go quiet: `.ci/run` runs the README's install and test commands (which print every skip's reason and
the slowest tests), a skip for any reason but those tests/support/skip_policy.py allows fails the run, a C
kernel build that fails fails the kernel tests, and the Triton interpreter's tests run in this process.

The policy's own checks run pytest in a subprocess (`-p support.skip_policy`) on small test files written here,
and on one of the kernel test files with a broken compiler (`CC=/bin/false`) or none on the PATH."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from support.skip_policy import NO_COMPILER, NO_CUDA

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def ci_section(name: str) -> list[str]:
    """The command lines of .ci/run under `# --- README: {name} ---`."""
    body = CI.split(f"# --- README: {name} ---\n")[1].split("# ---")[0]
    return [line for line in body.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readmes_install_and_test_commands():
    install = re.search(r"## Install and run\n\n```bash\n(.*?)\n", README).group(1)
    assert ci_section("install") == install.split(" && ")
    test = re.search(r"## Test\n\n```bash\n(.*?)\n```", README, flags=re.S).group(1).splitlines()
    assert ci_section("test") == test
    assert test == ["pytest -q -rs --durations=25"]  # skip reasons and the 25 slowest tests in CI's log


def test_no_test_skips_on_its_own():
    """Skips come from the policy's markers only: no `pytest.skip`, `skipif` or `importorskip` in a test file
    (one that never fires in CI would still hide a failure on another host)."""
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path.name in ("skip_policy.py", "test_ci.py"):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pytest\.skip\(|skipif|importorskip|mark\.skip\b", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def test_the_triton_interpreter_runs_in_this_process():
    """tests/conftest.py set TRITON_INTERPRET=1 before triton was imported (a host without CUDA): the
    `interpreter` tests run here, each reported on its own."""
    from lmq_kernels.triton import interpreter_active

    assert interpreter_active() == (not torch.cuda.is_available())


def run_pytest(args: list[str], tmp_path: Path, env: dict | None = None, unset: tuple[str, ...] = (),
               cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """pytest in a fresh process (this environment with `env` and without `unset`); returns it and
    {test name: (outcome, message)} from its JUnit XML."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.xml"
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}.items() if k not in unset}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            outcomes[case.get("name")] = ("passed", "") if kind is None else \
                (kind.tag, kind.get("message", "") if kind.tag == "skipped" else f"{kind.get('message')}\n{kind.text}")
    return proc, outcomes


POLICY_CASES = '''
import pytest
import torch


def test_plain():
    pass


def test_skips_itself():
    pytest.skip("an ordinary reason")


@pytest.mark.skipif(True, reason="a skipif mark")
def test_skipif():
    pass


@pytest.mark.parametrize("x", [])
def test_empty_parameter_set(x):
    pass


def test_an_extra_that_is_missing():
    pytest.importorskip("no_such_module_anywhere")


@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False


@pytest.mark.gpu
def test_on_a_gpu():
    assert torch.cuda.is_available()
'''


def test_a_skip_for_any_other_reason_fails_the_run(tmp_path):
    (tmp_path / "test_cases.py").write_text(POLICY_CASES)
    proc, got = run_pytest(["-p", "support.skip_policy", "--rootdir", str(tmp_path), "test_cases.py"], tmp_path,
                           cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert got["test_plain"] == ("passed", "")
    for name in ("test_skips_itself", "test_skipif", "test_empty_parameter_set[NOTSET]",
                 "test_an_extra_that_is_missing"):
        outcome, message = got[name]
        assert outcome in ("failure", "error") and "does not allow" in message, (name, got[name])
    assert got["test_expected_failure"][0] == "skipped"  # (an xfail, not a skip)
    assert got["test_on_a_gpu"] == (("passed", "") if torch.cuda.is_available() else ("skipped", NO_CUDA))


def test_a_module_skipped_at_collection_fails_the_run(tmp_path):
    (tmp_path / "test_module.py").write_text('import pytest\npytest.importorskip("no_such_module_anywhere")\n')
    proc, _ = run_pytest(["-p", "support.skip_policy", "--rootdir", str(tmp_path), "test_module.py"], tmp_path,
                         cwd=tmp_path)
    assert proc.returncode != 0 and "a module skipped at collection" in proc.stdout, proc.stdout[-3000:]


KERNEL_TESTS = "tests/kernels/cpu/test_cpu_prefill_attention.py"


@pytest.mark.cpu_kernels
def test_a_broken_compiler_fails_the_kernel_tests(tmp_path):
    """CC=/bin/false (a compiler that builds nothing): the kernel tests fail with the build's error, even where
    LMQ_ALLOW_NO_COMPILER=1 (a compiler is there, and it is broken)."""
    env = {"CC": "/bin/false", "TMPDIR": str(tmp_path), "LMQ_CACHE_DIR": str(tmp_path / "cache"),
           "LMQ_ALLOW_NO_COMPILER": "1"}
    proc, got = run_pytest(["-x", KERNEL_TESTS], tmp_path, env)
    assert proc.returncode == 1, proc.stdout[-3000:]
    [(outcome, message)] = got.values()  # -x: the first one fails, and stops the run
    assert outcome == "error" and "do not build" in message and "exited 1" in message, message


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("allowed", [False, True], ids=["no-opt-out", "LMQ_ALLOW_NO_COMPILER=1"])
def test_no_compiler_fails_unless_the_opt_out_says_so(tmp_path, allowed):
    """No C compiler on the PATH (and no CC): the kernel tests fail, or with LMQ_ALLOW_NO_COMPILER=1 skip."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "TMPDIR": str(tmp_path), "LMQ_CACHE_DIR": str(tmp_path / "cache"),
           "LMQ_ALLOW_NO_COMPILER": "1" if allowed else "0"}
    proc, got = run_pytest(["-x", KERNEL_TESTS], tmp_path, env, unset=("CC",))
    if allowed:
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert got and all(o == ("skipped", NO_COMPILER) for o in got.values()), got
    else:
        assert proc.returncode == 1, proc.stdout[-3000:]
        [(outcome, message)] = got.values()
        assert outcome == "error" and "no C compiler" in message, message
