"""A CPU decode step's layers in one C call (`lmq_kernels.cpu.step`) instead of the layer loop's ~9 op
calls a layer (`FusedDecoder._layers`), where measurement says it is the faster on this machine.

    decoder.cpu_layers.run(decoder, bp, ...) -> bool     True: the layers ran in C; False: run the per-op loop
    step_class(bp, kind, hidden, inter, layers) -> tuple   the calibration's class of a step of bp rows

Why: the per-op loop makes hundreds of calls from Python a step; each costs Python, ctypes and an OpenMP
fork/join, more once the GEMMs' weights have evicted the interpreter from the caches: a large share of a small
model's step at one row. The C side runs the same kernels' arithmetic (each row's bits as with lmq's per-op
kernels), in one parallel region.

The choice: `cpu.choose("decode_layers", (threads, row bucket, weight kind, model shape), bench)`, measured
once per machine and class (cached with the other kernels' choices) on the step at hand: the bench restores
the residual stream before each run of either path, and both write the same K/V to the same column. Under
LMQ_CPU_KERNELS=1 it always runs, under 0 never (torch everywhere). The first step of a class in a process
runs the per-op loop: the per-op kernels' own first-use calibrations are not measured inside this one.

The panel-major copies of the weights are made once per model (and weights load), not per decoder: a growable
CPU pool rebuilds its decoder whenever its page table grows, as a batch larger than any before arrives.
cpu_warm_up.py measures both kinds of classes when the model is laid out, so that its queries' calls take
measured choices.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from lmq_kernels import cpu
from lmq_kernels.cpu.step import MAX_ROWS, Layer, LayerPlan, Weight, decode_layers, panel_major

from ..quantize import QuantizedLinear
from .weights import decoder_weights, loads

__all__ = ["CpuLayers", "plan_for", "step_class", "weights_kind", "panels_fit", "head_panels_fit", "make_panels"]


PANELS_MAX_MEMORY = 0.1  # the float32 weights' panel-major copies take at most this share of the machine's memory


def _weight(w, panels: bool) -> Weight:
    n, k = w.shape
    if isinstance(w, QuantizedLinear):
        return Weight(n, k, q=w.qweight, scale=w.scales, zero=w.zeros)
    return Weight(n, k, w_t=w.t(), panel=panels)


def panels_fit(laid_out) -> bool:
    """Whether panel-major copies of the float32 weights of `laid_out` (a model's `decoder_weights`: the layers'
    `Weight`s, the LM head: `head_panels`) fit PANELS_MAX_MEMORY of the machine's memory (a copy of every
    float32 weight), and lmq's kernels, which read them, run here."""
    if not cpu.available():
        return False
    weights = [w for lw in laid_out.layers for w in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)] + [laid_out.lm_head]
    size = sum(w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return size <= PANELS_MAX_MEMORY * memory


def head_panels_fit(laid_out) -> bool:
    """Whether the LM head of `laid_out` gets a panel-major copy (a float32 K-major head, `panels_fit`)."""
    w = laid_out.lm_head
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.stride(0) == 1 and panels_fit(laid_out)


def _since_load(owner, name: str, make):
    """`owner`'s `name`, made by `make()` at first use and again after each load (`weights.loads()`): what
    holds copies of the weights (panel-major) is stale after one."""
    made, value = owner.__dict__.get(name, (-1, None))
    if made != loads():
        value = make()
        setattr(owner, name, (loads(), value))
    return value


def _layer_weights(laid_out) -> list[tuple[Weight, Weight, Weight, Weight]]:
    """Per layer, (qkv, o, gate/up, down) as the C step's `Weight`s, with panel-major copies where they fit: made
    once per model (and load)."""
    def make():
        panels = panels_fit(laid_out)
        return [tuple(_weight(w, panels) for w in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)) for lw in laid_out.layers]
    return _since_load(laid_out, "_cpu_weights", make)


def _head_panels(laid_out) -> torch.Tensor | None:
    return _since_load(laid_out, "_head_panels",
                       lambda: panel_major(laid_out.lm_head.t()) if head_panels_fit(laid_out) else None)


def make_panels(model) -> None:
    """The panel-major weight copies of `model` that lmq's C kernels read, made now (at the model's load)
    rather than inside its first query's call."""
    laid_out = decoder_weights(model)
    _layer_weights(laid_out)
    _head_panels(laid_out)


class CpuLayers:
    """A fused decoder's CPU step in one C call (see the module docstring), and the panel-major weight copies
    lmq's C kernels read: made at first use, and again after each load of the weights (`weights.loads()`: a
    copy is stale after one), once per model. The decoder holds one (its plan, over the decoder's K/V) and passes
    itself to each call."""

    def _plan(self, decoder) -> LayerPlan | None:
        return _since_load(self, "_cpu_plan", lambda: plan_for(decoder))

    def head_panels(self, decoder) -> torch.Tensor | None:
        """The LM head's panel-major copy for the small-M GEMM (`cpu.small_m_mm(panels=)`), where the copies fit
        (`panels_fit`); else (and on a GPU) None (K-major). One per model, whatever decoder asks."""
        if decoder.triton:
            return None
        return _head_panels(decoder_weights(decoder.model))

    def layer_panels(self, decoder) -> list[tuple]:
        """Per layer, the panel-major copies of (qkv, o, gate/up, down) that the C step reads, for the small-M
        GEMMs of the per-op step and the prefill (`cpu.small_m_mm(panels=)`: the same bits as the K-major
        weights, streamed faster); None where a weight has none (no plan, no copies, a GPU)."""
        plan = None if decoder.triton else self._plan(decoder)
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
        plan = self._plan(decoder)
        if plan is None:
            return False
        # the shape classes this process has stepped, per model (a rebuilt decoder's first steps are not firsts)
        seen = decoder_weights(decoder.model).__dict__.setdefault("_cpu_plan_seen", set())
        shape_class = step_class(bp, weights_kind(decoder), plan.hidden, plan.inter, len(plan.layers))
        if shape_class not in seen:   # this process's first step of the class: the per-op loop (see the top)
            seen.add(shape_class)
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
    weights = _layer_weights(decoder_weights(decoder.model))
    layers = [Layer(lw.in_norm, lw.post_norm, lw.eps, *weights[l],
                    decoder.k_cache[l], decoder.v_cache[l], lw.scaling, bqkv=lw.bqkv,
                    q_norm=lw.q_norm, k_norm=lw.k_norm, qk_eps=lw.qk_eps)
              for l, lw in enumerate(decoder.layers)]
    try:
        plan = LayerPlan(layers)
    except (AttributeError, TypeError, ValueError):
        return None
    return plan if plan.ok else None


def weights_kind(laid_out) -> str:
    """"f32", or the kind of the layers' weight-only quantized weights ("int8", "int4")."""
    w = laid_out.layers[0].wgu
    return w.kind if isinstance(w, QuantizedLinear) else "f32"


def step_class(bp: int, kind: str, hidden: int, inter: int, layers: int) -> tuple:
    """The calibration's class of a step of `bp` rows: threads, row bucket, weight kind, the model's shape."""
    return (torch.get_num_threads(), cpu.size_class(bp), kind, hidden, inter, layers)
