"""The fused prefill (`Prefill.prefill`, the engine's choice for Llama-family models): the decode step's layer
loop over the T new tokens of B left-padded rows at once.

[B T, ...] activations allocated per call, the RoPE/append kernel writing token t of row b to column
end - T + t (padding tokens, at position -1, write nothing), attention over the rows' columns [start, end)
through the page tables (no K/V copied): on a GPU by `lmq_kernels.triton.prefill_attention`, on a CPU by
`lmq_kernels.cpu.prefill_attention` (C), each where it pays (see `prefill`); else by `grouped_attention` over a
gathered copy (torch's fused attention, a boolean mask only when rows differ in length); final norm and LM
head for the last token of each row. Eager: every prefill has new
shapes. On a GPU it makes a fraction of the model's forward's launches, which wait on Python.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from lmq_kernels import cpu
from lmq_kernels.triton.decode_attention import sm_count
from lmq_kernels.triton.prefill_attention import prefill_attention
from lmq_kernels.triton.prefill_attention import programs as paged_programs

from ..attention import PREFILL_READ, grouped_attention, model_attention
from .ops import LayerOps


class Prefill(LayerOps):
    """The prefill of new tokens into the store through the fused layer loop (`FusedDecoder`'s base class)."""

    # On a GPU: attention through the page tables where the kernel has a program for every multiprocessor
    # (many rows, or many new tokens); else (one row's few new tokens after a long prefix) the gather and
    # torch's kernel, which splits the columns (there the faster), and where the gather would copy more than
    # PREFILL_READ columns. False: always the gather.
    paged_attention = True

    @torch.inference_mode()
    def prefill(self, rows: list[tuple[list[int], int]], slot: int, end: int) -> torch.Tensor:
        """The forward of several new tokens per row, the step's layer loop over all of them at once.

        `rows`: per row (new token ids, cached count), in pool slots slot, slot + 1, ...: row b's cached K/V
        are in columns [end - n_b, end - m_b) (n_b = cached + m_b new tokens); its new tokens go to
        [end - m_b, end), left-padded to the longest new part. Each op runs once per layer over all the
        tokens (a few launches a layer, where Hugging Face's forward makes several times as many and a long
        prefill waits on the host for much of its time); attention reads the rows' columns through
        their page tables (see the module's docstring). No CUDA graph (every call has
        new shapes). Returns the rows' last-token logits [B, V] in the model's dtype (a new tensor)."""
        B, T = len(rows), max(len(ids) for ids, _ in rows)
        if not all(ids for ids, _ in rows) or slot + B > self.table.shape[0] or not T <= end <= self.S:
            raise ValueError(f"prefill of {B} rows x {T} tokens at slot {slot}, end {end} does not fit the pool")
        N, dev = B * T, self.device
        # every input in one int32 buffer, one copy to the device: ids, positions (-1: padding), starts, end - 1,
        # B; each part at a multiple of 16 bytes (the alignment the kernels were compiled for, whatever N and B)
        at = np.cumsum([0] + [-(-n // 4) * 4 for n in (N, N, B, 1, 1)]).tolist()
        host = torch.full((at[-1],), -1, dtype=torch.int32)
        h = host.numpy()
        ids_h, pos_h = h[:N].reshape(B, T), h[at[1]:at[1] + N].reshape(B, T)
        m = np.array([len(ids) for ids, _ in rows])
        cached = np.array([c for _, c in rows])
        real = np.arange(T)[None, :] >= (T - m)[:, None]                       # [B, T]: not padding
        ids_h[:] = 0
        ids_h[real] = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in rows), np.int32, int(m.sum()))
        pos_h[:] = np.where(real, cached[:, None] - (T - m)[:, None] + np.arange(T)[None, :], -1)
        starts = (end - cached - m).tolist()
        h[at[2]:at[2] + B] = starts
        h[at[3]], h[at[4]] = end - 1, B
        inputs = host.pin_memory().to(dev, non_blocking=True) if self.cuda else host
        ids_d, pos_d, starts_d = inputs[:N], inputs[at[1]:at[1] + N], inputs[at[2]:at[2] + B]
        end_d, nrows_d = inputs[at[3]:at[3] + 1], inputs[at[4]:at[4] + 1]
        hq, d = self.Hq, self.D
        if not self.triton:
            attend = self._cpu_attention(B, T, starts, starts_d, slot, end, torch.from_numpy(m.astype(np.int32)))
        elif self.paged_attention and (not self.cuda or B * (end - min(starts)) > PREFILL_READ
                                       or paged_programs(B, T, hq, self.H_kv, d, self.dtype) >= sm_count(dev)):
            attend = self._paged_attention(B, T, starts, starts_d, slot, end)
        else:
            attend = self._gathered_attention(B, T, starts, starts_d, slot, end)
        x = self.embed.index_select(0, ids_d)                                   # [N, hidden] residual stream
        h = torch.empty_like(x)
        qkv = x.new_empty(N, (hq + 2 * self.H_kv) * d)
        q = x.new_empty(N, hq, d)
        gu, act = x.new_empty(N, 2 * self.inter), x.new_empty(N, self.inter)
        if not self.triton:
            self._set_rope(pos_d)
        panels = self.cpu_layers.layer_panels(self)
        with model_attention(dev):
            for l, lw in enumerate(self.layers):
                p_qkv, p_o, p_gu, p_down = panels[l]
                self._rmsnorm(x, lw.in_norm, lw.eps, h)
                self._mm(h, lw.wqkv, qkv, bias=lw.bqkv, panels=p_qkv)
                self._rope_append(lw, l, qkv, q, pos_d, B, T, end_d, nrows_d, slot)
                a = attend(l, q.view(B, T, hq, d), lw.scaling)                  # [B, T, Hq, D]
                self._mm(a.reshape(N, hq * d), lw.wo, x, accumulate=True, panels=p_o)  # x += attn @ Wo^T
                self._rmsnorm(x, lw.post_norm, lw.eps, h)
                self._mm(h, lw.wgu, gu, panels=p_gu)
                self._silu_mul(gu, act)
                self._mm(act, lw.wdown, x, accumulate=True, panels=p_down)      # x += mlp @ Wdown^T
        last = x.view(B, T, -1)[:, -1]
        h_last = torch.empty_like(last)
        self._rmsnorm(last, self.final_norm, self.final_eps, h_last)
        logits = x.new_empty(B, self.vocab)
        self._mm(h_last, self.lm_head, logits, panels=self.cpu_layers.head_panels(self))
        return logits

    def _paged_attention(self, B: int, T: int, starts: list[int], starts_d: torch.Tensor, slot: int, end: int):
        """Attention through the rows' page tables (`lmq_kernels.triton.prefill_attention`): no K/V copied, a cached
        prefix that rows share read once from memory and from the L2 cache after."""
        table, out = self.table[slot:slot + B], None

        def attend(l: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
            nonlocal out
            out = prefill_attention(q, self.k_cache[l], self.v_cache[l], table, starts_d, end, scaling, out=out)
            return out
        return attend

    def _cpu_attention(self, B: int, T: int, starts: list[int], starts_d: torch.Tensor, slot: int, end: int,
                       new: torch.Tensor):
        """On the CPU: lmq's kernel through the page tables (`lmq_kernels.cpu.prefill_attention`: no K/V
        copied, the padding skipped) where calibration chose it for this shape, else the gather."""
        table, out, gathered = self.table[slot:slot + B], None, None

        def attend(l: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
            nonlocal out, gathered
            if gathered is None:
                out = torch.empty_like(q) if out is None else out
                if cpu.prefill_attention(q, self.k_cache[l], self.v_cache[l], table, starts_d, new, end, out, scaling):
                    return out
                gathered = self._gathered_attention(B, T, starts, starts_d, slot, end)
            return gathered(l, q, scaling)
        return attend

    def _gathered_attention(self, B: int, T: int, starts: list[int], starts_d: torch.Tensor, slot: int, end: int):
        """Attention over a dense copy of the rows' columns (torch's fused attention), where lmq's kernels do
        not run."""
        first, dev = min(starts), self.device
        allowed = None  # every row as long as the others: causal attention of the T tokens ending at `end`
        if any(s != first for s in starts):
            cols = torch.arange(first, end, device=dev)
            allowed = ((cols[None, None] >= starts_d[:, None, None])
                       & (cols[None, None] <= torch.arange(end - T, end, device=dev)[None, :, None]))[:, None]
        cols = self.table[slot:slot + B, first:end].long()                     # [B, S] store slots

        def attend(l: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
            k = self.k_cache[l][cols].transpose(1, 2)                           # [B, H_kv, S, D], gathered
            v = self.v_cache[l][cols].transpose(1, 2)
            return grouped_attention(None, q.transpose(1, 2), k, v, allowed, scaling)[0]
        return attend
