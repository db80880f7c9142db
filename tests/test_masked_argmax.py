"""The greedy pick under K masks in one pass (`lmq_kernels.masked_argmax`) against the engine's own form
(`engine/picks.masked_argmax`, which `Greedy` picks with): the same index on every row and mask, ties to the
first index, 0 where a mask allows nothing.

CPU: the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported; where
another module imported triton first, a subprocess runs this file again). GPU: compiled."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: F401, E402
except Exception as exc:  # pragma: no cover
    pytest.skip(f"triton is not importable: {exc!r}", allow_module_level=True)

from lmq_backend.engine.picks import masked_argmax  # noqa: E402
from lmq_kernels import interpreter_active  # noqa: E402
from lmq_kernels.masked_argmax import BLOCK, masked_argmax_k  # noqa: E402

_INTERP = interpreter_active()
needs_interp = pytest.mark.skipif(not _INTERP, reason="triton imported before TRITON_INTERPRET=1; see the subprocess test")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or _INTERP, reason="needs a GPU and TRITON_INTERPRET=0")


def _case(B, V, K, seed, dtype=torch.float32, device="cpu"):
    """Logits with many exact ties (small integers), including a tie between two tiles; masks: everything,
    nothing, random, and one that allows only tokens past the first tile."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (B, V), generator=gen).to(dtype)
    logits[0, 3] = 9
    if V > BLOCK + 5:
        logits[0, BLOCK + 5] = 9  # the same maximum in two tiles: the first wins
    masks = torch.rand(K, V, generator=gen) < 0.5
    masks[0] = True
    if K > 1:
        masks[1] = False
    if K > 2:
        masks[2, :BLOCK] = False
    return logits.to(device), masks.to(device)


def _expected(logits, masks):
    return torch.stack([masked_argmax(logits.cpu(), m.cpu()) for m in masks])


CASES = [(1, 7, 1, 0), (3, BLOCK + 17, 3, 1), (5, 3 * BLOCK, 4, 2), (2, 2 * BLOCK + 1, 2, 3)]


@needs_interp
@pytest.mark.parametrize("case", CASES)
def test_matches_the_engines_pick(case):
    logits, masks = _case(*case)
    out = masked_argmax_k(logits, masks)
    assert torch.equal(out, _expected(logits, masks))
    assert out[0, 0] == 3 and (len(masks) < 2 or out[1].eq(0).all())


@needs_interp
def test_writes_into_a_strided_out():
    logits, masks = _case(3, BLOCK + 9, 2, 4)
    buf = torch.full((2, 8), -1, dtype=torch.int64)
    masked_argmax_k(logits, masks, out=buf[:, :3])
    assert torch.equal(buf[:, :3], _expected(logits, masks)) and buf[:, 3:].eq(-1).all()


def test_interpreter_in_subprocess():
    if _INTERP:
        pytest.skip("runs in-process")
    if torch.cuda.is_available():
        pytest.skip("triton's interpreter fails where CUDA is (triton 3.6); the cuda tests run instead")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not cuda",
                           os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(256, 128256, 2, 5)])
def test_cuda_matches_the_engines_pick(case, dtype):
    logits, masks = _case(*case, dtype=dtype, device="cuda")
    assert torch.equal(masked_argmax_k(logits, masks).cpu(), _expected(logits, masks))
