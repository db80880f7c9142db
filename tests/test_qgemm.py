"""The quantized GEMM (lmq_kernels/cpu_qgemm.c, `cpu.qgemm`): int4 and int8 weights in panels times activations
rounded to int8. On every instruction-set variant this host runs (AVX-512 VNNI, AVX2's vpmaddubsw, portable C),
the same bits as torch's emulation of the arithmetic (`qgemm_torch`) for any row count, padding, strides and
thread count; close to the float32 product of the de-quantized weight (the activations' rounding); and the
panel layout round-trips."""
from __future__ import annotations

import pytest
import torch

from lmq_kernels import cpu
from lmq_kernels.cpu_quantized import q8_rows, qgemm_torch
from test_cpu_kernels import TARGETS

BITS = (4, 8)


def levels(bits: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    if bits == 4:
        return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), d, -torch.rand(n, k // 32, generator=g) * 0.08
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d * 0.1, None


def float_product(x, q, d, m):
    n, k = q.shape
    w = q.double().view(n, k // 32, 32) * d.double()[..., None]
    if m is not None:
        w = w + m.double()[..., None]
    return x.double() @ w.view(n, k).t()


@pytest.mark.parametrize("bits", BITS)
def test_panels_round_trip(bits):
    for n, k in ((16, 32), (40, 64), (7, 576)):
        q, d, m = levels(bits, n, k, seed=n)
        w = cpu.pack(q, d, m)
        assert w.ok() and w.bits == bits and (w.n, w.k) == (n, k) and w.q.shape[0] == -(-n // 16)
        back = cpu.unpack(w)
        assert torch.equal(back[0], q) and torch.equal(back[1], d) and (m is None) == (back[2] is None)
        assert m is None or torch.equal(back[2], m)
        if bits == 8:   # each group's sum of q, what the VNNI path's unsigned x takes off again
            assert torch.equal(cpu.pack(q, d).sums.permute(0, 2, 1).reshape(-1, k // 32)[:n],
                               q.view(n, -1, 32).sum(-1, dtype=torch.int32))


def test_activation_quantization():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    xq, xs, s = q8_rows(x)
    assert torch.equal(xq[0, 0], torch.zeros(32)) and xs[0, 0] == 0 and s[0, 0] == 0   # an all-zero group
    assert xq[0, 1, :3].tolist() == [64.0, -127.0, 32.0]      # 1 * 63.5 rounds to even; 0.5 * 63.5 = 31.75
    assert xs[0, 1] == torch.tensor(2.0) / 127 and s[0, 1] == xs[0, 1] * (64 - 127 + 32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (8, 576, 3072), (3, 1536, 576), (13, 64, 40),
                                     (70, 96, 17), (130, 576, 48)])
def test_every_build_gives_torchs_bits(target, bits, m, k, n):
    q, d, mn = levels(bits, n, k, seed=m + n)
    w = cpu.pack(q, d, mn)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, :32] = 0                                                   # a group of zeros
    x[-1, 32:64] = 0
    x[-1, 32:36] = torch.tensor([2.0, 1.0, -1.0, 3.0 / 127])        # x * 63.5: ties, 63.5 and 1.5, to even
    want = torch.empty(m, n)
    qgemm_torch(x, w, want)
    exact = float_product(x, q, d, mn)
    assert (want.double() - exact).norm() < 0.02 * exact.norm()
    lib = cpu.build(target)
    assert lib is not None, cpu.build_error(target)
    with cpu.use(lib):
        got = torch.full((m, n), float("nan"))
        cpu.qgemm(x, w, got)
        assert torch.equal(got, want)
        alone = torch.cat([_mm(x[i:i + 1], w) for i in range(m)])
        assert torch.equal(alone, want)                               # a row's bits whatever the batch
        acc, want_acc = torch.ones(m, n), torch.ones(m, n)
        cpu.qgemm(x, w, acc, accumulate=True)
        qgemm_torch(x, w, want_acc, accumulate=True)
        assert torch.equal(acc, want_acc)


def _mm(x, w):
    out = torch.empty(x.shape[0], w.n)
    cpu.qgemm(x, w, out)
    return out


@pytest.mark.parametrize("bits", BITS)
def test_strided_rows_and_thread_counts(bits):
    lib = cpu.build("native")
    assert lib is not None, cpu.build_error()
    w = cpu.pack(*levels(bits, 3072, 576))
    big = torch.randn(9, 700)
    x = big[:, 50:626]                                               # rows 700 floats apart
    out = torch.zeros(9, 3100)[:, 10:3082]                          # and the output's 3,100
    want = torch.empty(9, 3072)
    qgemm_torch(x, w, want)
    threads = torch.get_num_threads()
    with cpu.use(lib):
        try:
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                out.fill_(float("nan"))
                cpu.qgemm(x, w, out)
                assert torch.equal(out, want), t
        finally:
            torch.set_num_threads(threads)
