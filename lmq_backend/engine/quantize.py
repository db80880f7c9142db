"""Weight-only quantized linear layers for the CPU: int8 and int4, a scale per group of 32 weights along K.

`QuantizedLinear` replaces a model's `nn.Linear` (or GPT-2's `Conv1D`) modules (`quantize_model`); the
model's own forward (prefills, non-Llama models) calls it like the module it replaced, and the fused decode
step (`fused/weights.py`, `fused/ops.py`) multiplies with it through `mm`. Activations stay float32; only
the weights are stored small:

    int8   w = q * scale[n, g]               q int8 [N, K], scale [N, K/32]: g = k / 32
    int4   w = d[n, g] * q + m[n, g]          q in 0..15, 2 a byte [N, K/2] in GGUF's Q4_1 block order
                                             (kernels/cpu/qgemm.c), d and m [N, K/32]: g = k / 32

The int4 form is GGUF's Q4_1, so the default model's shipped weights load as they are
(`backend/gguf_weights.py`). Up to 64 rows (decode steps, short prefills) multiply in lmq's C kernel
(`lmq_kernels.cpu.quantized_mm`, 16 rows a call), which de-quantizes in registers, where the machine's
calibration measured it faster than the alternative; more rows (long prefills) multiply in lmq's float32 GEMM
over the weight de-quantized into panels (`_panels_mm`) where calibration chose it, the panels kept for the
next prefill within a byte budget (`PanelCache`: `LMQ_QUANT_PANELS_MB`, 0 turns it off); the alternative, or
no C compiler, de-quantize the weight to float32 for that call (`dense`: lmq's copy kernel, far faster than
torch's passes) and use torch's GEMM. torch's own weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) measured many times slower than float32 `torch.mm` (benchmarks/bench_quantized.py)
and are not used. Each output of the C kernel
depends on its own input row only (one FMA chain in a fixed order), so greedy tokens are the same batched
or alone, as in float32.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch
from torch import nn

from lmq_kernels import cpu
from lmq_kernels.cpu.step import PANEL

QUANTIZED_DTYPES = ("int8", "int4")
GROUP_SIZE = 32  # int4 weights per (d, m) pair along K, as GGUF's Q4_1
# Up to this many rows (decode steps, short prefills) multiply in lmq's kernel, 16 rows a call; more
# (long prefills) de-quantize the weight once for the call and use torch's GEMM
KERNEL_ROWS = 64


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [N, K] stored int8 or int4 (see the module docstring); x float32 [..., K]."""

    def __init__(self, kind: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int):
        super().__init__()
        assert kind in QUANTIZED_DTYPES and (zeros is None) == (kind == "int8"), kind
        self.kind, self.in_features = kind, int(in_features)
        self.register_buffer("qweight", qweight.contiguous())   # int8 [N, K] | uint8 [N, K/2]
        self.register_buffer("scales", scales.contiguous())     # [N, K/32] | d [N, K/32]
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous())  # m [N, K/32]
        self.register_buffer("bias", bias)
        self.out_features = int(qweight.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """The de-quantized weight's shape, [N, K] (as a Linear's `weight.shape`)."""
        return self.out_features, self.in_features

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]."""
        n, k = self.shape
        if self.kind == "int8":
            return (self.qweight.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * self.scales[..., None]).view(n, k)
        b = self.qweight.view(n, k // GROUP_SIZE, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()                             # [N, K/32, 32]
        return q.mul_(self.scales[..., None]).add_(self.zeros[..., None]).view(n, k)  # rounded twice, no FMA

    def dense(self) -> torch.Tensor:
        """W as float32 [N, K], a new tensor: lmq's de-quantizing copy (qgemm.c, the same bits as
        `dequantize`), torch's passes where it cannot run."""
        w = torch.empty(self.shape)
        if not cpu.dequantize(self.qweight, self.scales, self.zeros, w):
            w = self.dequantize()
        return w

    def mm(self, a: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
           bias: torch.Tensor | None = None) -> None:
        """The fused step's GEMM: out = a @ W^T (+ bias), or out += a @ W^T; a [M, K], out [M, N]. Up to
        KERNEL_ROWS rows 16 at a time in lmq's kernel where calibration chose it for the chunk's rows; more
        (long prefills) in lmq's float32 GEMM over the weight de-quantized into panels (`_panels_mm`); else
        torch's GEMM on the de-quantized weight."""
        if bias is not None:
            out.copy_(bias.expand_as(out))
            accumulate = True
        m = a.shape[0]
        if m <= 16 and cpu.quantized_mm(a, self.qweight, self.scales, self.zeros, out, accumulate):
            return
        if m > KERNEL_ROWS and self._panels_mm(a, out, accumulate):
            return
        if not 16 < m <= KERNEL_ROWS:
            _dense_mm(a, self.dense(), out, accumulate)
            return
        w = None
        for i in range(0, m, 16):  # a row's result is the same in every chunk
            if not cpu.quantized_mm(a[i:i + 16], self.qweight, self.scales, self.zeros, out[i:i + 16], accumulate):
                w = self.dense() if w is None else w
                _dense_mm(a[i:i + 16], w, out[i:i + 16], accumulate)

    def _panels_mm(self, a: torch.Tensor, out: torch.Tensor, accumulate: bool) -> bool:
        """out (+)= a @ W^T with W de-quantized into panels (`cpu.dequantize`, one pass) and lmq's small-M GEMM
        over them (`cpu.small_m_mm(panels=)`, up to cpu.GEMM_MAX_ROWS rows a call, where
        calibration chose it for the class), a chunk torch's GEMM on the de-quantized weight where it did not.
        The panels come from `PANEL_CACHE` (made at this weight's first such call and kept, within its budget),
        else are de-quantized into a reused buffer for this call. False (nothing computed) where the panels
        cannot be made. At a few hundred rows (several chats' new turns) faster than torch's GEMM on the
        de-quantized weight; up to 64 rows the quantized kernel is faster (the panels' transposing copy costs
        more than it saves there)."""
        panels = PANEL_CACHE.panels(self)
        if panels is None:
            return False
        n, k = self.shape
        shape_only = panels.view(k, n)   # small_m_mm's K-major operand: not read, the panels pass its checks
        step, w = cpu.GEMM_MAX_ROWS, None
        for i in range(0, a.shape[0], step):
            if not cpu.small_m_mm(a[i:i + step], shape_only, out[i:i + step], accumulate, panels=panels):
                w = self.dense() if w is None else w
                _dense_mm(a[i:i + step], w, out[i:i + step], accumulate)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features).float().contiguous()
        y = a.new_empty(a.shape[0], self.out_features)
        self.mm(a, y, bias=self.bias)
        return y.view(*lead, self.out_features).to(x.dtype)

    # -------------------------------------------------------------------------------- making them

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> "QuantizedLinear":
        """Quantize a float weight [N, K] per group of 32 along K: int8 symmetric (scale = max |w| / 127, as
        GGUF's Q8_0), int4 asymmetric (d = (max - min) / 15, m = min, as Q4_1)."""
        w = weight.detach().float()
        n, k = w.shape
        b = None if bias is None else bias.detach().float().clone()
        tiny = torch.finfo(torch.float32).tiny
        if kind not in QUANTIZED_DTYPES:
            raise ValueError(f"unknown quantized dtype {kind!r}: use one of {QUANTIZED_DTYPES}")
        g = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
        if kind == "int8":
            scale = (g.abs().amax(-1) / 127).clamp_min(tiny)
            q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
            return cls("int8", q, scale, None, b, k)
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).clamp_min(tiny)
        q = torch.round((g - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
        return cls.from_q4_1(q, d, lo, b)

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  bias: torch.Tensor | None = None) -> "QuantizedLinear":
        """int4 weights w = d q + m: q levels 0..15 [N, K] (one a byte), d and m float [N, K / 32]."""
        n, k = q.shape
        assert d.shape == m.shape == (n, k // GROUP_SIZE), (q.shape, d.shape, m.shape)
        g = q.to(torch.uint8).view(n, k // GROUP_SIZE, GROUP_SIZE)
        packed = g[..., :16] | (g[..., 16:] << 4)                                   # Q4_1's byte order
        return cls("int4", packed.reshape(n, k // 2), d.float(), m.float(), bias, k)

    @classmethod
    def stack(cls, modules: list["QuantizedLinear"]) -> "QuantizedLinear":
        """One module computing the modules' outputs side by side (their weights concatenated along N): the
        fused step's q/k/v and gate/up projections. A copy; biases are zeros where one has none."""
        first = modules[0]
        assert all(m.kind == first.kind and m.in_features == first.in_features for m in modules)
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules])
        zeros = None if first.kind == "int8" else torch.cat([m.zeros for m in modules])
        return cls(first.kind, torch.cat([m.qweight for m in modules]), torch.cat([m.scales for m in modules]),
                   zeros, bias, first.in_features)


_panels = threading.local()   # per thread: (n, k) -> a float32 [n / PANEL, k, PANEL] buffer, reused
PANEL_BUFFER_MAX = 64 << 20   # bytes: a larger weight (an LM head) de-quantizes for torch's GEMM instead
PANELS_ENV = "LMQ_QUANT_PANELS_MB"
PANELS_DEFAULT_SHARE = 0.1    # the default budget: this share of the machine's memory (as the float32 panels')


def _panel_buffer(n: int, k: int) -> torch.Tensor | None:
    """This thread's buffer for an [n, k] weight's panels (None where n is no multiple of PANEL or it is too
    large to keep): kept, so that a prefill does not fault in fresh pages for every layer's weights."""
    if n % PANEL or 4 * n * k > PANEL_BUFFER_MAX:
        return None
    buffers = _panels.__dict__.setdefault("by_shape", {})
    if (n, k) not in buffers:
        buffers[(n, k)] = torch.empty(n // PANEL, k, PANEL)
    return buffers[(n, k)]


def default_panel_budget() -> int:
    """The panel cache's budget in bytes: `LMQ_QUANT_PANELS_MB` (megabytes; 0 turns the cache off) where it is a
    number, else PANELS_DEFAULT_SHARE of the machine's memory (0 where that is unknown)."""
    value = os.environ.get(PANELS_ENV, "").strip()
    if value:
        try:
            return max(0, int(float(value) * (1 << 20)))
        except ValueError:
            pass
    try:
        return int(PANELS_DEFAULT_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class PanelCache:
    """De-quantized panels ([N / PANEL, K, PANEL] float32, `cpu.dequantize`) of `QuantizedLinear` weights, kept
    for their next long prefill, at most `budget` bytes in all (None: `default_panel_budget()`, read at first
    use; 0: nothing is kept).

    A prefill multiplies every layer in order, each once: under a least-recently-used policy a budget smaller
    than all the layers' panels would evict each layer's panels just before their next use. So the panels made
    first are kept and, once the budget is spent, the others are de-quantized for each call (into a reused
    buffer) as without a cache. An entry goes with its module, and is made again where the module's
    quantized tensors were changed or replaced since (a weights load). Thread-safe."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[tuple, torch.Tensor]] = {}   # id(module) -> (its tensors' stamp, panels)
        self.used = 0          # bytes held
        self.made = 0          # panels de-quantized by `panels` (kept or not)

    @property
    def budget(self) -> int:
        """The budget in bytes."""
        if self._budget is None:
            self._budget = default_panel_budget()
        return self._budget

    def set_budget(self, budget: int | None) -> None:
        """A new budget in bytes (None: the default); the panels kept are dropped."""
        with self._lock:
            self._budget = None if budget is None else max(0, int(budget))
            self._entries.clear()
            self.used = 0

    def clear(self) -> None:
        """Drop every kept panel (the budget stays)."""
        self.set_budget(self._budget)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _stamp(layer: "QuantizedLinear") -> tuple:
        tensors = (layer.qweight, layer.scales, layer.zeros)
        return tuple((t.data_ptr(), t._version) if t is not None else None for t in tensors)

    def panels(self, layer: "QuantizedLinear") -> torch.Tensor | None:
        """`layer`'s weight as panels: the kept copy where one is current, else de-quantized now (kept where it
        fits the budget, else into this thread's reused buffer, valid until its next use). None where n is no
        multiple of PANEL, or the weight is too large for a buffer and not kept, or lmq's kernels cannot run."""
        n, k = layer.shape
        if n % PANEL:
            return None
        key, stamp, size = id(layer), self._stamp(layer), 4 * n * k
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == stamp:
                return entry[1]
            keep = self.used - (entry[1].numel() * 4 if entry is not None else 0) + size <= self.budget
        panels = torch.empty(n // PANEL, k, PANEL) if keep else _panel_buffer(n, k)
        if panels is None or not cpu.dequantize(layer.qweight, layer.scales, layer.zeros, panels):
            return None
        self.made += 1
        if keep:
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self.used -= old[1].numel() * 4
                if self.used + size <= self.budget:
                    if old is None:
                        weakref.finalize(layer, self._drop, key)
                    self._entries[key] = (stamp, panels)
                    self.used += size
        return panels

    def warm(self, layers) -> int:
        """Make and keep the panels of each of `layers` (QuantizedLinear) that has none and fits what is left of
        the budget, in order (a model's load: its first long prefill then de-quantizes nothing); returns how
        many were made. Nothing is de-quantized that would not be kept."""
        made = 0
        for layer in layers:
            n, k = layer.shape
            with self._lock:
                entry = self._entries.get(id(layer))
                if n % PANEL or (entry is not None and entry[0] == self._stamp(layer)) \
                        or self.used + 4 * n * k > self.budget:
                    continue
            made += self.panels(layer) is not None
        return made

    def _drop(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used -= entry[1].numel() * 4


# the process's panel cache, which every QuantizedLinear's long prefills use
PANEL_CACHE = PanelCache()


def _dense_mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, w.t())
    else:
        torch.mm(a, w.t(), out=out)


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
