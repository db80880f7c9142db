"""The only reasons a test may skip, enforced: a pytest plugin (tests/conftest.py loads it).

A test skips only where the host cannot run it by design, and only through one of three markers:

- `gpu`: needs a CUDA GPU; skipped without one (`NO_CUDA`). `pytest -m gpu` runs these alone, in one process.
- `interpreter`: a Triton kernel run by Triton's interpreter on CPU tensors (tests/conftest.py sets
  TRITON_INTERPRET=1 before triton is imported, on a host without CUDA); skipped on a host with CUDA
  (`ON_CUDA`), where the `gpu` tests run the compiled kernels instead. On a host without CUDA the
  interpreter must be on: if it is not, these tests fail.
- `cpu_kernels`: lmq's C kernels. On Linux they must build (a failed build, or no C compiler, fails the
  test with the reason), except that a host without any C compiler skips them (`NO_COMPILER`) where
  LMQ_ALLOW_NO_COMPILER=1 says so explicitly. Off Linux they are skipped (`NOT_LINUX`): the kernels are
  Linux-only and the engine runs torch's ops there.

Every other skip fails its test: `pytest.skip` or a `skipif` mark in a test, an empty parameter set, a
module skipped at collection (`pytest.importorskip` of an extra: the README's install provides every extra
the suite imports). An impossible parameter combination is left out of the parametrisation instead.
An expected failure (`xfail`) is not a skip and is left as it is.
"""
from __future__ import annotations

import os
import platform

import pytest
import torch

NO_CUDA = "needs a CUDA GPU (none here)"
ON_CUDA = "Triton's interpreter runs on hosts without CUDA; here the gpu tests run the compiled kernels"
NOT_LINUX = "lmq's C kernels are Linux-only (the engine runs torch's ops here)"
NO_COMPILER = "no C compiler, and LMQ_ALLOW_NO_COMPILER=1"
MARKERS = {
    "gpu": "needs a CUDA GPU: skipped without one; `pytest -m gpu` runs these alone",
    "interpreter": "a Triton kernel under Triton's interpreter (CPU tensors): skipped on a host with CUDA",
    "cpu_kernels": "lmq's C kernels: a failed build fails; skipped off Linux, or without a C compiler where "
                   "LMQ_ALLOW_NO_COMPILER=1",
}

_ALLOWED = pytest.StashKey[str]()


def no_compiler_allowed() -> bool:
    """LMQ_ALLOW_NO_COMPILER=1 and this host has no C compiler: the `cpu_kernels` tests skip."""
    from lmq_kernels.cpu.toolchain import compiler

    return os.environ.get("LMQ_ALLOW_NO_COMPILER") == "1" and compiler() is None


def kernels_expected() -> bool:
    """Whether lmq's C kernels must be there: Linux, and a C compiler or no opt-out (see the module docstring).
    Tests that run either way check that the kernels ran where this is True."""
    return platform.system() == "Linux" and not no_compiler_allowed()


def host_skip(item: pytest.Item) -> str | None:
    """The allowed reason this host does not run `item`, or None."""
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        return NO_CUDA
    if item.get_closest_marker("interpreter") and torch.cuda.is_available():
        return ON_CUDA
    if item.get_closest_marker("cpu_kernels"):
        if platform.system() != "Linux":
            return NOT_LINUX
        if no_compiler_allowed():
            return NO_COMPILER
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():  # (pyproject.toml registers them too; a run outside the project needs them)
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = host_skip(item)
    if reason is not None:
        item.stash[_ALLOWED] = reason
        pytest.skip(reason)
    if item.get_closest_marker("cpu_kernels"):
        from lmq_kernels import cpu

        if cpu.build() is None:
            pytest.fail(f"lmq's C kernels do not build on this Linux host: {cpu.build_error()}\n(a host without a "
                        "C compiler may skip these tests with LMQ_ALLOW_NO_COMPILER=1)", pytrace=False)
    if item.get_closest_marker("interpreter"):
        from lmq_kernels.triton import interpreter_active

        if not interpreter_active():
            pytest.fail("Triton's interpreter is off on a host without CUDA (TRITON_INTERPRET="
                        f"{os.environ.get('TRITON_INTERPRET')!r}, or triton was imported before tests/conftest.py "
                        "set it)", pytrace=False)


def _reason(longrepr) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _where(longrepr) -> str:
    return f"{longrepr[0]}:{longrepr[1]}: " if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and item.stash.get(_ALLOWED, None) is None:
        report.outcome = "failed"
        report.longrepr = (f"{_where(report.longrepr)}a test skipped for a reason the suite does not allow "
                           f"(tests/support/skip_policy.py): {_reason(report.longrepr)}")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = (f"{_where(report.longrepr)}a module skipped at collection, which the suite does not "
                           f"allow (tests/support/skip_policy.py): {_reason(report.longrepr)}")
    return report
