"""`lmq_kernels.cpu_layout.streamed_empty`: the memory of the operands a CPU decode step streams whole (the
weights' panels) asked of Linux as transparent huge pages, and plain `torch.empty` wherever it cannot be."""
from __future__ import annotations

import gc
import mmap
import platform
from pathlib import Path

import pytest
import torch

from lmq_kernels import cpu_layout
from lmq_kernels.cpu_layout import HUGE_PAGE, streamed_empty
from lmq_kernels.cpu_step import PANEL, panel_major

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The host's THP mode ("always", "madvise", "never"), None where it has none."""
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= address < hi:
                for field in lines[i + 1:]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_holds_what_is_written_and_outlives_its_base():
    t = streamed_empty((5, 576, PANEL))
    assert t.shape == (5, 576, PANEL) and t.dtype == torch.float32 and t.is_contiguous()
    values = torch.randn(t.shape)
    t.copy_(values)
    view = t[3]
    del t
    gc.collect()
    assert torch.equal(view, values[3])          # the mapping lives as long as a view of it
    view.add_(1)
    assert torch.equal(view, values[3] + 1)


def test_other_dtypes_and_a_small_tensor():
    q = streamed_empty((4096, 1024), torch.uint8)
    q.fill_(7)
    assert q.dtype == torch.uint8 and int(q.sum()) == 7 * 4096 * 1024
    small = streamed_empty((3, 5))
    assert small.shape == (3, 5) and small.untyped_storage().nbytes() == 60   # below a huge page: torch.empty


@pytest.mark.skipif(platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_a_large_tensor_starts_on_a_huge_page_and_gets_huge_pages_where_the_host_gives_them():
    t = streamed_empty((4 * HUGE_PAGE // 4,))
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.0)                                  # first touch: the kernel maps the range
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"this host's THP mode is {thp_mode()!r}: no huge pages to ask for")
    assert huge_kb_at(t.data_ptr()) >= 2 * HUGE_PAGE // 1024   # (all four where memory is not fragmented)


def test_a_failed_mapping_falls_back_to_torch(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no memory for the mapping")
    monkeypatch.setattr(cpu_layout.mmap, "mmap", refuse)
    t = streamed_empty((3 * HUGE_PAGE // 4,))
    assert t.shape == (3 * HUGE_PAGE // 4,)
    t.fill_(2.0)
    assert float(t[-1]) == 2.0


def test_panels_are_the_weights_permuted_in_streamed_memory():
    w_t = torch.randn(576, 16 * PANEL)           # 2.4 MB: past a huge page
    p = panel_major(w_t)
    assert p.data_ptr() % HUGE_PAGE == 0 or not hasattr(mmap, "MADV_HUGEPAGE")
    assert torch.equal(p, w_t.reshape(576, 16, PANEL).permute(1, 0, 2))
    assert panel_major(torch.randn(8, PANEL + 1)) is None
