"""Weight-only quantized decode on the CPU (issue #15): `QuantizedLinear` int8 / int4, lmq's C kernel for them,
the default model's shipped Q4_1 weights, and the engine's exactness per dtype (greedy tokens the same with the
cache on or off, batched or alone, through the fused step and through the model's own forward)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lmq_backend.backend.gguf_weights import Q4_1_BLOCK_BYTES
from lmq_backend.engine.quantize import PANEL_CACHE, PANELS_ENV, PanelCache, QuantizedLinear, default_panel_budget, \
    quantize_model
from lmq_kernels import cpu

from support.models import SCRIPT, build, differences, run_engine, standard_calls

KINDS = ("int8", "int4")


@pytest.fixture(params=[pytest.param("lmq", marks=pytest.mark.cpu_kernels), "torch"])
def kernels(request, monkeypatch):
    """Both ways a QuantizedLinear multiplies, the two extremes of the calibration: lmq's C kernel wherever it
    takes the operands (LMQ_CPU_KERNELS=1, up to 16 rows a call), or (LMQ_CPU_KERNELS=0, as without a C
    compiler) the weight de-quantized for the call and torch's GEMM."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0" if request.param == "torch" else "1")
    if request.param == "lmq":
        assert cpu.available(), cpu.build_error()
    return request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(96, 64), (1000, 576), (7, 1536), (192, 576)])
def test_quantized_linear_matches_its_dequantized_weight_and_rows_do_not_depend_on_the_batch(kind, n, k, kernels):
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    lin = QuantizedLinear.quantize(w, b, kind)
    x = torch.randn(70, k)
    want = x @ lin.dequantize().t() + b
    got = lin(x[:40])
    assert torch.allclose(got, want[:40], rtol=1e-5, atol=1e-5)
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)      # 70 rows: lmq's GEMM over panels, or torch's
    if kernels == "lmq":  # every row as in any other batch (torch's GEMM and GEMV differ in the last bits)
        for m in (1, 2, 3, 5, 8, 15, 17, 33):
            assert torch.equal(lin(x[:m]), got[:m]), m
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(40)]), got)
        assert torch.equal(lin(x[:66]), lin(x)[:66])                 # past 64 rows too (whichever GEMM)
    assert torch.equal(lin.dense(), lin.dequantize())   # lmq's de-quantizing copy: torch's bits (no FMA)
    if n % 64 == 0 and kernels == "lmq":                 # and into the float32 GEMM's panels [n / 64, k, 64]
        panels = torch.empty(n // 64, k, 64)
        assert cpu.dequantize(lin.qweight, lin.scales, lin.zeros, panels)
        assert torch.equal(panels, lin.dequantize().t().reshape(k, n // 64, 64).permute(1, 0, 2))
    # the quantization itself: within half a step of its group of 32
    g = w.view(n, -1, 32)
    step = (g.abs().amax(-1) / 127 if kind == "int8" else (g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)
    assert ((lin.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    out = torch.ones(4, n)
    lin.mm(x[:4], out, accumulate=True)                                     # the fused step's residual form
    assert torch.allclose(out, 1 + want[:4] - b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_stacked_modules_compute_side_by_side(kind, kernels):
    """The fused step's q/k/v (gate/up) matrix: the modules' weights one after another along N; each output the
    same as its own module's (the biases are the caller's: `mm(bias=)`)."""
    torch.manual_seed(0)
    mods = [QuantizedLinear.quantize(torch.randn(n, 64), torch.randn(n) if n == 32 else None, kind)
            for n in (64, 32, 48)]
    x = torch.randn(3, 64)
    out = torch.empty(3, 144)
    QuantizedLinear.stack(mods).mm(x, out)
    parts = []
    for m in mods:
        parts.append(torch.empty(3, m.out_features))
        m.mm(x, parts[-1])
    assert torch.equal(out, torch.cat(parts, 1))


@pytest.fixture
def panel_budget():
    """Sets the process's panel cache's budget (bytes) for a test; the default again after it."""
    yield PANEL_CACHE.set_budget
    PANEL_CACHE.set_budget(None)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_panel_cache_keeps_prefill_panels_within_its_budget_with_the_same_results(kind, panel_budget, monkeypatch):
    """A long prefill's panels (more than KERNEL_ROWS rows: lmq's GEMM over the weight de-quantized into panels)
    are kept for the next one within the budget, the panels made first; the rest are de-quantized for each
    call. The results are bit-identical with the cache on or off, kept or not."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert cpu.available(), cpu.build_error()
    torch.manual_seed(1)
    lins = [QuantizedLinear.quantize(torch.randn(n, 576) * 0.05, None, kind) for n in (192, 128, 64)]
    x = torch.randn(80, 576)
    panel_budget(0)                                                      # off: nothing kept
    off = [lin(x) for lin in lins]
    assert len(PANEL_CACHE) == 0 and PANEL_CACHE.used == 0
    assert all(torch.allclose(y, x @ lin.dequantize().t(), rtol=1e-5, atol=1e-5) for y, lin in zip(off, lins))
    budget = 4 * 576 * (192 + 128)                                       # the first two weights' panels
    panel_budget(budget)
    made = PANEL_CACHE.made
    for _ in range(3):
        assert all(torch.equal(lin(x), y) for lin, y in zip(lins, off))
        assert len(PANEL_CACHE) == 2 and PANEL_CACHE.used == budget <= PANEL_CACHE.budget
    assert PANEL_CACHE.made - made == 3 + 2                              # 3 at first, then the third each time
    lins[0].qweight.view(torch.uint8).bitwise_xor_(1)                     # changed in place: made again
    changed = lins[0](x)
    assert not torch.equal(changed, off[0]) and PANEL_CACHE.made - made == 6
    assert torch.allclose(changed, x @ lins[0].dequantize().t(), rtol=1e-5, atol=1e-5)
    assert PANEL_CACHE.used == budget
    del lins[1]                                                          # a module's panels go with it
    assert len(PANEL_CACHE) == 1 and PANEL_CACHE.used == 4 * 576 * 192
    assert torch.equal(lins[1](x), off[2])                               # now there is room for the third
    assert len(PANEL_CACHE) == 2 and PANEL_CACHE.used == 4 * 576 * (192 + 64)


@pytest.mark.cpu_kernels
def test_panel_cache_warm_keeps_what_fits_and_makes_nothing_else(monkeypatch):
    """A model's load fills the cache (`warm`): the layers' panels in order while they fit, nothing de-quantized
    for one that does not (it would not be kept), nothing again for those kept."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")                           # lmq's GEMM: the panels
    assert cpu.available(), cpu.build_error()
    lins = [QuantizedLinear.quantize(torch.randn(n, 64), None, "int4") for n in (128, 192, 64, 96)]
    cache = PanelCache(4 * 64 * (128 + 64))
    assert cache.warm(lins) == 2 and cache.made == 2                     # 128 and 64; 192 too large; 96 no panels
    assert cache.used == cache.budget and len(cache) == 2
    assert cache.warm(lins) == 0 and cache.made == 2
    assert torch.equal(cache.panels(lins[2]), lins[2].dequantize().t().reshape(64, 1, 64).permute(1, 0, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_torchs_long_prefills_keep_the_dense_weight(kind, panel_budget, monkeypatch):
    """Where torch's GEMM runs a long prefill (LMQ_CPU_KERNELS=0, as without a C compiler or where calibration
    chose it), the weight de-quantized to [N, K] is what is kept (and what a load keeps): the second prefill
    de-quantizes nothing, with the same bits."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    torch.manual_seed(2)
    lin = QuantizedLinear.quantize(torch.randn(96, 64) * 0.05, None, kind)
    x = torch.randn(70, 64)
    want = x @ lin.dequantize().t()
    panel_budget(None)
    made = PANEL_CACHE.made
    assert torch.equal(lin(x), want) and torch.equal(lin(x), want)
    assert PANEL_CACHE.made - made == 1 and PANEL_CACHE.used == 4 * 96 * 64
    cache = PanelCache()
    assert cache.warm([lin]) == 1 and torch.equal(cache.get(lin, "dense"), lin.dequantize())


def test_panel_budget_default_and_env(monkeypatch):
    """The budget: LMQ_QUANT_PANELS_MB megabytes (0: off), else a tenth of the machine's memory."""
    monkeypatch.setenv(PANELS_ENV, "0")
    assert default_panel_budget() == 0 and PanelCache().budget == 0
    monkeypatch.setenv(PANELS_ENV, "1.5")
    assert PanelCache().budget == 3 << 19
    monkeypatch.delenv(PANELS_ENV)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert PanelCache().budget == int(0.1 * memory) > 0
    for bad in ("lots", "-5", "nan"):  # not a size: the default, with a warning naming the variable
        monkeypatch.setenv(PANELS_ENV, bad)
        with pytest.warns(RuntimeWarning, match=PANELS_ENV):
            assert default_panel_budget() == int(0.1 * memory)


def q4_1_blocks(raw: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [N, K/32 * 20] as (q uint8 [N, K] in 0..15, d [N, K/32], m [N, K/32]) float32:
    w[n, 32 g + j] = d[n, g] q[n, 32 g + j] + m[n, g]. Nibble j < 16 is the low half of byte j, j >= 16 the
    high half of byte j - 16 (ggml's block_q4_1)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def is_quantized(model) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_q4_1_blocks_read_ggmls_layout():
    """A hand-made Q4_1 row: fp16 d, fp16 m, then 16 bytes; element j < 16 is byte j's low nibble, j >= 16
    byte j - 16's high nibble. The int4 module built from it de-quantizes to d q + m exactly."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    d = rng.random((3, 2)).astype(np.float16)
    m = (-rng.random((3, 2))).astype(np.float16)
    raw = np.zeros((3, 2, 20), dtype=np.uint8)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    raw[..., 2:4] = m[..., None].view(np.uint8)
    blocks = q.reshape(3, 2, 32)
    raw[..., 4:] = blocks[..., :16] | (blocks[..., 16:] << 4)
    got_q, got_d, got_m = q4_1_blocks(raw.reshape(3, 40), 64)
    assert np.array_equal(got_q.numpy(), q)
    assert np.array_equal(got_d.numpy(), d.astype(np.float32)) and np.array_equal(got_m.numpy(), m.astype(np.float32))
    w = QuantizedLinear.from_q4_1(got_q, got_d, got_m).dequantize()
    want = torch.from_numpy(q.astype(np.float32)) * got_d.repeat_interleave(32, 1) + got_m.repeat_interleave(32, 1)
    assert torch.equal(w, want)


# ------------------------------------------------------------------------------------------ the engine

def quantized_backend(tokenizer, family: str, kind: str, cache_budget="64MB"):
    from lmq_backend.backend.hf import HFBackend

    model = build(family)
    assert quantize_model(model, kind) > 0 and is_quantized(model)
    return HFBackend.from_model(model, tokenizer, cache_budget=cache_budget, name=f"{family}-{kind}"), model


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
async def test_greedy_tokens_per_dtype_cache_on_off_batched_alone(tokenizer, family, kind):
    """Within a dtype: the same tokens (and distributions) with the cache on or off, batched or alone; the
    fused step (Llama family: its q/k/v and gate/up stacked, Qwen2's q/k/v biases) and the model's own
    forward (GPT-2's Conv1D layers) both run quantized. And the same as a plain greedy loop over the
    quantized model's forward (no cache, the whole context each token)."""
    calls = standard_calls()
    cached, model = quantized_backend(tokenizer, family, kind)
    uncached, _ = quantized_backend(tokenizer, family, kind, cache_budget=0)
    if family != "gpt2":
        from lmq_backend.engine.fused import decoder_weights

        assert cached.runner.fused
        layer = decoder_weights(cached.model).layers[0]
        assert isinstance(layer.wqkv, QuantizedLinear) and isinstance(layer.wgu, QuantizedLinear)
    alone = await run_engine(cached, SCRIPT, calls, batched=False)
    assert cached.stats().tokens_reused > 0 and cached.stats().tokens_decoded > 0
    assert differences(await run_engine(uncached, SCRIPT, calls, batched=False), alone, tol=1e-4) == []
    assert differences(await run_engine(cached, SCRIPT, calls, batched=True, seed=1), alone, tol=1e-4) == []
    assert differences(await run_engine(uncached, SCRIPT, calls, batched=True, seed=2), alone, tol=1e-4) == []
    reference = [SCRIPT.reference(model, tokenizer, c) for c in calls[:3]]
    assert differences(alone[:3], reference, tol=1e-3) == []


@pytest.mark.parametrize("kind", KINDS)
async def test_greedy_tokens_per_dtype_at_both_extremes_of_the_calibration(tokenizer, kind, kernels):
    """The same, with lmq's kernels wherever they take the operands (GEMMs of the fused step, attention of one
    row or more) and with torch everywhere: what a machine's calibration may choose at its two ends."""
    calls = standard_calls()
    cached, _ = quantized_backend(tokenizer, "llama", kind)
    uncached, _ = quantized_backend(tokenizer, "llama", kind, cache_budget=0)
    alone = await run_engine(cached, SCRIPT, calls, batched=False)
    assert differences(await run_engine(uncached, SCRIPT, calls, batched=True, seed=3), alone, tol=1e-4) == []
    assert differences(await run_engine(cached, SCRIPT, calls, batched=True, seed=4), alone, tol=1e-4) == []


async def test_quantized_tokens_differ_from_float32_somewhere(tokenizer):
    """The comparison above has teeth: int4 changes these models' greedy tokens or distributions."""
    calls = standard_calls()[:3]
    q4, _ = quantized_backend(tokenizer, "llama", "int4")
    model = build("llama")
    fp = [SCRIPT.reference(model, tokenizer, c) for c in calls]
    assert differences(await run_engine(q4, SCRIPT, calls, batched=False), fp, tol=1e-4) != []


def test_quantized_dtypes_are_cpu_only():
    from lmq_backend.backend.hf import _resolve_dtype
    from lmq_backend.errors import LMQBackendError

    assert _resolve_dtype("int8", "cpu") == torch.float32
    with pytest.raises(LMQBackendError, match="CPU only"):
        _resolve_dtype("int4", "cuda")


@pytest.mark.parametrize("dtype", ["cuda", "nn", "float8_e4m3fn", "INT8", "int8 ", torch.int8])
def test_an_unknown_dtype_is_named_before_the_model_loads(dtype):
    """A torch attribute that is no dtype a model computes in (`torch.cuda`, `torch.nn`, float8) or a misspelt
    name gets a message listing the dtypes, not a loader's error about pickling a module."""
    import lmq_backend as lmq
    from lmq_backend.backend.hf import _resolve_dtype
    from lmq_backend.errors import LMQBackendError

    with pytest.raises(LMQBackendError, match=r"unknown dtype .*: use float32, bfloat16, float16, float64, or on a "
                                              r"CPU int8 or int4") as e:
        lmq.HFBackend("default", device="cpu", dtype=dtype)
    assert "could not load" not in str(e.value)
    assert _resolve_dtype("torch.bfloat16", "cpu") == torch.bfloat16
    assert _resolve_dtype(torch.float16, "cpu") == torch.float16


# ----------------------------------------------------------------------------------- the default model

@pytest.mark.slow
def test_default_models_q4_1_weights_load_as_shipped():
    """Every Q4_1 tensor of the shipped GGUF, loaded as int4 (scale d, zero m), de-quantizes to exactly the
    float32 weights transformers' GGUF conversion wrote (q/k rows un-permuted the same way)."""
    from transformers import AutoModelForCausalLM

    from lmq_backend.backend.default_model import default_model_dir, gguf_path
    from lmq_backend.backend.gguf_weights import load_q4_1

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32, use_kernels=False)
    floats = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert load_q4_1(model, gguf_path()) == 7 * model.config.num_hidden_layers
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(m.dequantize(), floats[name]), name


@pytest.mark.slow
async def test_default_model_int8_agrees_with_float32(default_backend):
    """Quality: int8 greedy output of the real default model agrees with float32 on most tokens; int4 (the
    shipped Q4_1 layers, an int8 LM head) runs through the same engine and agrees on the first few."""
    import lmq_backend as lmq

    src = '"<|im_start|>user\\nName three colours and say why the sky is blue.<|im_end|>\\n<|im_start|>assistant\\n[A]" ' \
          'where len(TOKENS(A)) < 33'
    texts = {}
    for dtype in ("float32", "int8", "int4"):
        backend = default_backend if dtype == "float32" else lmq.HFBackend("default", device="cpu", dtype=dtype)
        texts[dtype] = backend.tokenizer.encode((await lmq.Query(src, model=backend).run({}))["A"])
    same = sum(a == b for a, b in zip(texts["float32"], texts["int8"]))
    assert same >= 0.75 * len(texts["float32"]), texts
    assert texts["int4"][:3] == texts["float32"][:3], texts
