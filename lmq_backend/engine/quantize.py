"""Weight-only quantized linear layers for the CPU: int8 and int4, a scale per group of 32 weights along K.

`QuantizedLinear` replaces a model's `nn.Linear` (or GPT-2's `Conv1D`) modules (`quantize_model`); the
model's own forward (prefills, non-Llama models) calls it like the module it replaced, and the fused decode
step (`fused/weights.py`, `fused/ops.py`) multiplies with it through `mm`:

    int8   w = d[n, g] * q                   q in -127..127 (GGUF's Q8_0 values)        g = k / 32
    int4   w = d[n, g] * q + m[n, g]          q in 0..15 (GGUF's Q4_1 values)

stored in panels of 16 outputs (lmq_kernels/cpu_qgemm.c). The product rounds x to int8 per group of 32 (W8A8 /
W4A8, as llama.cpp multiplies Q8_0 / Q4_1 weights with Q8 activations) and sums integers: lmq's kernel for
every row count (decode steps and prefills), or torch's ops with the same bits where there is no C compiler
(`lmq_kernels.cpu.qgemm`). Measured against the float kernels it replaced (x float32, the weight de-quantized in
registers; long prefills de-quantized the weight for torch's GEMM): an int4 model's layers 1.9x (one row) and
2.5x (eight rows) faster, prefills 3x (benchmarks/RESULTS.md). torch's own weight-only kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) were measured 20-40x slower than float32 `torch.mm` on an
AVX2 host (benchmarks/bench_quantized.py) and are not used. Each output depends on its own input row only, so
greedy tokens are the same batched or alone, as in float32.

The int4 values are GGUF's Q4_1, so the default model's shipped weights load as they are
(`backend/gguf_weights.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from lmq_kernels import cpu

QUANTIZED_DTYPES = ("int8", "int4")
GROUP_SIZE = 32  # weights per scale (and int4 offset) along K, as GGUF's Q8_0 and Q4_1


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [N, K] stored int8 or int4 (see the module docstring); x float32 [..., K].
    Buffers: `cpu.QWeight`'s panels: qweight, scales (d), zeros (int4's m) or sums (int8's group sums of q)."""

    def __init__(self, packed: cpu.QWeight, bias: torch.Tensor | None):
        super().__init__()
        assert packed.ok(), (packed.q.shape, packed.d.shape, packed.n)
        self.kind = "int4" if packed.bits == 4 else "int8"
        self.in_features, self.out_features = packed.k, packed.n
        self.register_buffer("qweight", packed.q)
        self.register_buffer("scales", packed.d)
        self.register_buffer("zeros", packed.m)
        self.register_buffer("sums", packed.sums)
        self.register_buffer("bias", bias)

    @property
    def packed(self) -> cpu.QWeight:
        return cpu.QWeight(self.qweight, self.scales, self.zeros, self.sums, self.out_features)

    @property
    def shape(self) -> tuple[int, int]:
        """The de-quantized weight's shape, [N, K] (as a Linear's `weight.shape`)."""
        return self.out_features, self.in_features

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"

    def levels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K], d [N, K/32], m [N, K/32] for int4 else None)."""
        return cpu.unpack(self.packed)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (d q + m rounded twice, no FMA)."""
        n, k = self.shape
        q, d, m = self.levels()
        w = q.float().view(n, k // GROUP_SIZE, GROUP_SIZE).mul_(d[..., None])
        return (w if m is None else w.add_(m[..., None])).view(n, k)

    def mm(self, a: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
           bias: torch.Tensor | None = None) -> None:
        """The fused step's GEMM: out = a @ W^T (+ bias), or out += a @ W^T; a [M, K], out [M, N], any M."""
        if bias is not None:
            out.copy_(bias.expand_as(out))
            accumulate = True
        cpu.qgemm(a, self.packed, out, accumulate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features).float().contiguous()
        y = a.new_empty(a.shape[0], self.out_features)
        self.mm(a, y, bias=self.bias)
        return y.view(*lead, self.out_features).to(x.dtype)

    # -------------------------------------------------------------------------------- making them

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> "QuantizedLinear":
        """Quantize a float weight [N, K] per group of 32 along K: int8 symmetric (d = max |w| / 127, as
        GGUF's Q8_0), int4 asymmetric (d = (max - min) / 15, m = min, as Q4_1)."""
        w = weight.detach().float()
        n, k = w.shape
        b = None if bias is None else bias.detach().float().clone()
        tiny = torch.finfo(torch.float32).tiny
        if kind not in QUANTIZED_DTYPES:
            raise ValueError(f"unknown quantized dtype {kind!r}: use one of {QUANTIZED_DTYPES}")
        g = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
        if kind == "int8":
            d = (g.abs().amax(-1) / 127).clamp_min(tiny)
            q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
            return cls.from_levels(q, d, None, b)
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).clamp_min(tiny)
        q = torch.round((g - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
        return cls.from_levels(q, d, lo, b)

    @classmethod
    def from_levels(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                    bias: torch.Tensor | None = None) -> "QuantizedLinear":
        """w = d q (+ m): levels q [N, K] (int8 -127..127, or int4 0..15 where m is given), d and m [N, K / 32]."""
        n, k = q.shape
        assert d.shape == (n, k // GROUP_SIZE) and (m is None or m.shape == d.shape), (q.shape, d.shape)
        return cls(cpu.pack(q, d, m), bias)

    @classmethod
    def stack(cls, modules: list["QuantizedLinear"]) -> "QuantizedLinear":
        """One module computing the modules' outputs side by side (their weights concatenated along N): the
        fused step's q/k/v and gate/up projections. A copy; biases are zeros where one has none."""
        first = modules[0]
        assert all(m.kind == first.kind and m.in_features == first.in_features for m in modules)
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules])
        if all(mod.out_features % cpu.QWeight.PANEL == 0 for mod in modules):   # whole panels: side by side
            cat = lambda name: None if getattr(first, name) is None else torch.cat(  # noqa: E731
                [getattr(mod, name) for mod in modules])
            n = sum(mod.out_features for mod in modules)
            return cls(cpu.QWeight(cat("qweight"), cat("scales"), cat("zeros"), cat("sums"), n), bias)
        levels = [mod.levels() for mod in modules]
        q, d = torch.cat([v[0] for v in levels]), torch.cat([v[1] for v in levels])
        m = None if first.kind == "int8" else torch.cat([v[2] for v in levels])
        return cls.from_levels(q, d, m, bias)


def quantize_model(model, kind: str) -> int:
    """Replace the model's `nn.Linear` and GPT-2 `Conv1D` modules (the LM head included) by `QuantizedLinear`
    of `kind` ("int8" or "int4"), in place; embeddings and norms stay float32. A layer whose K is not a multiple
    of 32 stays float. The model must be float32 on the CPU. Returns how many were replaced."""
    if kind not in QUANTIZED_DTYPES:
        raise ValueError(f"unknown quantized dtype {kind!r}: use one of {QUANTIZED_DTYPES}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = _float_weight(child)
            if weight is None or weight.shape[1] % GROUP_SIZE:
                continue
            setattr(parent, name, QuantizedLinear.quantize(weight, child.bias, kind))
            replaced += 1
    return replaced


def _float_weight(module) -> torch.Tensor | None:
    """A Linear's weight [N, K] (a Conv1D's, transposed), or None for any other module."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D" and module.weight.dim() == 2:  # transformers' GPT-2 layer: x @ W + b
        return module.weight.t()
    return None


def is_quantized(model) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())
