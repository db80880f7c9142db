"""int4 weights x int8 activations (lmq_kernels/cpu_q4a8.c, `cpu.q4a8_mm`): on every instruction-set variant this
host runs (AVX-512 VNNI, AVX2's maddubs, portable C), the same bits as torch's emulation of the arithmetic
(`q4a8_torch`) for any row count, padding, strides and thread count; close to the float32 product of the
de-quantized weight (the activations' rounding); and the panel layout round-trips."""
from __future__ import annotations

import pytest
import torch

from lmq_kernels import cpu
from lmq_kernels.cpu_quantized import q4a8_torch, q8_rows
from test_cpu_kernels import TARGETS


def weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    m = -torch.rand(n, k // 32, generator=g) * 0.08
    return q, d, m


def float_product(x, q, d, m):
    n, k = q.shape
    w = (q.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
    return x.double() @ w.double().t()


def test_panels_round_trip():
    for n, k in ((16, 32), (40, 64), (7, 576)):
        q, d, m = weight(n, k, seed=n)
        qp, dp, mp = cpu.pack_q4(q, d, m)
        assert qp.shape == (-(-n // 16), 8 * k) and dp.shape == mp.shape == (-(-n // 16), k // 32, 16)
        back = cpu.unpack_q4(qp, dp, mp, n)
        assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m)))


def test_activation_quantization():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    xq, xs, s = q8_rows(x)
    assert torch.equal(xq[0, 0], torch.zeros(32)) and xs[0, 0] == 0 and s[0, 0] == 0   # an all-zero group
    assert xq[0, 1, :3].tolist() == [64.0, -127.0, 32.0]      # 1 * 63.5 rounds to even; 0.5 * 63.5 = 31.75
    assert xs[0, 1] == torch.tensor(2.0) / 127 and s[0, 1] == xs[0, 1] * (64 - 127 + 32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (8, 576, 3072), (3, 1536, 576), (13, 64, 40),
                                     (70, 96, 17), (130, 576, 48)])
def test_every_build_gives_torchs_bits(target, m, k, n):
    q, d, mn = weight(n, k, seed=m + n)
    qp, dp, mp = cpu.pack_q4(q, d, mn)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, :32] = 0                                                   # a group of zeros
    want = torch.empty(m, n)
    q4a8_torch(x, qp, dp, mp, want)
    assert ((want - float_product(x, q, d, mn)).norm() / float_product(x, q, d, mn).norm()) < 0.02
    lib = cpu.build(target)
    assert lib is not None, cpu.build_error(target)
    with cpu.use(lib):
        got = torch.full((m, n), float("nan"))
        cpu.q4a8_mm(x, qp, dp, mp, got)
        assert torch.equal(got, want)
        alone = torch.cat([_mm(x[i:i + 1], qp, dp, mp, n) for i in range(m)])
        assert torch.equal(alone, want)                               # a row's bits whatever the batch
        acc = torch.ones(m, n)
        cpu.q4a8_mm(x, qp, dp, mp, acc, accumulate=True)
        want_acc = torch.ones(m, n)
        q4a8_torch(x, qp, dp, mp, want_acc, accumulate=True)
        assert torch.equal(acc, want_acc)


def _mm(x, qp, dp, mp, n):
    out = torch.empty(x.shape[0], n)
    cpu.q4a8_mm(x, qp, dp, mp, out)
    return out


def test_strided_rows_and_thread_counts():
    lib = cpu.build("native")
    assert lib is not None, cpu.build_error()
    q, d, mn = weight(3072, 576)
    qp, dp, mp = cpu.pack_q4(q, d, mn)
    big = torch.randn(9, 700)
    x = big[:, 50:626]                                               # rows 700 floats apart
    out = torch.zeros(9, 3100)[:, 10:3082]                          # and the output's 3,100
    want = torch.empty(9, 3072)
    q4a8_torch(x, qp, dp, mp, want)
    threads = torch.get_num_threads()
    with cpu.use(lib):
        try:
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                out.fill_(float("nan"))
                cpu.q4a8_mm(x, qp, dp, mp, out)
                assert torch.equal(out, want), t
        finally:
            torch.set_num_threads(threads)
