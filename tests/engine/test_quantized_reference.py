"""Quantized (int8 / int4) decoding end to end against an independent reference: transformers' own model, its own
attention and its own modules (`nn.Linear`, GPT-2's `Conv1D`) holding the de-quantized weights, de-quantized
here from the stored bytes by the formats' definitions (int8: q * scale; int4: GGUF's Q4_1 blocks, d * q + m),
never by lmq's code. lmq's engine runs the model `quantize_model` made, with its C kernels forced on.

The kernels multiply with exactly the de-quantized weights, in another order: the int8 GEMM reads q * scale
(one rounding, as the definition), the int4 GEMM de-quantizes in registers with a fused multiply-add where the
target has one (d q + m rounded once instead of twice: within one ulp of the definition's weight), and the
de-quantization into panels (the float32 GEMM of a long prefill) gives the definition's bits. The unit tests
check these exactly (rows of an identity matrix read a kernel's weights out one column at a time). End to
end, the tolerance is the float32 tests' (tests/backend/test_reference.py): the same greedy tokens and each
distribution within 1e-4.

Fault tests: one build of the kernels with four faults switched on one at a time (tests/support/
kernel_faults.py): a swapped nibble and a scale one ulp up, in the GEMM's 8-row blocks and in the panels. The
exact unit checks fail under each; the end-to-end comparison fails under the swapped nibbles (a one-ulp scale
moves the logits by ~1e-7, below what an end-to-end tolerance can separate from the order of the sums: the
exact checks are there for it)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmq_backend.engine.quantize import PANEL_CACHE, QuantizedLinear, quantize_model
from lmq_kernels import cpu
from support.kernel_faults import QUANTIZED_FAULT_EDITS, QUANTIZED_FAULTS, faulty_kernels, switch
from support.models import SCRIPT, build, differences, generate, run_engine, standard_calls

pytestmark = pytest.mark.cpu_kernels

KINDS = ("int8", "int4")
GROUP = 32


# ---------------------------------------------------------------------------------- the formats' definitions

def levels_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 levels [N, K] from Q4_1 blocks [N, K/2]: in each group's 16 bytes, element j < 16 is byte j's low
    nibble and element j + 16 its high nibble."""
    n = q.shape[0]
    b = q.view(n, -1, 16).to(torch.int64)
    return torch.cat([b & 15, b >> 4], dim=-1).view(n, -1)


def dequantized(kind: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                fused: bool = False) -> torch.Tensor:
    """W [N, K] float32 by the format's definition: int8 q * scale; int4 d q + m, its product rounded to float32
    and then its sum (`fused`: d q + m rounded once, as a fused multiply-add). float64 holds every product and
    sum here exactly (24-bit scales times 8-bit levels), so each `.float()` is one rounding."""
    per_weight = lambda t: t.double().repeat_interleave(GROUP, dim=1)  # noqa: E731
    if kind == "int8":
        return (q.double() * per_weight(scales)).float()
    levels, d, m = levels_int4(q).double(), per_weight(scales), per_weight(zeros)
    return (levels * d + m).float() if fused else ((levels * d).float().double() + m).float()


def quantized_weights(model) -> dict[str, tuple]:
    """name -> (kind, qweight, scales, zeros, bias) of every QuantizedLinear, copied."""
    copy_ = lambda t: None if t is None else t.detach().clone()  # noqa: E731
    return {name: (m.kind, copy_(m.qweight), copy_(m.scales), copy_(m.zeros), copy_(m.bias))
            for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def reference_model(model) -> torch.nn.Module:
    """transformers' model of `model`'s config (untied: the LM head is quantized, the embeddings are not),
    sdpa attention, its own modules holding the de-quantized weights and `model`'s float ones. Call before
    lmq sees `model`."""
    weights = quantized_weights(model)
    floats = {k: v.detach().clone() for k, v in model.state_dict().items()
              if not any(k.startswith(name + ".") for name in weights)}
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    state = dict(floats)
    for name, (kind, q, scales, zeros, bias) in weights.items():
        w = dequantized(kind, q, scales, zeros)
        conv1d = type(reference.get_submodule(name)).__name__ == "Conv1D"  # GPT-2: x @ W + b, W [K, N]
        state[f"{name}.weight"] = w.t().contiguous() if conv1d else w
        if bias is not None:
            state[f"{name}.bias"] = bias
    reference.load_state_dict(state, strict=True)
    return reference.eval()


# --------------------------------------------------------------------------------- the kernels, exactly

def kernel_mismatches(kind: str) -> list[str]:
    """Where lmq's C kernels do not read exactly the definition's weights (empty: they do): the GEMM at 1, 3, 8
    and 16 rows (the 8-row blocks, the smaller ones, two passes of 8), fed the rows of an identity matrix, and
    the de-quantization into panels and into [N, K]."""
    torch.manual_seed(5)
    n, k = 128, 96
    lin = QuantizedLinear.quantize(torch.randn(n, k) * 0.05, None, kind)
    q, scales, zeros = lin.qweight, lin.scales, lin.zeros
    exact, fused = dequantized(kind, q, scales, zeros), dequantized(kind, q, scales, zeros, fused=True)
    out = []
    for m in (1, 3, 8, 16):
        read = torch.empty(k, n)
        eye = torch.eye(k)
        for k0 in range(0, k, m):
            rows = eye[k0:k0 + m].contiguous()
            assert cpu.quantized_mm(rows, q, scales, zeros, read[k0:k0 + m]), "the GEMM declined its operands"
        # int8: the definition's bits; int4: the definition's or, with a fused multiply-add, the fused ones
        if not (torch.equal(read.t(), exact) or (kind == "int4" and torch.equal(read.t(), fused))):
            bad = (read.t() != exact).sum().item()
            out.append(f"GEMM at {m} rows: {bad} of {n * k} weights")
    panels = torch.empty(n // 64, k, 64)
    assert cpu.dequantize(q, scales, zeros, panels)
    if not torch.equal(panels.permute(1, 0, 2).reshape(k, n).t(), exact):
        out.append("panels")
    dense = torch.empty(n, k)
    assert cpu.dequantize(q, scales, zeros, dense)
    if not torch.equal(dense, exact):
        out.append("dense")
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernels_read_the_definitions_weights(kind):
    lib = cpu.build()
    assert lib is not None, cpu.build_error()
    with cpu.use(lib):
        assert kernel_mismatches(kind) == []


def test_the_definition_reads_the_shipped_layout():
    """The reference's de-quantization against a hand-made int4 block and int8 row (not lmq's code)."""
    q = torch.zeros(1, 16, dtype=torch.uint8)
    q[0, 0], q[0, 15] = 0x21, 0xF0              # element 0: 1, element 16: 2; element 15: 0, element 31: 15
    w = dequantized("int4", q, torch.tensor([[0.5]]), torch.tensor([[-1.0]]))
    assert w[0, 0] == -0.5 and w[0, 16] == 0.0 and w[0, 15] == -1.0 and w[0, 31] == 6.5
    q8 = torch.arange(-16, 16, dtype=torch.int8).view(1, 32)
    assert torch.equal(dequantized("int8", q8, torch.tensor([[0.25]]), None), q8.float() * 0.25)


# ----------------------------------------------------------------------------------------- end to end

def calls() -> list[dict]:
    """14 calls: decode steps of more than 8 rows batched (the GEMM's 8-row blocks), prompts of ~90 tokens (a
    prefill of more than 64 rows: the float32 GEMM over panels)."""
    return standard_calls(0) + standard_calls(1)


def expected(zoo, family: str, kind: str):
    """(lmq's quantized model, not yet seen by lmq; the reference's answers, its holes by `generate`)."""
    key = ("quantized reference", family, kind)
    if key not in zoo.memo:
        model = build(family)
        assert quantize_model(model, kind) > 0
        reference = reference_model(model)
        zoo.memo[key] = (model, [SCRIPT.reference(reference, zoo.tokenizer, c, fill=generate) for c in calls()])
    return zoo.memo[key]


async def engine_differences(zoo, family: str, kind: str) -> list[str]:
    """Where lmq's engine (cache on, the calls at once with random arrival) differs from the reference. (Alone
    or batched, cache on or off, give the same within a dtype: tests/engine/test_quantized.py.)"""
    from lmq_backend.backend.hf import HFBackend

    model, want = expected(zoo, family, kind)
    backend = HFBackend.from_model(model, zoo.tokenizer, cache_budget="64MB", name=f"{family}-{kind}")
    steps = []
    backend.on_step(steps.append)
    out = differences(await run_engine(backend, SCRIPT, calls(), batched=True, seed=6), want)
    assert max(s.batch_size for s in steps if s.kind == "decode") >= 8
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
async def test_quantized_greedy_tokens_equal_the_dequantized_reference(zoo, monkeypatch, family, kind):
    """The fused step (Llama family; Qwen2's biases and tied embeddings) and the model's own forward (GPT-2's
    Conv1D), with lmq's kernels wherever they take the operands."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert await engine_differences(zoo, family, kind) == []


async def test_quantized_with_torchs_ops_equals_the_dequantized_reference(zoo, monkeypatch):
    """LMQ_CPU_KERNELS=0 (as without a C compiler): the weight de-quantized for each call and torch's GEMM."""
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    assert await engine_differences(zoo, "llama", "int4") == []


# --------------------------------------------------------------------------------------------- faults

@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return faulty_kernels(tmp_path_factory.mktemp("quantized-faults"), QUANTIZED_FAULT_EDITS)


@pytest.mark.parametrize("fault", QUANTIZED_FAULTS)
def test_the_exact_checks_catch_each_fault(faulty, fault):
    kinds = ("int4",) if "nibble" in fault else KINDS
    with cpu.use(faulty):
        switch(faulty, 0)
        assert all(kernel_mismatches(kind) == [] for kind in kinds)  # the faulty build, its faults off
        switch(faulty, QUANTIZED_FAULTS[fault])
        try:
            for kind in kinds:
                found = kernel_mismatches(kind)
                assert found and all(("panels" in f) == fault.startswith("panels") for f in found), (kind, found)
        finally:
            switch(faulty, 0)


@pytest.mark.parametrize("fault", ["8-row nibble", "panels nibble"])
async def test_the_end_to_end_comparison_catches_a_swapped_nibble(zoo, faulty, fault):
    """(The panel cache off: a prefill's panels are de-quantized by the faulty build, not kept from before.)"""
    with cpu.use(faulty):
        switch(faulty, QUANTIZED_FAULTS[fault])
        PANEL_CACHE.set_budget(0)
        try:
            assert await engine_differences(zoo, "llama", "int4") != []
        finally:
            switch(faulty, 0)
            PANEL_CACHE.set_budget(None)
