"""The CPU small-M GEMM (`lmq_kernels.cpu_gemm`): built with the machine's C compiler, checked against a
float64 reference, and row-independent bit for bit (a row's result does not depend on the batch around it)."""
from __future__ import annotations

import pytest
import torch

from lmq_kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler / not Linux: the kernel is not built")

ANY_ROWS = (1, 64)


def k_major(n: int, k: int, seed: int) -> torch.Tensor:
    """A [N, K] weight stored K-major, as lmq's CPU path stores the model's Linear weights."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).t().contiguous().t()


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (2, 576, 960), (5, 100, 70), (8, 1536, 576), (8, 7, 33),
                                   (11, 96, 128), (17, 40, 1000)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matches_float64_reference(m, k, n, accumulate):
    w = k_major(n, k, seed=m + k + n)
    x = torch.randn(m, k)
    out = torch.randn(m, n)
    expected = (out.double() if accumulate else 0) + x.double() @ w.double().t()
    assert cpu_gemm.small_m_mm(x, w.t(), out, accumulate=accumulate, rows=ANY_ROWS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_bias_starts_the_sums():
    w = k_major(70, 48, seed=4)
    x, bias = torch.randn(3, 48), torch.randn(70)
    out = torch.full((3, 70), float("nan"))
    assert cpu_gemm.small_m_mm(x, w.t(), out, bias=bias)
    torch.testing.assert_close(out, bias + x @ w.t(), rtol=1e-5, atol=1e-4)
    untouched = torch.zeros(1, 70)
    assert not cpu_gemm.small_m_mm(x[:1], w.t(), untouched, bias=bias)   # declined: out left as it was
    assert untouched.eq(0).all()


def test_strided_rows_of_x_and_out():
    w = k_major(96, 64, seed=1)
    big_x, big_out = torch.randn(4, 100), torch.zeros(4, 120)
    x, out = big_x[:, 10:74], big_out[:, 3:99]          # rows with strides 100 and 120
    assert cpu_gemm.small_m_mm(x, w.t(), out)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)
    assert big_out[:, :3].eq(0).all() and big_out[:, 99:].eq(0).all()   # nothing written outside


def test_a_row_gives_the_same_bits_in_any_batch():
    """Each output is one FMA chain over k in order: batch size, batch mates and thread split change nothing."""
    w = k_major(1000, 576, seed=2)                      # 1000 = 31 blocks of 32 columns + a tail of 8
    x = torch.randn(8, 576)
    full = torch.empty(8, 1000)
    assert cpu_gemm.small_m_mm(x, w.t(), full)
    for rows in ([3, 0], [5, 1, 7], [6, 2, 4, 3, 1]):
        part = torch.empty(len(rows), 1000)
        assert cpu_gemm.small_m_mm(x[rows], w.t(), part)
        assert torch.equal(part, full[rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = torch.empty(8, 1000)
        assert cpu_gemm.small_m_mm(x, w.t(), one_thread)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)


def test_declines_what_it_does_not_compute():
    w = k_major(64, 32, seed=3)
    out = torch.zeros(4, 64)
    assert not cpu_gemm.small_m_mm(torch.randn(1, 32), w.t(), out[:1])            # one row: BLAS's GEMV
    assert not cpu_gemm.small_m_mm(torch.randn(9, 32), w.t(), torch.zeros(9, 64))  # > 8 rows: BLAS
    assert not cpu_gemm.small_m_mm(torch.randn(4, 32).double(), w.t().double(), out.double())
    assert not cpu_gemm.small_m_mm(torch.randn(4, 32), w.contiguous().t(), out)   # row-major weight
    assert out.eq(0).all()
