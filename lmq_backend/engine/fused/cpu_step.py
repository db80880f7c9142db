"""A CPU decode step's layers in one C call (`lmq_kernels.cpu.step`) instead of the layer loop's ~9 op
calls a layer (`FusedDecoder._layers`), where measurement says it is the faster on this machine.

    decoder.cpu_layers.run(decoder, bp, ...) -> bool     True: the layers ran in C; False: run the per-op loop

Why: the per-op loop makes hundreds of calls from Python a step; each costs Python, ctypes and an OpenMP
fork/join, more once the GEMMs' weights have evicted the interpreter from the caches: a large share of a small
model's step at one row. The C side runs
the same kernels' arithmetic (each row's bits as with lmq's per-op kernels), in one parallel region.

The choice: `cpu.choose("decode_layers", (threads, row bucket, weight kind, model shape), bench)`, measured
once per machine and class (cached with the other kernels' choices) on the step at hand: the bench restores
the residual stream before each run of either path, and both write the same K/V to the same column. Under
LMQ_CPU_KERNELS=1 it always runs, under 0 never (torch everywhere). The first step of a class in a process
runs the per-op loop: the per-op kernels' own first-use calibrations are not measured inside this one.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from lmq_kernels import cpu
from lmq_kernels.cpu.step import MAX_ROWS, Layer, LayerPlan, Weight, decode_layers, panel_major

from ..quantize import QuantizedLinear
from .weights import loads

__all__ = ["CpuLayers", "plan_for"]


PANELS_MAX_MEMORY = 0.1  # the float32 weights' panel-major copies take at most this share of the machine's memory


def _weight(w, panels: bool) -> Weight:
    n, k = w.shape
    if isinstance(w, QuantizedLinear):
        return Weight(n, k, q=w.qweight, scale=w.scales, zero=w.zeros)
    return Weight(n, k, w_t=w.t(), panel=panels)


def _panels_fit(decoder) -> bool:
    """Whether panel-major copies of the float32 weights (the layers' `Weight`s, the LM head: `head_panels`) fit
    PANELS_MAX_MEMORY of the machine's memory (a copy of every float32 weight), and lmq's kernels, which read
    them, run here."""
    if not cpu.available():
        return False
    weights = [w for lw in decoder.layers for w in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)] + [decoder.lm_head]
    size = sum(w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return size <= PANELS_MAX_MEMORY * memory


class CpuLayers:
    """A fused decoder's CPU step in one C call (see the module docstring), and the panel-major weight copies
    lmq's C kernels read: made at first use, and again after each load of the weights (`weights.loads()`: a
    copy is stale after one). The decoder holds one and passes itself to each call."""

    def __init__(self):
        self._made: dict[str, tuple[int, object]] = {}  # name -> (the load it was made after, it)
        self._seen: set[tuple] = set()  # the shape classes this process has stepped

    def _since_load(self, name: str, make):
        made, value = self._made.get(name, (-1, None))
        if made != loads():
            value = make()
            self._made[name] = (loads(), value)
        return value

    def head_panels(self, decoder) -> torch.Tensor | None:
        """The LM head's panel-major copy for the small-M GEMM (`cpu.small_m_mm(panels=)`), where the copies fit
        (`_panels_fit`); else (and on a GPU) None (K-major)."""
        if decoder.triton:
            return None

        def make():
            w = decoder.lm_head
            ok = isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.stride(0) == 1 and _panels_fit(decoder)
            return panel_major(w.t()) if ok else None
        return self._since_load("head", make)

    def layer_panels(self, decoder) -> list[tuple]:
        """Per layer, the panel-major copies of (qkv, o, gate/up, down) that the C step reads, for the small-M
        GEMMs of the per-op step and the prefill (`cpu.small_m_mm(panels=)`: the same bits as the K-major
        weights, streamed faster); None where a weight has none (no plan, no copies, a GPU)."""
        plan = None if decoder.triton else self._since_load("plan", lambda: plan_for(decoder))
        if plan is None:
            return [(None,) * 4] * len(decoder.layers)
        return [(ly.qkv.panels, ly.o.panels, ly.gu.panels, ly.down.panels) for ly in plan.layers]

    def run(self, decoder, bp: int, rope: tuple[torch.Tensor, torch.Tensor], first: int, end: int,
            per_op: Callable[[int], None]) -> bool:
        """Every layer of `decoder`'s CPU step for its first `bp` rows in one C call, if chosen (see the module
        docstring); False (nothing computed) otherwise. `rope`: the step's (cos, sin); `first`, `end`: the
        columns it reads from and writes at; `per_op(bp)`: the per-op loop, which calibration measures
        against."""
        if decoder.triton or bp > MAX_ROWS or not cpu.available():
            return False
        plan = self._since_load("plan", lambda: plan_for(decoder))
        if plan is None:
            return False
        threads = torch.get_num_threads()
        shape_class = (threads, cpu._up(bp), _kind(decoder), plan.hidden, plan.inter, len(plan.layers))
        if shape_class not in self._seen:   # this process's first step of the class: the per-op loop (see the top)
            self._seen.add(shape_class)
            return False
        x = decoder.x[:bp]

        def fused() -> bool:
            return decode_layers(plan, x, decoder.Hq, *rope, decoder.positions, decoder.table, decoder.start, first,
                                 end, decoder.qkv[:bp], decoder.q[:bp], decoder.attn[:bp], decoder.gu[:bp],
                                 decoder.act[:bp])

        x0 = []

        def bench():
            x0.append(x.clone())
            restore = x.copy_
            return (lambda: (restore(x0[0]), fused()), lambda: (restore(x0[0]), per_op(bp)))

        use = cpu.choose("decode_layers", shape_class, bench)
        if x0:
            x.copy_(x0[0])   # the bench left its last run's result
        return use and fused()


def plan_for(decoder) -> LayerPlan | None:
    """The decoder's layers as a `LayerPlan` (None where step.c cannot take them)."""
    panels = _panels_fit(decoder)
    layers = [Layer(lw.in_norm, lw.post_norm, lw.eps, *(_weight(w, panels) for w in (lw.wqkv, lw.wo, lw.wgu,
                                                                                   lw.wdown)),
                    decoder.k_cache[l], decoder.v_cache[l], lw.scaling, bqkv=lw.bqkv,
                    q_norm=lw.q_norm, k_norm=lw.k_norm, qk_eps=lw.qk_eps)
              for l, lw in enumerate(decoder.layers)]
    try:
        plan = LayerPlan(layers)
    except (AttributeError, TypeError, ValueError):
        return None
    return plan if plan.ok else None


def _kind(decoder) -> str:
    w = decoder.layers[0].wgu
    return w.kind if isinstance(w, QuantizedLinear) else "f32"
