"""What a Triton kernel's test file imports first: the kernels run under Triton's interpreter on the CPU and
compiled on a GPU.

Importing this module sets ``TRITON_INTERPRET=1`` (unless set, or a GPU is there: there the compiled kernels
are what is tested, whichever test file is collected first) before triton is imported, and skips the test
file where triton is missing. Where another module imported triton first (a whole-suite run), the interpreter
is off in this process: `needs_interp` tests skip and `rerun_interpreted(path)` runs the file again in a
fresh interpreter. `needs_cuda` tests compile the kernels (a GPU, ``TRITON_INTERPRET=0``)."""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401, E402
except Exception as exc:  # pragma: no cover
    pytest.skip(f"triton is not importable: {exc!r}", allow_module_level=True)

from lmq_kernels.triton import interpreter_active  # noqa: E402

INTERP = interpreter_active()
needs_interp = pytest.mark.skipif(not INTERP, reason="triton imported before TRITON_INTERPRET=1; see the subprocess test")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERP, reason="needs a GPU and TRITON_INTERPRET=0")


def rerun_interpreted(path: str) -> None:
    """Run the test file at `path` again with the interpreter on (its GPU tests left out)."""
    if INTERP:
        pytest.skip("the interpreter's tests ran in this process")
    if torch.cuda.is_available():
        pytest.skip("the compiled kernels are tested on this machine (and triton 3.6's interpreter fails on GPU "
                    "hosts: 'only 0-dimensional arrays can be converted')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not cuda",
                           os.path.abspath(path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
