"""The ops of the fused layer loop (`LayerOps`), shared by the decode step and the prefill: RMSNorm, the
GEMMs, RoPE + K/V append into the store and SiLU-and-multiply, on the device's kernels.

On a GPU they are Triton kernels (`kernels.py`) and cuBLAS GEMMs. On a CPU they are lmq's C kernels
(`lmq_kernels.cpu`: the small ops and the GEMMs of 2-8 rows), or torch ops where the library cannot be
built, over the model's own weights stored K-major (see `weights.py`). A weight-only quantized model's
matrices are `QuantizedLinear` (`engine/quantize.py`), which multiply in their own kernel (`_mm`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmq_kernels import cpu

from lmq_kernels.triton.ops import rmsnorm, rope_append, silu_mul

from ...paths import cache_dir
from ..quantize import QuantizedLinear
from .cpu_step import CpuLayers
from .weights import LayerWeights, decoder_weights, why_not


def _rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class LayerOps:
    """A Llama-family model's weights (`decoder_weights`) and K/V store, and the ops of its layer loop.

    kv: the store, [L, 2, slots, H_kv, D]; table: int32 [rows, columns], the rows' page tables (column ->
    store slot), on the store's device."""

    def __init__(self, model, kv: torch.Tensor, table: torch.Tensor):
        why = why_not(model, require_cuda=False)
        if why is not None:
            raise ValueError(f"FusedDecoder does not support this model: {why}")
        cfg = model.config
        self.model = model
        self.device = kv.device
        self.dtype = next(model.parameters()).dtype
        assert kv.dtype == self.dtype, (kv.dtype, self.dtype)
        L, two, _, h_kv, d = kv.shape        # the K/V store: [L, 2, slots, H_kv, D]
        _, s_max = table.shape               # page tables: [rows, columns] -> slot
        assert two == 2 and L == cfg.num_hidden_layers and kv.stride(-1) == 1
        assert table.dtype == torch.int32 and table.device == kv.device and table.is_contiguous()
        self.table = table
        self.L, self.H_kv, self.S, self.D = L, h_kv, s_max, d
        attn0 = model.model.layers[0].self_attn
        self.Hq = cfg.num_attention_heads
        assert attn0.head_dim == d and cfg.num_key_value_heads == h_kv
        self.hidden = cfg.hidden_size
        self.inter = model.model.layers[0].mlp.gate_proj.out_features
        self.cuda = self.device.type == "cuda"
        # the small ops and attention as Triton kernels (on a CPU only under TRITON_INTERPRET=1, where the
        # tests check them against the torch ops that serve the CPU otherwise)
        self.triton = self.cuda
        if not self.cuda:  # build (once per machine) or load the CPU kernels now, not in the first step
            cpu.configure(cache_dir() / "kernels")
            cpu.available()

        w = decoder_weights(model)
        self.embed, self.final_norm, self.final_eps, self.lm_head = w.embed, w.final_norm, w.final_eps, w.lm_head
        self.vocab = self.lm_head.shape[0]
        self.inv_freq = w.inv_freq.to(self.device)
        self.layers = w.layers
        self.k_cache = [kv[l, 0] for l in range(L)]          # [slots, H_kv, D] views
        self.v_cache = [kv[l, 1] for l in range(L)]
        self.cpu_layers = CpuLayers()  # a CPU step's layers in one C call, the weights' panel-major copies

    def _mm(self, a: torch.Tensor, w: torch.Tensor | QuantizedLinear, out: torch.Tensor,
            accumulate: bool = False, bias: torch.Tensor | None = None, panels: torch.Tensor | None = None) -> None:
        """out = a @ w^T (+ bias), or out += a @ w^T; w [N, K]. On the CPU, up to 1,024 rows go through lmq's
        small-M kernel where the machine's calibration chose it (`lmq_kernels.cpu.small_m_mm`: each output one
        FMA chain whatever the batch; `panels`: w's panel-major copy, read instead of the K-major w), else
        through BLAS. A quantized w multiplies in its own kernel (`QuantizedLinear.mm`)."""
        if isinstance(w, QuantizedLinear):
            w.mm(a, out, accumulate=accumulate, bias=bias)
            return
        if not self.cuda and cpu.small_m_mm(a, w.t(), out, accumulate=accumulate, bias=bias, panels=panels):
            return
        if accumulate:
            out.addmm_(a, w.t())
        elif bias is not None:
            torch.addmm(bias, a, w.t(), out=out)
        else:
            torch.mm(a, w.t(), out=out)

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        if self.triton:
            rmsnorm(x, w, eps, out)
        elif not cpu.rmsnorm(x, w, eps, out):
            out.copy_(_rmsnorm_torch(x, w, eps))

    def _silu_mul(self, gu: torch.Tensor, out: torch.Tensor) -> None:
        if self.triton:
            silu_mul(gu, out)
        elif not cpu.silu_mul(gu, out):
            i = out.shape[1]
            out.copy_(F.silu(gu[:, :i]) * gu[:, i:])

    def _rope_append(self, lw: LayerWeights, l: int, qkv: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
                     rows: int, tokens: int, end: torch.Tensor, nrows: torch.Tensor,
                     table: torch.Tensor | None = None) -> None:
        """q = rope(qnorm(q)) of every token of `qkv` ([rows x tokens, (Hq + 2 Hkv) D], row-major tokens);
        each token's rope(knorm(k)) and v go to the store: token t of row b to the slot of column
        end - (tokens - 1) + t in row b of `table` (the rows' page tables; default: the pool's), except tokens
        at negative positions (padding) and rows >= nrows. `end`, `nrows`: one-element int32 device tensors (a
        captured step reads them at replay)."""
        kc, vc = self.k_cache[l], self.v_cache[l]
        table = self.table if table is None else table
        if self.triton:
            rope_append(qkv, positions, self.inv_freq, lw.q_norm, lw.k_norm, lw.qk_eps, q, kc, vc, table, end, nrows,
                        tokens, rows, self.Hq, self.H_kv)
            return
        last, n = int(end[0]) + 1, min(rows, int(nrows[0]))
        if cpu.rope_append(qkv, self._cos, self._sin, positions, lw.q_norm, lw.k_norm, lw.qk_eps, q, kc, vc,
                           table, tokens, last - 1, n):
            return
        hq, hkv, d = self.Hq, self.H_kv, self.D
        qk = qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d)                    # q and k heads, one RoPE
        vh = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
        if lw.q_norm is not None:
            qk = torch.cat([_rmsnorm_torch(qk[:, :hq], lw.q_norm, lw.qk_eps),
                            _rmsnorm_torch(qk[:, hq:], lw.k_norm, lw.qk_eps)], dim=1)
        cos = torch.cat((self._cos, self._cos), dim=-1)[:, None]               # [N, 1, D]
        signed_sin = torch.cat((-self._sin, self._sin), dim=-1)[:, None]
        qkf = qk.float()
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]
        roped = (qkf * cos + torch.roll(qkf, d // 2, dims=-1) * signed_sin).to(self.dtype)
        q.copy_(roped[:, :hq])
        k, v = roped[:, hq:].view(rows, tokens, hkv, d), vh.view(rows, tokens, hkv, d)
        slots = table[:n, last - tokens:last].long()                           # [n, tokens]
        write = positions[: n * tokens].view(n, tokens) >= 0                    # left padding writes nothing
        kc[slots[write]] = k[:n][write]
        vc[slots[write]] = v[:n][write]

    def _set_rope(self, positions: torch.Tensor) -> None:
        """RoPE's cos and sin [N, D/2] for the tokens at `positions` (every layer of a CPU forward shares them)."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        self._cos, self._sin = freqs.cos(), freqs.sin()
