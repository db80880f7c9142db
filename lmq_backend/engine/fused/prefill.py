"""The fused prefill (`Prefill.prefill`, the engine's choice for Llama-family models): the decode step's layer
loop over the T new tokens of B left-padded rows at once.

[B T, ...] activations allocated per call, the RoPE/append kernel writing token t of row b to column
end - T + t (padding tokens, at position -1, write nothing), attention over the rows' columns [start, end)
through the page tables (no K/V copied): on a GPU by `lmq_kernels.triton.prefill_attention`, on a CPU by
`lmq_kernels.cpu.prefill_attention` (C), each where it pays (see `prefill`); else by `grouped_attention` over a
gathered copy (torch's fused attention, a boolean mask only when rows differ in length); final norm and LM
head for the last token of each row. On a GPU it makes a fraction of the model's forward's launches, which
wait on Python; a small prefill (up to GRAPH_ROWS rows of up to GRAPH_TOKENS new tokens: a few calls' new tails
behind a warm trie) replays a CUDA graph captured per bucket of rows and tokens instead, attention then always
through the page tables. Larger prefills run eagerly (their launches hide behind the device's work).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from lmq_kernels import cpu
from lmq_kernels.triton.decode_attention import sm_count
from lmq_kernels.triton.prefill_attention import prefill_attention
from lmq_kernels.triton.prefill_attention import programs as paged_programs
from lmq_kernels.triton.prefill_attention import splits_for

from ..attention import PREFILL_READ, grouped_attention, model_attention
from .ops import LayerOps


def bucket_for(n: int, most: int) -> int:
    """Smallest power of two >= n, capped at `most`."""
    b = 1
    while b < n:
        b *= 2
    return min(b, most)


def _parts(buffer: torch.Tensor, at: list[int], B: int, T: int) -> list[torch.Tensor]:
    """The seven parts of a prefill's inputs in `buffer` (see `Prefill._inputs_host`)."""
    return [buffer[a:a + n] for a, n in zip(at, (B * T, B * T, B, B, 1, 1, 1))]


def _after(ready: list, attend):
    """`attend`, each layer's after that layer's event in `ready` (on the stream it runs on)."""
    def waiting(l: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        torch.cuda.current_stream(q.device).wait_event(ready[l])
        return attend(l, q, scaling)
    return waiting


# Small prefills (a few rows' short new parts, the common case behind a warm trie) replay a CUDA graph per
# bucket of rows and new tokens: eager, such a prefill waits on the host's ~150 launches for far longer than
# the device takes to run them.
GRAPH_ROWS, GRAPH_TOKENS, GRAPH_MIN_TOKENS = 8, 64, 8


class Prefill(LayerOps):
    """The prefill of new tokens into the store through the fused layer loop (`FusedDecoder`'s base class)."""

    # On a GPU: attention through the page tables where the kernel has a program for every multiprocessor
    # (many rows, or many new tokens); else (one row's few new tokens after a long prefix) the gather and
    # torch's kernel, which splits the columns (there the faster), and where the gather would copy more than
    # PREFILL_READ columns. False: always the gather (and no captured prefills).
    paged_attention = True
    use_graphs = False   # small prefills replay CUDA graphs (a GPU `FusedDecoder`'s choice)
    _graph_pool = None
    # (bucket of rows, of tokens, parts of the attention's columns) -> (graph, its logits); None until the first
    _prefill_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] | None = None

    @torch.inference_mode()
    def prefill(self, rows: list[tuple[list[int], int]], slot: int, end: int, ready: list | None = None
                ) -> torch.Tensor:
        """The forward of several new tokens per row, the step's layer loop over all of them at once.

        `rows`: per row (new token ids, cached count), in pool slots slot, slot + 1, ...: row b's cached K/V
        are in columns [end - n_b, end - m_b) (n_b = cached + m_b new tokens); its new tokens go to
        [end - m_b, end), left-padded to the longest new part. Each op runs once per layer over all the
        tokens (a few launches a layer, where Hugging Face's forward makes several times as many and a long
        prefill waits on the host for much of its time); attention reads the rows' columns through
        their page tables (see the module's docstring). Up to GRAPH_ROWS rows of up to GRAPH_TOKENS new tokens
        replay a CUDA graph captured for their bucket (`_captured`), where graphs are used; other shapes run
        eagerly. `ready`: per layer, an event after which the rows' cached K/V of that layer are in the store
        (copies from the cache tiers still running: `CacheTiers.queue_loads`); the layer's attention waits
        for it (a captured prefill, for the last). Returns the rows' last-token logits [B, V] in the model's
        dtype (a new tensor)."""
        B, T = len(rows), max(len(ids) for ids, _ in rows)
        if not all(ids for ids, _ in rows) or slot + B > self.table.shape[0] or not T <= end <= self.S:
            raise ValueError(f"prefill of {B} rows x {T} tokens at slot {slot}, end {end} does not fit the pool")
        if self.use_graphs and self.paged_attention and B <= GRAPH_ROWS and T <= GRAPH_TOKENS:
            if ready:
                torch.cuda.current_stream(self.device).wait_event(ready[-1])
            return self._captured(rows, slot, end)
        dev = self.device
        host, at = self._inputs_host(rows, B, T, slot, end)
        inputs = host.pin_memory().to(dev, non_blocking=True) if self.cuda else host
        ids_d, pos_d, starts_d, _, last_d, end_d, nrows_d = _parts(inputs, at, B, T)
        starts = _parts(host, at, B, T)[2].tolist()   # each row's first column
        hq, d = self.Hq, self.D
        if not self.triton:
            m = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.int32)
            attend = self._cpu_attention(B, T, starts, starts_d, slot, end, m)
        elif self.paged_attention and (not self.cuda or B * (end - min(starts)) > PREFILL_READ
                                       or paged_programs(B, T, hq, self.H_kv, d, self.dtype) >= sm_count(dev)):
            attend = self._paged_attention(self.table[slot:slot + B], starts_d, end_d,
                                           splits_for(B, T, hq, self.H_kv, d, self.dtype, end, sm_count(dev)))
        else:
            attend = self._gathered_attention(B, T, starts, starts_d, slot, end)
        if ready:
            attend = _after(ready, attend)
        return self._prefill_forward(ids_d, pos_d, B, T, last_d, nrows_d, self.table[slot:slot + B], attend)

    def _inputs_host(self, rows: list[tuple[list[int], int]], B: int, T: int, slot: int, end: int,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """A prefill's inputs in one int32 buffer (`out`, else a new one), that one copy takes to the device:
        ids [B, T] and positions [B, T] (-1: padding; rows left-padded to T), starts [B], the rows' table rows
        [B], end - 1 (the last token's column), end and the real row count (`rows` may be fewer than B: the rest are padding rows, whose first
        column is `end`: none), each part at a multiple of 16 bytes (the alignment the kernels were compiled
        for). Returns the buffer and the parts' offsets."""
        N, n = B * T, len(rows)
        at = np.cumsum([0] + [-(-k // 4) * 4 for k in (N, N, B, B, 1, 1, 1)]).tolist()
        host = torch.empty(at[-1], dtype=torch.int32) if out is None else out[:at[-1]]
        h = host.numpy()
        h[:] = -1
        ids_h, pos_h = h[:N].reshape(B, T), h[at[1]:at[1] + N].reshape(B, T)
        m = np.array([len(ids) for ids, _ in rows] + [0] * (B - n))
        cached = np.array([c for _, c in rows] + [0] * (B - n))
        real = np.arange(T)[None, :] >= (T - m)[:, None]                       # [B, T]: not padding
        ids_h[:] = 0
        ids_h[real] = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in rows), np.int32, int(m.sum()))
        pos_h[:] = np.where(real, cached[:, None] - (T - m)[:, None] + np.arange(T)[None, :], -1)
        h[at[2]:at[2] + B] = end - cached - m
        h[at[3]:at[3] + B] = slot + np.minimum(np.arange(B), n - 1)
        h[at[4]], h[at[5]], h[at[6]] = end - 1, end, n
        return host, at

    def _prefill_forward(self, ids_d: torch.Tensor, pos_d: torch.Tensor, B: int, T: int, last_d: torch.Tensor,
                         nrows_d: torch.Tensor, table: torch.Tensor, attend) -> torch.Tensor:
        """The layer loop over B rows x T new tokens (`ids_d`, `pos_d`: [B T] on the device; `last_d`: the
        last token's column; `table`: the rows' page tables) and the last tokens' logits [B, V] (a new
        tensor)."""
        N, hq, d = B * T, self.Hq, self.D
        x = self.embed.index_select(0, ids_d)                                   # [N, hidden] residual stream
        h = torch.empty_like(x)
        qkv = x.new_empty(N, (hq + 2 * self.H_kv) * d)
        q = x.new_empty(N, hq, d)
        gu, act = x.new_empty(N, 2 * self.inter), x.new_empty(N, self.inter)
        if not self.triton:
            self._set_rope(pos_d)
        panels = self.cpu_layers.layer_panels(self)
        with model_attention(self.device):
            for l, lw in enumerate(self.layers):
                p_qkv, p_o, p_gu, p_down = panels[l]
                self._rmsnorm(x, lw.in_norm, lw.eps, h)
                self._mm(h, lw.wqkv, qkv, bias=lw.bqkv, panels=p_qkv)
                self._rope_append(lw, l, qkv, q, pos_d, B, T, last_d, nrows_d, table)
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

    # ------------------------------------------------------------------------------------- captured prefills
    def _captured(self, rows: list[tuple[list[int], int]], slot: int, end: int) -> torch.Tensor:
        """A small prefill as the replay of its bucket's CUDA graph (captured at the bucket's first prefill):
        rows padded to a power of two up to GRAPH_ROWS (padding rows read no column and write nothing), new
        parts left-padded to a power of two from GRAPH_MIN_TOKENS up to GRAPH_TOKENS; the rows' page tables
        are copied into a table of the graph's own (a graph reads fixed addresses), and attention reads them
        through the pages (`prefill_attention`, `end` read on the device, its columns split into as many
        parts as `splits_for` gives this `end`: a graph per bucket and number of parts)."""
        bb = bucket_for(len(rows), GRAPH_ROWS)
        tb = max(GRAPH_MIN_TOKENS, bucket_for(max(len(ids) for ids, _ in rows), GRAPH_TOKENS))
        splits = splits_for(bb, tb, self.Hq, self.H_kv, self.D, self.dtype, end, sm_count(self.device))
        if self._prefill_graphs is None:  # (the first captured prefill: the graphs' static inputs)
            size = 2 * GRAPH_ROWS * GRAPH_TOKENS + 2 * GRAPH_ROWS + 12
            self._prefill_graphs = {}
            self._prefill_in = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._prefill_host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
            self._prefill_sent = torch.cuda.Event()   # the last copy out of _prefill_host is done
            self._prefill_table = torch.zeros(GRAPH_ROWS, self.S, dtype=torch.int32, device=self.device)
        self._prefill_sent.synchronize()
        host, at = self._inputs_host(rows, bb, tb, slot, end, out=self._prefill_host)
        self._prefill_in[:at[-1]].copy_(host, non_blocking=True)
        self._prefill_sent.record()
        captured = self._prefill_graphs.get((bb, tb, splits))
        if captured is None:
            captured = self._prefill_graphs[bb, tb, splits] = self._capture_prefill(bb, tb, splits, at)
        graph, logits = captured
        graph.replay()
        return logits[:len(rows)].clone()

    def _capture_prefill(self, bb: int, tb: int, splits: int,
                         at: list[int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a bucket's prefill over the static inputs (`_prefill_in`, laid out as `at` says) and its
        logits [bb, V]. Its warm-up runs (Triton's compiles) write the same K/V at the same columns as the
        prefill itself."""
        ids_d, pos_d, starts_d, rows_d, last_d, end_d, nrows_d = _parts(self._prefill_in, at, bb, tb)
        table = self._prefill_table[:bb]

        def run() -> torch.Tensor:
            torch.index_select(self.table, 0, rows_d, out=table)
            return self._prefill_forward(ids_d, pos_d, bb, tb, last_d, nrows_d, table,
                                 self._paged_attention(table, starts_d, end_d, splits))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool()):
            logits = run()
        return graph, logits

    @property
    def prefill_buckets(self) -> set[tuple[int, int]]:
        """The (rows, new tokens) buckets whose prefill graphs are captured."""
        return {key[:2] for key in self._prefill_graphs or ()}

    def graph_pool(self):
        """The memory pool this decoder's CUDA graphs share (replayed one at a time, in one stream)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _paged_attention(self, table: torch.Tensor, starts_d: torch.Tensor, end_d: torch.Tensor,
                         splits: int | None = None):
        """Attention through the rows' page tables (`lmq_kernels.triton.prefill_attention`): no K/V copied, a cached
        prefix that rows share read once from memory and from the L2 cache after. `splits`: see there (None:
        from the shapes and the table's width)."""
        out = None

        def attend(l: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
            nonlocal out
            out = prefill_attention(q, self.k_cache[l], self.v_cache[l], table, starts_d, end_d, scaling, out=out,
                                    splits=splits)
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
