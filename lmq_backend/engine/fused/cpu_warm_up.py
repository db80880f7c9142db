"""The CPU kernels' choices for a model, its weights' panel-major copies and a quantized model's weights
de-quantized for its long prefills, made when it is laid out rather than inside its first queries.

    warm_up(model, rows=WARM_UP_ROWS) -> int    the classes measured now (0: this machine had them all)

Calibration (`lmq_kernels.cpu`) measures a class of operands only here, or for an op with no measured class at
all; a query's call meeting a class not measured takes its nearest measured neighbour's choice. So this
measures what the model's steps meet: the per-op kernels' classes of decode steps of 1 to `rows` rows and of
prefills (`lmq_kernels.cpu.warm_up`, on representative operands of the model's shapes), and the choice
between the one-call C step and the per-op loop (`cpu_step.CpuLayers.run`) at each row bucket, on decode steps
of a scratch decoder: its own small K/V store and page tables, the model's weights. What this machine measured
before is not measured again: a machine's first load of a model shape costs seconds, later loads nothing.
"""
from __future__ import annotations

import torch

from lmq_kernels import cpu

from ...paths import cache_dir
from ..quantize import PANEL_CACHE, QuantizedLinear
from .cpu_step import head_panels_fit, make_panels, panels_fit, plan_for, step_class, weights_kind
from .decoder import FusedDecoder
from .weights import decoder_weights

__all__ = ["warm_up", "WARM_UP_ROWS", "SCRATCH_COLUMNS"]

WARM_UP_ROWS = 32      # the decode batches measured: 1, 2, 4, ... up to this (larger ones take its choices)
SCRATCH_COLUMNS = 64   # the columns of each scratch row: the C step's choice is by rows, not columns


def model_shape(model) -> "cpu.ModelShape | None":
    """What the model's CPU step multiplies, as `lmq_kernels.cpu.warm_up` takes it; None where lmq's kernels
    do not run it (weights neither float32 nor weight-only quantized)."""
    laid_out = decoder_weights(model)
    lw = laid_out.layers[0]
    kind = weights_kind(laid_out)
    if kind == "f32" and lw.wgu.dtype != torch.float32:
        return None
    cfg = model.config
    return cpu.ModelShape(hidden=cfg.hidden_size, inter=lw.wdown.shape[1], hq=cfg.num_attention_heads,
                          hkv=cfg.num_key_value_heads, d=model.model.layers[0].self_attn.head_dim,
                          vocab=laid_out.lm_head.shape[0], weights=kind, head=_kind(laid_out.lm_head),
                          panels=kind == "f32" and panels_fit(laid_out), head_panels=head_panels_fit(laid_out),
                          qk_norm=lw.q_norm is not None)


def _kind(weight) -> str:
    return weight.kind if isinstance(weight, QuantizedLinear) else "f32"


def _buckets(rows: int) -> list[int]:
    return [1 << i for i in range(max(1, rows).bit_length()) if 1 << i <= rows]


def _steps(model, shape: "cpu.ModelShape", rows: int) -> None:
    """Decode steps of a scratch decoder at each row bucket whose C-step choice is not measured yet (or was
    measured on a busy machine, and this one is quiet now): the first step of a bucket runs the per-op loop
    (`CpuLayers.run`), the second measures both."""
    known, layers, quiet = cpu.choices(), model.config.num_hidden_layers, cpu.quiet()
    entries = [known.get("/".join(["decode_layers", *map(str, step_class(b, shape.weights, shape.hidden,
                                                                         shape.inter, layers))]))
               for b in _buckets(rows)]
    todo = [b for b, e in zip(_buckets(rows), entries) if e is None or (quiet and not e.get("stable", True))]
    if not todo:
        return
    slots = 1 + rows * SCRATCH_COLUMNS
    kv = torch.zeros(layers, 2, slots, shape.hkv, shape.d, dtype=torch.float32)
    table = torch.arange(1, slots, dtype=torch.int32).view(rows, SCRATCH_COLUMNS).contiguous()
    decoder = FusedDecoder(model, kv, table, rows, use_graphs=False)
    if plan_for(decoder) is None:
        return
    end = SCRATCH_COLUMNS - 1
    for b in todo:
        tokens, positions = torch.zeros(b, dtype=torch.long), torch.full((b,), end, dtype=torch.long)
        for _ in range(2):
            decoder.step(tokens, positions, torch.zeros(b, dtype=torch.int32), end)


def warm_up(model, rows: int = WARM_UP_ROWS) -> int:
    """Make the model's panel-major weight copies, measure the classes `model`'s CPU steps of up to `rows`
    rows and its prefills meet, those this machine has not measured (see the module docstring), and keep a
    quantized model's weights de-quantized for its long prefills (`PANEL_CACHE.warm`); returns how many
    classes were measured. Nothing where lmq's kernels do not run the model; no measuring where they are not calibrated
    (LMQ_CPU_KERNELS=0 or 1)."""
    if cpu.mode() == "0":
        return 0
    cpu.configure(cache_dir() / "kernels")   # (before `model_shape` loads the library)
    shape = model_shape(model)
    if shape is None or not cpu.available():
        return 0
    with torch.inference_mode():
        make_panels(model)  # (their first use would make them: inside a query's call)
    measured = 0
    if cpu.mode() == "auto":
        before = set(cpu.choices())
        with torch.inference_mode(), cpu.warming():
            cpu.warm_up(shape, rows)
            _steps(model, shape, rows)
        measured = len(set(cpu.choices()) - before)
    with torch.inference_mode():   # (after the choices: a long prefill's GEMM decides the form it reads)
        PANEL_CACHE.warm(w for lw in decoder_weights(model).layers for w in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)
                         if isinstance(w, QuantizedLinear))
    return measured
