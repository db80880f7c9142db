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
calibration measured it faster than the alternative; more rows (long prefills, `_long_mm`) multiply in
lmq's float32 GEMM over the weight de-quantized into panels where calibration chose it, else (or without a C
compiler) in torch's GEMM over the weight de-quantized to float32 [N, K] (`dense`: lmq's copy kernel, far
faster than torch's passes; also where calibration chose torch's GEMM over the quantized kernel). Either
float32 form is kept for the next call within a byte budget (`PanelCache`: `LMQ_QUANT_PANELS_MB`, 0 turns it
off). torch's own weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) measured many times slower than float32 `torch.mm` (benchmarks/bench_quantized.py)
and are not used. Each output of the C kernel
depends on its own input row only (one FMA chain in a fixed order), so greedy tokens are the same batched
or alone, as in float32.
"""
from __future__ import annotations

import os
import threading
import warnings
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
        KERNEL_ROWS rows 16 at a time in lmq's kernel where calibration chose it for the chunk's rows, else
        torch's GEMM on the de-quantized weight (`PANEL_CACHE`'s dense form); more (long prefills):
        `_long_mm`."""
        if bias is not None:
            out.copy_(bias.expand_as(out))
            accumulate = True
        m = a.shape[0]
        if m <= 16 and cpu.quantized_mm(a, self.qweight, self.scales, self.zeros, out, accumulate):
            return
        if m > KERNEL_ROWS:
            self._long_mm(a, out, accumulate)
            return
        if m <= 16:
            _dense_mm(a, PANEL_CACHE.get(self, "dense"), out, accumulate)
            return
        w = None
        for i in range(0, m, 16):  # a row's result is the same in every chunk
            if not cpu.quantized_mm(a[i:i + 16], self.qweight, self.scales, self.zeros, out[i:i + 16], accumulate):
                w = PANEL_CACHE.get(self, "dense") if w is None else w
                _dense_mm(a[i:i + 16], w, out[i:i + 16], accumulate)

    def _long_mm(self, a: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """out (+)= a @ W^T for a long prefill, up to cpu.GEMM_MAX_ROWS rows at a time: lmq's small-M GEMM over
        W's panels (`cpu.small_m_mm(panels=)`) where calibration chose it for the class, else torch's GEMM over
        W as float32 [N, K]. Each form comes from `PANEL_CACHE` (de-quantized at its first use, or at the model's
        load, and kept within the budget; else de-quantized for this call). At a few hundred rows (several
        chats' new turns) lmq's GEMM over panels can beat torch's on the de-quantized weight; up to 64 rows the
        quantized kernel is the faster (`mm`)."""
        n, k = self.shape
        step, w = cpu.GEMM_MAX_ROWS, None
        for i in range(0, a.shape[0], step):
            rows, o = a[i:i + step], out[i:i + step]
            if cpu.available() and cpu.choose_gemm(rows.shape[0], k, n, PANEL):
                panels = PANEL_CACHE.get(self, "panels")
                # small_m_mm's K-major operand: a view of the panels' memory, not read (they pass its checks)
                if panels is not None and cpu.small_m_mm(rows, panels.view(k, n), o, accumulate, panels=panels):
                    continue
            w = PANEL_CACHE.get(self, "dense") if w is None else w
            _dense_mm(rows, w, o, accumulate)

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
    number, else PANELS_DEFAULT_SHARE of the machine's memory (0 where that is unknown). A value that is not a
    non-negative number is ignored with a warning."""
    value = os.environ.get(PANELS_ENV, "").strip()
    if value:
        try:
            megabytes = float(value)
        except ValueError:
            megabytes = -1.0
        if megabytes >= 0:  # (False for NaN too)
            return int(megabytes * (1 << 20))
        warnings.warn(f"lmq: {PANELS_ENV}={value!r} is not a number of megabytes >= 0; the panel cache takes "
                      f"{PANELS_DEFAULT_SHARE:.0%} of the machine's memory", RuntimeWarning, stacklevel=2)
    try:
        return int(PANELS_DEFAULT_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


FORMS = ("panels", "dense")   # the float32 forms of a quantized weight that long prefills multiply with
WARM_ROWS = 256               # the load keeps the form a prefill of this many rows reads (its GEMM's choice)


class PanelCache:
    """The float32 forms of `QuantizedLinear` weights that long prefills multiply with, kept for the next one:
    "panels" ([N / PANEL, K, PANEL], lmq's GEMM) or "dense" ([N, K], torch's), each de-quantized by
    `cpu.dequantize` (torch's passes without lmq's kernels); at most `budget` bytes in all (None:
    `default_panel_budget()`, read at first use; 0: nothing is kept).

    A prefill multiplies every layer in order, each once: under a least-recently-used policy a budget smaller
    than all the layers' forms would evict each just before its next use. So the forms made first are kept and,
    once the budget is spent, the others are de-quantized for each call (panels into a reused buffer) as without
    a cache. An entry goes with its module, and is made again where the module's quantized tensors were
    changed or replaced since (a weights load). Thread-safe."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, str], tuple[tuple, torch.Tensor]] = {}  # (id(module), form) -> (stamp, w)
        self._watched: set[int] = set()   # ids of the modules whose death drops their entries
        self.used = 0          # bytes held
        self.made = 0          # forms de-quantized by `get` (kept or not)

    @property
    def budget(self) -> int:
        """The budget in bytes."""
        if self._budget is None:
            self._budget = default_panel_budget()
        return self._budget

    def set_budget(self, budget: int | None) -> None:
        """A new budget in bytes (None: the default); what was kept is dropped."""
        with self._lock:
            self._budget = None if budget is None else max(0, int(budget))
            self._entries.clear()
            self.used = 0

    def clear(self) -> None:
        """Drop everything kept (the budget stays)."""
        self.set_budget(self._budget)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _stamp(layer: "QuantizedLinear") -> tuple:
        tensors = (layer.qweight, layer.scales, layer.zeros)
        return tuple((t.data_ptr(), t._version) if t is not None else None for t in tensors)

    def _current(self, layer: "QuantizedLinear", form: str) -> torch.Tensor | None:
        entry = self._entries.get((id(layer), form))
        return entry[1] if entry is not None and entry[0] == self._stamp(layer) else None

    def panels(self, layer: "QuantizedLinear") -> torch.Tensor | None:
        """`get(layer, "panels")`."""
        return self.get(layer, "panels")

    def get(self, layer: "QuantizedLinear", form: str) -> torch.Tensor | None:
        """`layer`'s weight in `form` (FORMS): the kept copy where one is current, else de-quantized now (kept
        where it fits the budget; else panels go to this thread's reused buffer, valid until its next use).
        None for panels where n is no multiple of PANEL, or the weight is too large for a buffer and not
        kept, or lmq's kernels cannot run; a dense form always comes."""
        n, k = layer.shape
        if form == "panels" and n % PANEL:
            return None
        key, size = (id(layer), form), 4 * n * k
        with self._lock:
            current = self._current(layer, form)
            if current is not None:
                return current
            old = self._entries.get(key)
            keep = self.used - (old[1].numel() * 4 if old is not None else 0) + size <= self.budget
        if form == "panels":
            w = torch.empty(n // PANEL, k, PANEL) if keep else _panel_buffer(n, k)
            if w is None or not cpu.dequantize(layer.qweight, layer.scales, layer.zeros, w):
                return None
        else:
            w = layer.dense()
        self.made += 1
        if keep:
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self.used -= old[1].numel() * 4
                if self.used + size <= self.budget:
                    if id(layer) not in self._watched:
                        self._watched.add(id(layer))
                        weakref.finalize(layer, self._drop, id(layer))
                    self._entries[key] = (self._stamp(layer), w)
                    self.used += size
        return w

    def warm(self, layers, rows: int = WARM_ROWS) -> int:
        """Make and keep, for each of `layers` (QuantizedLinear) in order, the form a prefill of `rows` rows
        multiplies with (panels where calibration chose lmq's GEMM for the class, else dense) where it has none
        and it fits what is left of the budget (a model's load: its first long prefill then de-quantizes
        nothing); returns how many were made. Nothing is de-quantized that would not be kept."""
        made = 0
        for layer in layers:
            n, k = layer.shape
            lmq = n % PANEL == 0 and cpu.available() and cpu.choose_gemm(rows, k, n, PANEL)
            form = "panels" if lmq else "dense"
            with self._lock:
                if self._current(layer, form) is not None or self.used + 4 * n * k > self.budget:
                    continue
            made += self.get(layer, form) is not None
        return made

    def _drop(self, ident: int) -> None:
        with self._lock:
            self._watched.discard(ident)
            for form in FORMS:
                entry = self._entries.pop((ident, form), None)
                if entry is not None:
                    self.used -= entry[1].numel() * 4


# the process's cache of de-quantized weights, which every QuantizedLinear's long prefills use
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
