"""The calibration of a model's classes before its first query: a warm-up when a backend is made.

    shape = ModelShape(hidden=576, inter=1536, hq=9, hkv=3, d=64, vocab=49152)
    warm_up(shape, rows=32) -> int      the classes measured now (0: all were measured on this machine before)

A query's calls never measure a class (calibration.py: one not yet measured takes its nearest measured
neighbour's choice), so the classes a model's steps meet are measured here, inside `library.warming`: the
ops of a decode step at each row bucket up to `rows` (their GEMMs, small ops, attention over short and long
rows, the LM head and the greedy pick) and of prefills of 2 to 1,024 tokens (GEMMs, small ops, the prefill
attention of a few row and token counts). Classes between those of the grid take their neighbours' choices.
What this machine measured before (the calibration file) is not measured again, so a warm-up costs a machine's
first backend of a model shape a few seconds, and later ones nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from .attention import choose_attention, choose_prefill_attention
from .gemm import GEMM_MAX_ROWS, choose_gemm
from .library import choices, load, mode, warming
from .ops import choose_rmsnorm, choose_rope_append, choose_silu_mul
from .picks import choose_masked_argmax
from .quantized import MAX_ROWS as QUANTIZED_ROWS
from .quantized import choose_quantized

__all__ = ["ModelShape", "warm_up", "SPANS", "PREFILL_TOKENS", "PREFILL_ROWS"]

SPANS = (256, 2048)                  # the columns a decode step's rows read: short and long prompts
PREFILL_TOKENS = (4, 16, 64, 256, 1024)   # the tokens of a prefill (all rows), for its GEMMs and small ops
PREFILL_ROWS = ((1, 16), (1, 512), (4, 16), (16, 32))   # (rows, new tokens a row) of the prefill attention
PANEL = 64                            # the columns of a panel-major weight (step.PANEL)


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What a decoder's CPU step multiplies: hidden size, MLP width, query and K/V heads, head dim, vocabulary;
    `weights` "f32", "int8" or "int4" (the layers'), `head` the same for the LM head; `panels`: float32 layer
    weights read panel-major; `head_panels`: the LM head too; `qk_norm`: q/k RMSNorms before RoPE (Qwen3)."""
    hidden: int
    inter: int
    hq: int
    hkv: int
    d: int
    vocab: int
    weights: str = "f32"
    head: str = "f32"
    panels: bool = True
    head_panels: bool = True
    qk_norm: bool = False

    def layer_weights(self) -> list[tuple[int, int]]:
        """(k, n) of the layer GEMMs: qkv, o, gate/up, down."""
        return [(self.hidden, (self.hq + 2 * self.hkv) * self.d), (self.hq * self.d, self.hidden),
                (self.hidden, 2 * self.inter), (self.inter, self.hidden)]


def _gemm(kind: str, panels: bool, m: int, k: int, n: int) -> None:
    """The class of m rows of a weight [k, n] of `kind`: lmq's float32 GEMM (over panels where `panels`), or
    a quantized weight's: its kernel up to QUANTIZED_ROWS rows (in chunks of that many up to 4x as many), its
    panels de-quantized for the float32 GEMM beyond (engine/quantize.py)."""
    if kind == "f32":
        choose_gemm(m, k, n, PANEL if panels and n % PANEL == 0 else 0)
    elif m <= 4 * QUANTIZED_ROWS:
        choose_quantized(min(m, QUANTIZED_ROWS), k, n, kind == "int4")
    elif n % PANEL == 0:
        choose_gemm(m, k, n, PANEL)


def _layer_gemms(shape: ModelShape, m: int) -> None:
    for k, n in shape.layer_weights():
        _gemm(shape.weights, shape.panels, m, k, n)


def _decode(shape: ModelShape, rows: int) -> None:
    s = shape
    choose_rmsnorm(rows, s.hidden)
    _layer_gemms(s, rows)
    choose_rope_append(rows, s.hq, s.hkv, s.d, s.qk_norm, 1)
    for span in SPANS:
        choose_attention(rows, s.hq, s.hkv, s.d, span)
    choose_silu_mul(rows, s.inter)
    _gemm(s.head, s.head_panels, rows, s.hidden, s.vocab)
    for masked in (False, True):
        choose_masked_argmax(rows, s.vocab, masked)


def _prefill(shape: ModelShape, tokens: int) -> None:
    s = shape
    choose_rmsnorm(tokens, s.hidden)
    if tokens <= GEMM_MAX_ROWS:
        _layer_gemms(s, tokens)
    choose_rope_append(tokens, s.hq, s.hkv, s.d, s.qk_norm, 2)
    choose_silu_mul(tokens, s.inter)


def warm_up(shape: ModelShape, rows: int = 32) -> int:
    """Measure the classes of `shape`'s decode steps of 1 to `rows` rows (powers of two) and of its prefills
    that this machine has not measured; returns how many it measured. Nothing where the kernels do not run
    or are not calibrated (LMQ_CPU_KERNELS=0 or 1)."""
    if mode() != "auto" or load() is None:
        return 0
    before = set(choices())
    with warming():
        r = 1
        while r <= max(1, rows):
            _decode(shape, r)
            r *= 2
        for tokens in PREFILL_TOKENS:
            _prefill(shape, tokens)
        for b, t in PREFILL_ROWS:
            choose_prefill_attention(b, t, shape.hq, shape.hkv, shape.d, max(SPANS))
    return len(set(choices()) - before)
