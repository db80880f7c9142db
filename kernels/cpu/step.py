"""A CPU decode step's layers in one C call (step.c): the plan of a model's layers, and the call.

    plan = LayerPlan(layers)            # once per model: the layers' weights, norms and K/V store as C structs
    decode_layers(plan, x, ...) -> bool # every layer for the rows of x, in place (False: cannot run here)

Each layer is described by a `Layer` (weights given as `Weight`s: float32 K-major, or int8 / int4 in
qgemm.c's layout). The C side runs the ops of the per-op step (lmq_kernels.cpu's small_m_mm /
quantized_mm, rope_append, attention, rmsnorm, silu_mul) with their own arithmetic, in one OpenMP parallel
region: the same bits as those kernels, without ~9 calls from Python a layer. Whether it runs or the per-op
path does is the engine's choice by measurement (lmq_backend/engine/fused/step.py, through
`cpu.choose`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .attention import HEAD_DIMS
from .gemm import GEMM_MAX_ROWS
from .library import load, rows_ok
from .quantized import layout_ok

__all__ = ["Weight", "Layer", "LayerPlan", "decode_layers", "panel_major", "MAX_ROWS", "PANEL"]

# the rows a step takes: the small-M GEMM's range; the engine's calibration chooses between this call and the
# per-op loop per row bucket
MAX_ROWS = GEMM_MAX_ROWS
W_F32, W_I8, W_I4, W_F32_PANELS = 0, 1, 2, 3
PANEL = 64      # columns of a panel of float32 weights (a multiple of every target's vector; gemm.c)
_p, _l, _f, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class _CWeight(ctypes.Structure):
    _fields_ = [("kind", _i), ("n", _l), ("k", _l), ("w", _p), ("ldw", _l), ("scale", _p), ("zero", _p)]


class _CLayer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("bqkv", _p),
                ("eps", _f), ("qk_eps", _f), ("scaling", _f),
                ("qkv", _CWeight), ("o", _CWeight), ("gu", _CWeight), ("down", _CWeight),
                ("kc", _p), ("vc", _p), ("sks", _l), ("skh", _l), ("svs", _l), ("svh", _l)]


def panel_major(w_t: torch.Tensor) -> torch.Tensor | None:
    """A copy of the K-major float32 [k, n] as [n / PANEL, k, PANEL] (None where n is no multiple of PANEL)."""
    k, n = w_t.shape
    return None if n % PANEL else w_t.reshape(k, n // PANEL, PANEL).permute(1, 0, 2).contiguous()


@dataclass
class Weight:
    """y = x @ W^T, W [n, k]: float32 `w_t` [k, n] (K-major, unit column stride), or int8 q [n, k] + scale
    [n, k/32], or int4 q uint8 [n, k/2] + scale (d) and zero (m) [n, k/32] (qgemm.c). A float32 weight
    whose n is a multiple of PANEL is read from `panels` ([n / PANEL, k, PANEL], a copy made here unless
    `panel` is False): two threads that each read their half of every K-major row stream at half the speed
    of panels or worse (gemm.c, `lmq_gemm_panels_share`)."""
    n: int
    k: int
    w_t: torch.Tensor | None = None
    q: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    panels: torch.Tensor | None = None
    panel: bool = True

    def __post_init__(self):
        if self.panel and self.w_t is not None and self.panels is None and self.ok():
            self.panels = panel_major(self.w_t)

    def ok(self) -> bool:
        if self.w_t is not None:
            w = self.w_t
            return (w.dtype == torch.float32 and w.device.type == "cpu" and w.shape == (self.k, self.n)
                    and w.stride(1) == 1)
        return self.q is not None and layout_ok(self.q, self.scale, self.zero, self.k) \
            and self.q.shape[0] == self.n

    def c(self) -> _CWeight:
        if self.panels is not None:
            return _CWeight(W_F32_PANELS, self.n, self.k, self.panels.data_ptr(), PANEL, None, None)
        if self.w_t is not None:
            return _CWeight(W_F32, self.n, self.k, self.w_t.data_ptr(), self.w_t.stride(0), None, None)
        kind = W_I4 if self.q.dtype == torch.uint8 else W_I8
        return _CWeight(kind, self.n, self.k, self.q.data_ptr(), 0, self.scale.data_ptr(),
                        self.zero.data_ptr() if self.zero is not None else None)


@dataclass
class Layer:
    """One layer as the fused step uses it; k_cache / v_cache: its K and V of the store, [slots, Hkv, D]."""
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Weight
    o: Weight
    gu: Weight
    down: Weight
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scaling: float
    bqkv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6


def _f32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
               for t in tensors)


class LayerPlan:
    """The layers as C structs (pointers into the tensors, which the plan keeps alive). `ok`: whether every
    operand is in a layout step.c takes (if not, `decode_layers` declines)."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers
        first = layers[0]
        self.hidden = first.in_norm.shape[0]
        self.inter = first.down.k
        slots, self.Hkv, self.D = first.k_cache.shape
        self.ok = all(self._layer_ok(ly) for ly in layers) and self.D % 2 == 0 \
            and self.D in HEAD_DIMS
        self.array = (_CLayer * len(layers))()
        if self.ok:
            for i, ly in enumerate(layers):
                kc, vc = ly.k_cache, ly.v_cache
                self.array[i] = _CLayer(
                    ly.in_norm.data_ptr(), ly.post_norm.data_ptr(),
                    *(t.data_ptr() if t is not None else None for t in (ly.q_norm, ly.k_norm, ly.bqkv)),
                    float(ly.eps), float(ly.qk_eps), float(ly.scaling),
                    ly.qkv.c(), ly.o.c(), ly.gu.c(), ly.down.c(),
                    kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1))

    def _layer_ok(self, ly: Layer) -> bool:
        h, i = self.hidden, self.inter
        kc, vc = ly.k_cache, ly.v_cache
        return (_f32(ly.in_norm, ly.post_norm, ly.bqkv, ly.q_norm, ly.k_norm)
                and ly.in_norm.shape == ly.post_norm.shape == (h,)
                and (ly.q_norm is None) == (ly.k_norm is None)
                and all(w.ok() for w in (ly.qkv, ly.o, ly.gu, ly.down))
                and ly.qkv.k == ly.gu.k == ly.o.n == ly.down.n == h and ly.gu.n == 2 * i and ly.down.k == i
                and kc.dtype == vc.dtype == torch.float32 and kc.device.type == "cpu" and kc.dim() == 3
                and kc.shape == vc.shape and kc.stride(2) == 1 and vc.stride(2) == 1)


def _bind(lib: ctypes.CDLL) -> None:
    f = lib.lmq_decode_layers
    if f.argtypes is None:
        f.argtypes = [_p, _i, _p, _l, _i, _i, _i, _i, _i, _i, _p, _p, _p, _p, _l, _p, _l, _l,
                      _p, _p, _p, _p, _l, _p, _i]
        f.restype = None


def decode_layers(plan: LayerPlan, x: torch.Tensor, hq: int, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, table: torch.Tensor, start: torch.Tensor, first: int, end: int,
                  qkv: torch.Tensor, q: torch.Tensor, attn: torch.Tensor, gu: torch.Tensor, act: torch.Tensor,
                  threads: int | None = None) -> bool:
    """Every layer of `plan` for the B rows of x [B, hidden] (updated in place), one new token a row: its
    K/V go to column `end` of the rows' page tables (`table` int32 [>= B, S], unit column stride), row b
    attends to columns [max(start[b], first), end]; cos, sin [B, D/2] (RoPE per row), positions int32 [B];
    qkv, q, attn, act: contiguous float32 scratch of the step's shapes, gu too but for its row stride (>= its
    width). Not calibrated (the caller chooses). False (nothing computed) if the library or the operands do not
    allow it."""
    lib = load()
    if lib is None or not plan.ok:
        return False
    b, hidden = x.shape
    d = plan.D
    if (not 1 <= b <= MAX_ROWS or hidden != plan.hidden or hq % plan.Hkv or x.stride(1) != 1
            or not _f32(cos, sin, qkv, q, attn, act) or not rows_ok(gu) or x.dtype != torch.float32
            or cos.shape != (b, d // 2) or sin.shape != cos.shape
            or qkv.shape != (b, (hq + 2 * plan.Hkv) * d) or q.shape != (b, hq, d) or attn.shape != q.shape
            or gu.shape != (b, 2 * plan.inter) or gu.stride(0) < gu.shape[1] or act.shape != (b, plan.inter)
            or positions.dtype != torch.int32 or not positions.is_contiguous() or positions.numel() < b
            or start.dtype != torch.int32 or not start.is_contiguous() or start.numel() < b
            or table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] < b or table.stride(1) != 1
            or not 0 <= first <= end < table.shape[1]):
        return False
    _bind(lib)
    lib.lmq_decode_layers(plan.array, len(plan.layers), x.data_ptr(), x.stride(0), b, hidden, hq, plan.Hkv, d,
                          plan.inter, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), table.data_ptr(),
                          table.stride(0), start.data_ptr(), int(first), int(end), qkv.data_ptr(), q.data_ptr(),
                          attn.data_ptr(), gu.data_ptr(), gu.stride(0), act.data_ptr(),
                          threads if threads is not None else torch.get_num_threads())
    return True
