"""lmq's CPU kernels (`lmq_kernels.cpu`), built with the machine's C compiler: the small-M GEMM and the
decode attention, each checked against a float64 reference and row-independent bit for bit (a row's result
does not depend on the batch around it, nor on the thread count).

Every kernel test runs on each variant this host can run (`kernels`): the host's own build (-march=native),
the AVX2+FMA build (x86-64-v3: 8-lane vectors, the blocking for 16 registers) and the portable one (x86-64:
SSE2, the 4-lane shape NEON also gets), so an AVX-512 CI host tests the AVX2 variant too; the AVX-512 build
is compiled everywhere. A build that fails fails the tests (`cpu_kernels`: only a host off Linux, or without a C
compiler under LMQ_ALLOW_NO_COMPILER=1, skips them); the engine's fallback after a failed build is tested at the end."""
from __future__ import annotations

import logging
import platform

import pytest
import torch

from lmq_kernels import cpu
from lmq_kernels.cpu import library
from support.cpu_targets import TARGETS, X86, kernels  # noqa: F401 (kernels: a fixture)

pytestmark = pytest.mark.cpu_kernels

ANY_ROWS = (1, 64)

def attend(q, k, v, starts, out, scale):
    """`cpu.attention` over dense K/V [B, Hkv, S, D] (any strides), seen as one layer of the paged store and
    page tables (column s of row b is slot b * (stride_b / stride_s) + s, as `support.caches.paged_view`)."""
    b, h, s, d = k.shape

    def store(x):
        sb, sh, ss, sd = x.stride()
        if sd != 1:  # a layout the kernel declines: keep the last dimension strided
            return torch.zeros(s, d, h).transpose(1, 2)
        return x.as_strided(((b - 1) * (sb // ss) + s, h, d), (ss, sh, 1))

    sb, ss = k.stride(0), k.stride(2)
    table = (torch.arange(b, dtype=torch.int32)[:, None] * (sb // ss) + torch.arange(s, dtype=torch.int32)[None])
    k_store, v_store = store(k), store(v)
    return cpu.attention(q, k_store, v_store, table, starts, out, scale)


def test_the_kernels_build_and_load():
    """The engine's own build: on Linux with a compiler, it must work (the engine would silently run torch)."""
    assert cpu.build() is not None, cpu.build_error()
    assert cpu.build_error() is None


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"] if X86 else ["native"])
def test_every_variant_compiles(march):
    """Every x86 shape (4, 8 and 16 lanes) compiles, also on a host that cannot run it (the AVX-512 one on an
    AVX2 host)."""
    assert cpu.build(march) is not None, cpu.build_error(march)


def test_the_blocking_fits_the_target(kernels, request):
    """8-lane vectors and 4 x 3 accumulators (12 of 16 registers) for AVX2, 6 x 2 over panels past 4 rows, 16
    lanes and 6 x 4 for AVX-512, 4 lanes for the portable build: accumulators, weight vectors and a broadcast
    fit the registers."""
    shape = cpu.gemm_shape(kernels)
    assert shape["rows"] * shape["vectors"] + shape["vectors"] + 1 <= shape["registers"]
    assert shape["rows_many"] * shape["vectors_many"] + shape["vectors_many"] + 1 <= shape["registers"]
    want = {"x86-64-v3": {"lanes": 8, "rows": 4, "vectors": 3, "registers": 16, "rows_many": 6, "vectors_many": 2},
            "x86-64-v4": {"lanes": 16, "rows": 6, "vectors": 4, "registers": 32, "rows_many": 6, "vectors_many": 4},
            "x86-64": {"lanes": 4, "rows": 4, "vectors": 3, "registers": 16, "rows_many": 4, "vectors_many": 3}}
    want = want.get(request.node.callspec.params["kernels"])
    assert want is None or shape == want


def k_major(n: int, k: int, seed: int) -> torch.Tensor:
    """A [N, K] weight stored K-major, as lmq's CPU path stores the model's Linear weights."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).t().contiguous().t()


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (2, 576, 960), (5, 100, 70), (8, 1536, 576), (8, 7, 33),
                                   (11, 96, 128), (17, 40, 1000), (50, 576, 200)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matches_float64_reference(m, k, n, accumulate, kernels):
    w = k_major(n, k, seed=m + k + n)
    x = torch.randn(m, k)
    out = torch.randn(m, n)
    expected = (out.double() if accumulate else 0) + x.double() @ w.double().t()
    assert cpu.small_m_mm(x, w.t(), out, accumulate=accumulate, rows=ANY_ROWS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("m,k,n", [(1, 576, 1024), (2, 96, 64), (3, 600, 320), (5, 100, 192), (6, 130, 192),
                                   (7, 1536, 64), (8, 576, 3072), (17, 200, 128)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_panel_major_weights_give_the_k_major_bits(m, k, n, accumulate, kernels):
    """The same weights read from their panel-major copy (`cpu_step.panel_major`, what the CPU step and its
    LM head read): every output bit for bit as from the K-major rows, any row count and thread split (row
    counts of every pass shape, chunks of 64 weight rows with a short last one: the next chunk's prefetch)."""
    from lmq_kernels.cpu.step import panel_major

    w = k_major(n, k, seed=m + k + n)
    x, start = torch.randn(m, k), torch.randn(m, n)
    k_major_out, panel_out = start.clone(), start.clone()
    assert cpu.small_m_mm(x, w.t(), k_major_out, accumulate=accumulate, rows=ANY_ROWS)
    assert cpu.small_m_mm(x, w.t(), panel_out, accumulate=accumulate, rows=ANY_ROWS, panels=panel_major(w.t()))
    assert torch.equal(panel_out, k_major_out)
    torch.testing.assert_close(panel_out.double(), (start.double() if accumulate else 0) + x.double() @ w.double().t(),
                               rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_bias_starts_the_sums(kernels):
    w = k_major(70, 48, seed=4)
    x, bias = torch.randn(3, 48), torch.randn(70)
    out = torch.full((3, 70), float("nan"))
    assert cpu.small_m_mm(x, w.t(), out, bias=bias)
    torch.testing.assert_close(out, bias + x @ w.t(), rtol=1e-5, atol=1e-4)
    untouched = torch.zeros(1, 70)
    assert not cpu.small_m_mm(x[:1], w.t(), untouched, bias=bias, rows=(2, 8))   # declined: out as it was
    assert untouched.eq(0).all()


def test_strided_rows_of_x_and_out(kernels):
    w = k_major(96, 64, seed=1)
    big_x, big_out = torch.randn(4, 100), torch.zeros(4, 120)
    x, out = big_x[:, 10:74], big_out[:, 3:99]          # rows with strides 100 and 120
    assert cpu.small_m_mm(x, w.t(), out)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)
    assert big_out[:, :3].eq(0).all() and big_out[:, 99:].eq(0).all()   # nothing written outside


def test_a_row_gives_the_same_bits_in_any_batch(kernels):
    """Each output is one FMA chain over k in order: batch size, batch mates and thread split change nothing."""
    w = k_major(1000, 576, seed=2)                      # 1000 = 31 blocks of 32 columns + a tail of 8
    x = torch.randn(8, 576)
    full = torch.empty(8, 1000)
    assert cpu.small_m_mm(x, w.t(), full)
    for rows in ([3, 0], [5, 1, 7], [6, 2, 4, 3, 1]):
        part = torch.empty(len(rows), 1000)
        assert cpu.small_m_mm(x[rows], w.t(), part)
        assert torch.equal(part, full[rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = torch.empty(8, 1000)
        assert cpu.small_m_mm(x, w.t(), one_thread)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)


def test_declines_what_it_does_not_compute(kernels):
    w = k_major(64, 32, seed=3)
    out = torch.zeros(4, 64)
    assert not cpu.small_m_mm(torch.randn(1025, 32), w.t(), torch.zeros(1025, 64))  # > 1,024 rows: BLAS
    assert not cpu.small_m_mm(torch.randn(1, 32), w.t(), out[:1], rows=(2, 8))  # outside the rows asked for
    assert not cpu.small_m_mm(torch.randn(4, 32).double(), w.t().double(), out.double())
    assert not cpu.small_m_mm(torch.randn(4, 32), w.contiguous().t(), out)   # row-major weight
    assert out.eq(0).all()


# ------------------------------------------------------------------------------------------------ attention

def attention_case(B, Hq, Hkv, S, D, seed, pad=5):
    """q [B, Hq, D]; k, v strided views [B, Hkv, S, D] of a pool with `pad` columns on each side that hold
    NaN (never to be read); starts int32 [B] (the first row from column 0, another with one column)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.full((2, B + 1, Hkv, S + 2 * pad, D), float("nan"))
    starts = torch.randint(0, S, (B,), generator=g, dtype=torch.int32)
    starts[0] = 0
    starts[-1] = S - 1
    for b in range(B):
        pool[:, b, :, pad + int(starts[b]):pad + S] = torch.randn(2, Hkv, S - int(starts[b]), D, generator=g) * 2
    k, v = pool[0, :B, :, pad:pad + S], pool[1, :B, :, pad:pad + S]
    q = torch.randn(B, Hq, D + 16, generator=g)[..., :D]     # strided rows
    return q, k, v, starts


def attention_reference(q, k, v, starts, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    G = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        s0 = int(starts[b])
        kk = k[b, :, s0:].double().repeat_interleave(G, 0)            # [Hq, n, D]
        vv = v[b, :, s0:].double().repeat_interleave(G, 0)
        p = torch.softmax((kk @ q[b].double()[:, :, None])[..., 0] * scale, -1)  # [Hq, n]
        out[b] = (p[:, None] @ vv)[:, 0]
    return out


@pytest.mark.parametrize("B,Hq,Hkv,S,D", [(2, 9, 3, 50, 64), (3, 8, 2, 17, 128), (4, 4, 4, 33, 64),
                                           (2, 16, 2, 70, 256), (5, 6, 1, 1, 64), (1, 9, 3, 300, 64),
                                           (3, 8, 2, 513, 128)])   # one row; several chunks of 128 columns
def test_attention_matches_reference(B, Hq, Hkv, S, D, kernels):
    q, k, v, starts = attention_case(B, Hq, Hkv, S, D, seed=B * S + D)
    out = torch.full((B, Hq, D), float("nan"))
    assert attend(q, k, v, starts, out, D ** -0.5)
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, starts, D ** -0.5), atol=2e-6, rtol=1e-5)


def test_attention_rows_are_independent_bitwise(kernels):
    """A row gets the same bits in any batch and on any number of threads."""
    q, k, v, starts = attention_case(6, 9, 3, 290, 64, seed=3)   # rows of 1 to 3 chunks
    full = torch.empty(6, 9, 64)
    assert attend(q, k, v, starts, full, 0.125)
    for rows in (slice(0, 1), slice(0, 2), slice(2, 5), slice(4, 6)):
        part = torch.empty(rows.stop - rows.start, 9, 64)
        assert attend(q[rows], k[rows], v[rows], starts[rows].contiguous(), part, 0.125)
        assert torch.equal(part, full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.empty(6, 9, 64)
        assert attend(q, k, v, starts, one_thread, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)


@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_attention_over_shared_prefixes(Hq, Hkv, D, kernels):
    """Rows whose tables point at the same slots (a prefix in the trie, as in every few-shot batch): each row
    matches the reference and gets the bits it gets alone, in any batch, on any number of threads. The rows: four on one 300-token prefix (one of them left-padded, so its chunks fall elsewhere), two that part
    inside a chunk, one on a prefix of its own, one with a single column."""
    g = torch.Generator().manual_seed(Hq * D)
    S, prefix = 420, 300
    store = torch.randn(2, 1 + prefix + 8 * S, Hkv, D, generator=g)
    shared = torch.arange(1, prefix + 1, dtype=torch.int32)
    own = lambda b, n: torch.arange(1 + prefix + b * S, 1 + prefix + b * S + n, dtype=torch.int32)  # noqa: E731
    rows = [torch.cat([shared, own(0, S - prefix)]), torch.cat([shared, own(1, S - prefix)]),
            torch.cat([shared[:190], own(2, S - 190)]), torch.cat([shared, own(3, S - prefix)]),
            torch.cat([torch.zeros(20, dtype=torch.int32), shared, own(4, S - prefix - 20)]),
            torch.cat([shared, own(5, S - prefix)]), own(6, S), torch.cat([torch.zeros(S - 1, dtype=torch.int32), own(7, 1)])]
    table = torch.stack(rows).contiguous()
    starts = torch.tensor([0, 0, 0, 0, 20, 0, 0, S - 1], dtype=torch.int32)
    q = torch.randn(8, Hq, D, generator=g)
    k, v = store[0], store[1]
    full = torch.full((8, Hq, D), float("nan"))
    assert cpu.attention(q, k, v, table, starts, full, D ** -0.5)
    dense_k = k[table.long()].transpose(1, 2)      # [B, Hkv, S, D]
    dense_v = v[table.long()].transpose(1, 2)
    torch.testing.assert_close(full.double(), attention_reference(q, dense_k, dense_v, starts, D ** -0.5),
                               atol=2e-6, rtol=1e-5)
    for b in range(8):
        alone = torch.empty(1, Hq, D)
        assert cpu.attention(q[b:b + 1], k, v, table[b:b + 1], starts[b:b + 1], alone, D ** -0.5)
        assert torch.equal(alone[0], full[b]), b
    for sel in ([1, 0, 3, 5], [5, 3], [0, 4, 1, 2, 7, 3]):
        part = torch.empty(len(sel), Hq, D)
        assert cpu.attention(q[sel], k, v, table[sel].contiguous(), starts[sel], part, D ** -0.5)
        assert torch.equal(part, full[sel])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty(8, Hq, D)
        assert cpu.attention(q, k, v, table, starts, one, D ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


def test_attention_clamps_starts(kernels):
    q, k, v, starts = attention_case(3, 4, 2, 20, 64, seed=4)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    out = torch.full((3, 4, 64), float("nan"))
    assert attend(q, k, v, torch.tensor([-7, 20, 25], dtype=torch.int32), out, 0.125)
    want = attention_reference(q[:1], k[:1], v[:1], torch.tensor([0]), 0.125)[0]
    torch.testing.assert_close(out[0].double(), want, atol=2e-6, rtol=1e-5)   # from column 0
    assert torch.equal(out[1:], torch.zeros(2, 4, 64))                       # no column: zeros


def test_attention_declines(kernels):
    q, k, v, starts = attention_case(3, 4, 2, 20, 64, seed=5)
    out = torch.zeros(3, 4, 64)
    assert not attend(q.double(), k.double(), v.double(), starts, out.double(), 0.125)
    assert not attend(q, k, v, starts.long(), out, 0.125)
    assert not attend(q[..., :32], k[..., :32], v[..., :32], starts, out[..., :32], 0.125)  # head dim 32
    assert not attend(q[:, :3], k, v, starts, out[:, :3], 0.125)                            # 3 % 2 heads
    assert not attend(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, starts, out, 0.125)
    assert torch.equal(out, torch.zeros(3, 4, 64))


# ------------------------------------------------------------------------------------------------ small ops

def test_rmsnorm_and_silu_mul_match_torch(kernels):
    from lmq_backend.engine.fused.ops import _rmsnorm_torch

    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 600, generator=g)[:, :576] * 3     # strided rows
    w = torch.randn(576, generator=g)
    out = torch.empty(5, 576)
    assert cpu.rmsnorm(x, w, 1e-5, out)
    torch.testing.assert_close(out, _rmsnorm_torch(x, w, 1e-5), atol=1e-6, rtol=1e-5)
    gu = torch.randn(3, 2 * 1000, generator=g) * 6        # 1000: a tail of 8 after 62 vectors
    gu[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-8, -1e-8, 20.0, -20.0])
    act = torch.empty(3, 1000)
    assert cpu.silu_mul(gu, act)
    want = torch.nn.functional.silu(gu[:, :1000].double()) * gu[:, 1000:].double()
    torch.testing.assert_close(act.double(), want, atol=1e-6, rtol=2e-6)
    assert not cpu.silu_mul(gu, torch.empty(3, 999))
    assert not cpu.rmsnorm(x.double(), w.double(), 1e-5, out.double())


def test_rmsnorm_and_silu_mul_rows_keep_their_bits_threaded(kernels):
    """Calls of 16K+ elements split their rows (RMSNorm) or columns (silu*up) over the threads: a row gets the
    bits it gets alone, on any number of threads (577 wide: a tail after 36 vectors of 16)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(200, 577, generator=g) * 2, torch.randn(577, generator=g)
    gu = torch.randn(200, 2 * 1000, generator=g) * 4
    many, act = torch.empty(200, 577), torch.empty(200, 1000)
    assert cpu.rmsnorm(x, w, 1e-5, many) and cpu.silu_mul(gu, act)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in (0, 77, 199):
            one, one_act = torch.empty(1, 577), torch.empty(1, 1000)
            assert cpu.rmsnorm(x[r:r + 1], w, 1e-5, one) and cpu.silu_mul(gu[r:r + 1], one_act)
            assert torch.equal(one[0], many[r]) and torch.equal(one_act[0], act[r]), r
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_step_with_c_ops_matches_torch_ops(arch, monkeypatch):
    """The fused CPU step and prefill with lmq's C kernels (RMSNorm, RoPE + K/V append with q/k norms and left
    padding, SiLU-mul, attention, GEMM) against the same step with torch ops (LMQ_CPU_KERNELS=0): logits and
    every K/V written."""
    from support.fused import assert_same_forwards, prefill_then_steps, tiny_llama, tiny_qwen3

    model = tiny_llama(seed=8) if arch == "llama" else tiny_qwen3(seed=8)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")      # the C kernels wherever they take the operands
    with_c = prefill_then_steps(model, steps=3, seed=1)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    assert_same_forwards(with_c, prefill_then_steps(model, steps=3, seed=1))


# ------------------------------------------------------------------------------------------------ fallback

@pytest.fixture
def fresh_module(monkeypatch, tmp_path):
    """cpu's module state as in a new process, building into tmp_path (restored afterwards)."""
    for name, value in (("_lib", None), ("_calibration", None), ("_override", None), ("_build_dir", tmp_path)):
        monkeypatch.setattr(library, name, value)
    monkeypatch.delenv("LMQ_CPU_KERNELS", raising=False)
    return tmp_path


@pytest.mark.parametrize("why", ["failed build", "no compiler", "not linux"])
def test_no_kernels_means_torch_and_one_log_line(why, fresh_module, monkeypatch, caplog):
    """A failed build, no compiler or another OS: every op declines (torch runs it), `build_error` says why,
    and one line is logged however many calls follow."""
    if why == "failed build":
        monkeypatch.setenv("CC", "false")              # exits 1 without building anything
    elif why == "no compiler":
        monkeypatch.setattr("lmq_kernels.cpu.toolchain.compiler", lambda: None)
    else:
        monkeypatch.setattr(platform, "system", lambda: "Darwin")
    w, x, out = k_major(64, 32, seed=5), torch.randn(4, 32), torch.zeros(4, 64)
    with caplog.at_level(logging.WARNING, logger="lmq_kernels.cpu"):
        assert not cpu.available()
        for _ in range(3):
            assert not cpu.small_m_mm(x, w.t(), out)
            assert not cpu.rmsnorm(x, torch.ones(32), 1e-5, torch.empty(4, 32))
    assert out.eq(0).all()
    error = cpu.build_error(directory=fresh_module)
    expected = {"failed build": "exited 1", "no compiler": "no C compiler", "not linux": "not Linux"}[why]
    assert error and expected in error, error
    lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


# a variant this host runs other than its own: the AVX2 one (8 lanes), else the SSE2 one (4 lanes); off x86, the
# host's own named by LMQ_CPU_MARCH
MARCH, LANES = ("x86-64-v3", 8) if "x86-64-v3" in TARGETS else ("x86-64", 4) if X86 else ("native", None)


def test_the_engine_runs_the_target_lmq_cpu_march_names(fresh_module, monkeypatch):
    """`LMQ_CPU_MARCH=x86-64-v3` builds the engine's own library (the one every op and the C step call)
    for AVX2 + FMA, so that the AVX2 variant is measured end to end on an AVX-512 host; unset, the host's."""
    monkeypatch.setenv("LMQ_CPU_MARCH", MARCH)
    assert cpu.target() == MARCH
    assert cpu.gemm_shape(cpu.load())["lanes"] == (LANES or cpu.gemm_shape(cpu.build("native"))["lanes"])
    w, x, out = k_major(64, 32, seed=6), torch.randn(3, 32), torch.zeros(3, 64)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert cpu.small_m_mm(x, w.t(), out)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
    monkeypatch.delenv("LMQ_CPU_MARCH")
    monkeypatch.setattr(library, "_lib", None)
    assert cpu.target() == "native"
    assert cpu.gemm_shape(cpu.load()) == cpu.gemm_shape(cpu.build("native"))
