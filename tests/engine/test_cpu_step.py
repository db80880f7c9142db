"""A CPU decode step's layers in one C call (kernels/cpu/step.c, engine/fused/cpu_step.py) against the
per-op layer loop with lmq's kernels: the same bits (logits, every K/V written) for float32, q/k/v biases,
q/k norms, int8 and int4 weights, on every instruction-set variant this host runs; a row's bits do not
depend on the batch; the calibration measures the two paths and leaves the step's result as either gives.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lmq_backend.engine.fused import cpu_step
from lmq_backend.engine.quantize import quantize_model
from lmq_kernels import cpu
from lmq_kernels.cpu import library
from lmq_kernels.cpu.calibration import Calibration
from support.caches import paged_view
from support.cpu_targets import TARGETS
from support.fused import assert_same_forwards, prefill_then_steps

pytestmark = pytest.mark.cpu_kernels


def model_of(arch: str, seed: int = 0):
    """Head dim 64 (what the C attention takes), 2 layers, 6 query / 3 kv heads."""
    torch.manual_seed(seed)
    common = dict(vocab_size=1008, hidden_size=384, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=4096)
    if arch == "qwen2":   # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
        return model
    if arch == "qwen3":   # q/k norms
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=64, tie_word_embeddings=True)).eval()
    model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)).eval()
    if arch in ("int8", "int4"):
        quantize_model(model, arch)
    return model


@pytest.fixture
def count_fused(monkeypatch):
    """How many steps ran their layers in one C call."""
    calls = []

    run = cpu_step.CpuLayers.run

    def counting(self, *args):
        ran = run(self, *args)
        calls.append(ran)
        return ran
    monkeypatch.setattr(cpu_step.CpuLayers, "run", counting)
    return calls


def per_op(monkeypatch, model, **kw):
    with monkeypatch.context() as m:
        m.setattr(cpu_step.CpuLayers, "run", lambda self, *args: False)
        return prefill_then_steps(model, **kw)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("arch,panels", [pytest.param(a, True, id=f"{a}-panel-major")
                                         for a in ("llama", "qwen2", "qwen3", "int8", "int4")]
                         + [pytest.param(a, False, id=f"{a}-k-major")  # (quantized weights have no panels)
                            for a in ("llama", "qwen2", "qwen3")])
def test_fused_layers_give_the_per_op_steps_bits(arch, target, panels, monkeypatch, count_fused):
    if not panels:  # float32 weights read K-major (a model whose panel copies would not fit the memory bound)
        monkeypatch.setattr(cpu_step, "PANELS_MAX_MEMORY", 0)
    from lmq_kernels.cpu import step as c_step

    kinds, c = [], c_step.Weight.c
    monkeypatch.setattr(c_step.Weight, "c", lambda w: (kinds.append(c(w).kind), c(w))[1])
    lib = cpu.build(target)
    assert lib is not None, cpu.build_error(target)
    model = model_of(arch, seed=1)
    with cpu.use(lib):
        fused = prefill_then_steps(model, steps=4, seed=2)
        assert sum(count_fused) == 3, count_fused   # the first step of a class runs the per-op loop
        assert_same_forwards(fused, per_op(monkeypatch, model, steps=4, seed=2), atol=0, rtol=0)
    float32 = arch not in ("int8", "int4")
    assert (c_step.W_F32_PANELS in kinds) == (float32 and panels) and (c_step.W_F32 in kinds) == (float32 and not panels)


@pytest.mark.parametrize("arch", ["llama", "int4"])
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(arch, monkeypatch, count_fused):
    from support.fused import make_pool
    from lmq_backend.engine.fused import FusedDecoder

    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    model = model_of(arch, seed=3)
    gen = torch.Generator().manual_seed(4)
    dense = torch.randn(make_pool(model, 24, 40).shape, generator=gen)
    logits = {}
    for rows in ([2], [0, 1, 2, 3], list(range(24))):   # 24: more rows than the C step once took
        kv, table = paged_view(dense.clone())
        dec = FusedDecoder(model, kv, table[rows[0]:], max_batch=len(rows), use_graphs=False)
        starts = [3 + 2 * r for r in rows]
        for i in range(3):
            out = dec.step_host([7 + r for r in rows], starts, 30 + i)
        logits[len(rows)] = out[rows.index(2)].clone()
    assert any(count_fused[-3:])
    assert torch.equal(logits[1], logits[4]) and torch.equal(logits[1], logits[24])


def test_the_calibration_measures_both_paths_and_keeps_the_steps_result(monkeypatch, count_fused):
    model = model_of("llama", seed=5)
    monkeypatch.delenv("LMQ_CPU_KERNELS", raising=False)
    assert cpu.available()
    monkeypatch.setattr(library, "_calibration", Calibration(None, "test"))   # nothing chosen yet, nothing kept
    calibrated = prefill_then_steps(model, steps=3, seed=6)
    chosen = {name: entry for name, entry in cpu.choices().items() if name.startswith("decode_layers/")}
    assert len(chosen) == 1 and all(e["lmq_us"] > 0 and e["torch_us"] > 0 for e in chosen.values()), chosen
    use = next(iter(chosen.values()))["use"] == "lmq"
    assert count_fused == [False, use, use]
    # the bench ran the step's layers several times: each step's result is still one step's (the per-op
    # ops may have chosen torch's kernels, whose rounding differs: not bitwise)
    assert_same_forwards(calibrated, per_op(monkeypatch, model, steps=3, seed=6))


def test_declines_what_it_does_not_take(monkeypatch):
    """Head dims the C attention is not built for, more rows than the GEMMs take, LMQ_CPU_KERNELS=0."""
    from support.fused import tiny_llama

    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    calls, run = [], cpu_step.CpuLayers.run
    monkeypatch.setattr(cpu_step.CpuLayers, "run", lambda self, *args: calls.append(run(self, *args)) or calls[-1])
    prefill_then_steps(tiny_llama(), steps=3)             # head dim 16
    assert calls == [False] * 3
    calls.clear()
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    prefill_then_steps(model_of("llama"), steps=3)
    assert calls == [False] * 3


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [512, 1000, 49152 + 40])
def test_gemm_columns_past_the_register_blocks_same_bits_alone_and_batched(target, n):
    """Widths that are not a whole number of register blocks (AVX2: 24 columns) end in one-vector and scalar
    columns; a row's bits there must not depend on the batch either (GCC once left the one-row, one-vector
    instance without FMA: an output width of 512 gave one row's last 8 columns other bits alone)."""
    lib = cpu.build(target)
    assert lib is not None, cpu.build_error(target)
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn(64 if n > 4096 else 256, n, generator=gen), torch.randn(8, 64 if n > 4096 else 256, generator=gen)
    with cpu.use(lib):
        out = {}
        for m in (1, 2, 5, 8):
            out[m] = torch.empty(m, n)
            assert cpu.small_m_mm(x[:m], w, out[m])
    for m in (2, 5, 8):
        assert torch.equal(out[m][0], out[1][0]), (m, (out[m][0] != out[1][0]).nonzero().flatten()[:8].tolist())
