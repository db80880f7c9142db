"""Fused single-token decode step for the Llama family, gpt-fast style, CUDA-graph friendly.

One call of `FusedDecoder.step` runs one new token per row of a left-padded batch whose K/V live in the
backend's store, read through the rows' page tables (`kv_pool.py`, `cache/kv_store.py`,
`lmq_kernels.triton.decode_attention`):

    store: [L, 2, slots, H_kv, D]      table: int32 [rows, S_max], column -> store slot
    rows are table[:B]; row b's valid columns [start[b], end); "pool[l,0,b,:,c]" below is store[l, 0, table[b, c]]

Per step:
    x = embed(tokens)                                     [Bp, hidden]          (Bp = B padded to a bucket)
    per layer l:
        h   = rmsnorm(x) * w_in                           [Bp, hidden]          Triton, 1 launch
        qkv = h @ Wqkv^T (+ bqkv)                         [Bp, (Hq + 2 H_kv) D] cuBLAS, concatenated weight
        q   = rope(qnorm(q)); pool[l,0,b,:,end] = rope(knorm(k)); pool[l,1,b,:,end] = v   (rows b < B only)
        a   = decode_attention(q, pool[l,0,:Bp], pool[l,1,:Bp], start, end + 1)   [Bp, Hq, D]
                                                          Triton, the two in 1 launch (`NewToken`)
        x  += a @ Wo^T                                    (addmm_, residual fused into the GEMM)
        h   = rmsnorm(x) * w_post
        gu  = h @ [Wgate; Wup]^T                          [Bp, 2 I]             cuBLAS, concatenated weight
        m   = silu(gu[:, :I]) * gu[:, I:]                 [Bp, I]               Triton, 1 launch
        x  += m @ Wdown^T                                 (addmm_)
    logits = rmsnorm(x) * w_final @ Wlm^T                 [Bp, V]  model dtype

That is 8 launches per layer (cuBLAS adds a split-K reduce to some GEMMs); the GEMMs take most of a step.
Padding rows (b >= B, up to the bucket) have `start = S_max` (no valid column: the attention kernel returns
zeros for them) and write nothing into the pool.

On a GPU the step is captured in a CUDA graph per bucket of batch sizes (`bucket_for`): every activation lives
in a buffer allocated once at `max_batch` rows and sliced per bucket, and the inputs (`tokens`, `positions`,
`start`, `end`, the real row count) in static device tensors, so a graph captured once per bucket replays for
every step. The first step of a bucket warms up (Triton JIT, the attention kernel's ticket buffer) and
captures; warm-up runs write the same K/V at the same column as the real step, so they are harmless. A
captured step also picks on the device (greedy under each of the runner's masks, sampled where rows sample:
`picks_gpu.pick_in_step`) and can run the next step ahead on its picks (`run_ahead`). The same layer loop
prefills many tokens per row (`prefill.py`). The weights are laid out once per model (`weights.py`), the ops
run on Triton kernels (`lmq_kernels.triton.ops`) or lmq's C kernels (`ops.py`).

On a CPU the same step runs eagerly, exactly B rows, with lmq's C kernels (`lmq_kernels.cpu`) for the small
ops, the GEMMs of 2-8 rows and the attention where calibration measured them faster (torch ops elsewhere, and
where the library cannot be built: torch's grouped-query attention over the pool's columns [min(start), end]
gathered, `attention.py`); the weights are the model's own, stored K-major (see `weights.py`). There it replaces
Hugging Face's forward for decode steps too (faster than the forward even before the C kernels).
"""
from __future__ import annotations

import numpy as np
import torch

from lmq_kernels import cpu
from lmq_kernels.triton import NewToken, decode_attention
from lmq_kernels.cpu.layout import padded_stride
from lmq_kernels.triton.masked_argmax import MaskedPicks

from ..attention import grouped_attention
from ..picks_gpu import DevicePicks, pick_in_step, write_picks
from .prefill import Prefill, bucket_for

__all__ = ["FusedDecoder", "bucket_for"]


class FusedDecoder(Prefill):
    """Single-token decode steps of a Llama-family HF model over a static KV pool (see the module docstring).

    `step` returns logits `[B, V]` in the model's dtype, a view of a static buffer that the next `step`
    overwrites (clone it to keep it)."""

    def __init__(self, model, kv: torch.Tensor, table: torch.Tensor, max_batch: int, use_graphs: bool = True,
                 greedy_masks: list[torch.Tensor | None] | None = None, mask_after: torch.Tensor | None = None):
        super().__init__(model, kv, table)
        self.max_batch = min(int(max_batch), table.shape[0])
        self.use_graphs = bool(use_graphs) and self.cuda
        # static inputs (graph-captured steps read these): one int32 buffer, so that a step's inputs travel
        # to the device in one copy from a pinned host mirror (`step_host`); its parts `w` int32 apart, every
        # part at a multiple of 16 bytes (the alignment the kernels were compiled for, whatever max_batch)
        n, dev = self.max_batch, self.device
        self._width = w = -(-n // 4) * 4
        self._inputs = torch.zeros(6 * w + 12, dtype=torch.int32, device=dev)
        self._host = torch.zeros(6 * w + 12, dtype=torch.int32, pin_memory=self.cuda)
        self._host_free = torch.cuda.Event() if self.cuda else None   # the last copy out of _host is done
        self.tokens = self._inputs[:n]
        self.positions = self._inputs[w:w + n]
        self.start = self._inputs[2 * w:2 * w + n]
        self.start.fill_(self.S)
        # per row, the device's pick from the step's logits (and a run-ahead step's token): under mask
        # `ahead`, greedy where `temperature` is 0, else sampled at the uniform `u` (float32 bits)
        self.ahead = self._inputs[3 * w:3 * w + n]
        self.temperature = self._inputs[4 * w:4 * w + n].view(torch.float32)
        self.u = self._inputs[5 * w:5 * w + n].view(torch.float32)
        self.end = self._inputs[6 * w:6 * w + 1]            # column the new token goes to
        self.end1 = self._inputs[6 * w + 4:6 * w + 5]       # end + 1 (attention's exclusive end)
        self.nrows = self._inputs[6 * w + 8:6 * w + 9]      # real rows (< bucket: padding)
        self._end_int, self._nrows_int, self._first_int = 0, 0, 0       # CPU steps read these
        # activations, sliced per bucket
        qkv_n = (self.Hq + 2 * self.H_kv) * self.D
        mk = lambda *shape: torch.zeros(*shape, dtype=self.dtype, device=dev)  # noqa: E731
        # on the CPU, the GEMM outputs' rows are padded off multiples of 4 KB apart (see `padded_stride`)
        wide = (lambda rows, cols: mk(rows, padded_stride(cols, self.dtype.itemsize))[:, :cols]) if not self.cuda \
            else mk
        self.x = mk(n, self.hidden)           # residual stream
        self.h = mk(n, self.hidden)           # normed
        self.qkv = mk(n, qkv_n)
        self.q = mk(n, self.Hq, self.D)
        self.attn = mk(n, self.Hq, self.D)
        self.gu = wide(n, 2 * self.inter)
        self.act = mk(n, self.inter)
        self.logits = wide(n, self.vocab)
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}   # (bucket, cascade, sampling)
        self.cascade = True          # attention may read tiles rows share once for a block of rows
        # the Triton attention rotates q and appends the new K/V itself (one launch a layer for the two)
        self.new_token_in_attention = self.D & (self.D - 1) == 0
        self.sampling = False        # some row's pick is sampled (its step's graph samples too)
        # greedy picks on the device (see `run_ahead`): per mask, the argmax of each row's logits
        self.masks = None
        self._masked_picks = None    # `MaskedPicks` under them (a GPU's)
        self.picks: DevicePicks | None = None
        self._ahead_key = None       # the state a launched run-ahead step assumed, see `run_ahead`
        self._last = None            # (key, starts) of the last step from `step_host`
        self._specs = ((), {})       # the last `step_host`'s (ahead, draws) (see there)
        self._ahead_draws = {}       # {row: (temperature, u)} of the device's inputs (see `run_ahead`)
        self._mask_after = None      # [K, V] int32: a row's mask after its pick (see `run_ahead`), or None
        self._run_host = self._run_free = None   # the pinned buffer a run-ahead's picks travel in
        self.ran_ahead = self.took_ahead = 0   # run-ahead steps launched / taken
        if greedy_masks and self.cuda:
            self.masks = torch.stack([torch.ones(self.vocab, dtype=torch.bool, device=dev) if m is None
                                      else m.to(dev, torch.bool) for m in greedy_masks])  # [K, V]
            self._masked_picks = MaskedPicks(self.masks)
            # per mask the greedy picks, then (row K) the sampled ones, (row K + 1) the mask each row picked under
            self.guess = torch.zeros(len(greedy_masks) + 2, n, dtype=torch.int64, device=dev)
            self._guess_host = torch.zeros(len(greedy_masks) + 2, n, dtype=torch.int64, pin_memory=True)
            if mask_after is not None:
                assert mask_after.shape == self.masks.shape, "a mask after each mask and token"
                self._mask_after = mask_after.to(dev, torch.int32).reshape(-1)
            self._run_host = torch.zeros(3 * w, dtype=torch.int32, pin_memory=True)
            self._run_free = torch.cuda.Event()

    # ------------------------------------------------------------------------------------------ CPU steps
    def _cpu_step_setup(self, bp: int) -> None:
        """What every layer of a CPU step shares: RoPE's cos/sin and the padding mask (None without padding)."""
        self._set_rope(self.positions[:bp])
        first, end1 = self._first_int, self._end_int + 1
        self._starts = self.start[:bp] - first  # each row's first column, from `first` on
        self._allowed = None  # every row attends to every column read
        if bool((self.start[:bp] != first).any()):
            cols = torch.arange(first, end1)
            self._allowed = (cols[None] >= self.start[:bp, None])[:, None, None]  # [bp, 1, 1, end1 - first]

    def _attend_cpu(self, l: int, bp: int, scaling: float) -> None:
        """Attention over columns [first, end] of the rows' page tables: lmq's C kernel where calibration
        chose it (`lmq_kernels.cpu.attention`: each row from its own first column, K/V read through the table
        in place), else the model's CPU attention (`attention.py`) over the gathered columns (padding columns
        point at the store's zero slot)."""
        first, end1 = self._first_int, self._end_int + 1
        kc, vc = self.k_cache[l], self.v_cache[l]
        if cpu.attention(self.q[:bp], kc, vc, self.table[:bp, first:end1], self._starts, self.attn[:bp], scaling):
            return
        cols = self.table[:bp, first:end1].reshape(-1)     # index_select: far cheaper than advanced indexing
        s = end1 - first
        k = kc.index_select(0, cols).view(bp, s, *kc.shape[1:]).transpose(1, 2)  # [bp, H_kv, S, D]
        v = vc.index_select(0, cols).view(bp, s, *vc.shape[1:]).transpose(1, 2)
        out, _ = grouped_attention(None, self.q[:bp, :, None], k, v, self._allowed, scaling)  # [bp, 1, Hq, D]
        self.attn[:bp].copy_(out[:, 0])

    # ------------------------------------------------------------------------------------------ the step
    def _forward(self, bp: int) -> None:
        """One decode step of the first `bp` rows of the static buffers; logits land in self.logits[:bp]."""
        x, h = self.x[:bp], self.h[:bp]
        torch.index_select(self.embed, 0, self.tokens[:bp], out=x)              # [bp, hidden]
        if not self.triton:
            self._cpu_step_setup(bp)
        if self.triton or not self.cpu_layers.run(self, bp, (self._cos, self._sin), self._first_int, self._end_int,
                                                  self._layers):  # the CPU's layers in one C call where faster
            self._layers(bp)
        self._rmsnorm(x, self.final_norm, self.final_eps, h)
        self._mm(h, self.lm_head, self.logits[:bp], panels=self.cpu_layers.head_panels(self))  # [bp, V]
        if self.masks is not None:
            self._pick_and_advance(bp)

    def _layers(self, bp: int) -> None:
        """The layer loop of a step, op by op (see the module docstring)."""
        x, h = self.x[:bp], self.h[:bp]
        start = self.start[:bp]
        panels = self.cpu_layers.layer_panels(self)
        fused = self.triton and self.new_token_in_attention   # attention rotates and appends the new token
        for l, lw in enumerate(self.layers):
            p_qkv, p_o, p_gu, p_down = panels[l]
            self._rmsnorm(x, lw.in_norm, lw.eps, h)
            self._mm(h, lw.wqkv, self.qkv[:bp], bias=lw.bqkv, panels=p_qkv)     # [bp, (Hq+2Hkv) D]
            if not fused:
                self._rope_append(lw, l, self.qkv[:bp], self.q[:bp], self.positions, bp, 1,  # q [bp, Hq, D];
                                  self.end, self.nrows)                                 # K/V -> pool
            if self.triton:
                decode_attention(self.qkv[:bp].view(bp, -1, self.D)[:, :self.Hq] if fused else self.q[:bp],
                                 self.k_cache[l], self.v_cache[l], start, self.end1, sm_scale=lw.scaling,
                                 out=self.attn[:bp], table=self.table, rows=None if self.cascade else 1,
                                 new_token=NewToken(self.positions, self.inv_freq, lw.q_norm, lw.k_norm,
                                                    lw.qk_eps, self.nrows) if fused else None)  # [bp, Hq, D]
            else:
                self._attend_cpu(l, bp, lw.scaling)
            self._mm(self.attn[:bp].view(bp, -1), lw.wo, x, accumulate=True, panels=p_o)  # x += attn Wo^T
            self._rmsnorm(x, lw.post_norm, lw.eps, h)
            self._mm(h, lw.wgu, self.gu[:bp], panels=p_gu)                      # [bp, 2 I]
            self._silu_mul(self.gu[:bp], self.act[:bp])                         # [bp, I]
            self._mm(self.act[:bp], lw.wdown, x, accumulate=True, panels=p_down)  # x += mlp Wdown^T

    def _check(self, B: int, end: int) -> int:
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"batch {B} outside [1, {self.max_batch}]")
        if not 0 <= end < self.S:
            raise ValueError(f"end {end} outside the pool's capacity {self.S}")
        self._end_int, self._nrows_int = int(end), B
        return self.rows_run(B)

    def rows_run(self, B: int) -> int:
        """The rows a step of B rows computes: CUDA graphs replay per bucket of batch sizes (`bucket_for`);
        eager steps (the CPU) run exactly B rows."""
        return bucket_for(B, self.max_batch) if self.use_graphs else B

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, end: int) -> torch.Tensor:
        """Decode one token per row: tokens, positions int [B]; start int32 [B] (any device); rows are
        pool[:, :, :B] with valid columns [start[b], end). Writes the new K/V at column `end`; returns logits
        [B, V] (model dtype, a view of a static buffer, valid until the next step)."""
        B = tokens.shape[0]
        bp = self._check(B, end)
        self._last, self.sampling = None, False  # no run-ahead (nor sampled picks) after a step from device tensors
        self.tokens[:B].copy_(tokens, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.start[:B].copy_(start, non_blocking=True)
        if bp > B:
            self.tokens[B:bp].zero_()
            self.positions[B:bp].zero_()
            self.start[B:bp].fill_(self.S)   # no valid column: padded rows attend to nothing
        self.end.fill_(end)
        self.end1.fill_(end + 1)
        self.nrows.fill_(B)
        if not self.cuda:
            self._first_int = int(start.min())
        return self._run(B, bp)

    @torch.inference_mode()
    def step_host(self, tokens: list[int], starts: list[int], end: int, ahead: list[int] | None = None,
                  key=None, cascade: bool = True,
                  draws: dict[int, tuple[float, float, float]] | None = None) -> torch.Tensor:
        """`step` for inputs held by the host (the engine's case): positions are `end - start`; every input
        goes to the device in one copy from a pinned buffer instead of one transfer and launch each.
        A token -1 is any (a row that left the batch: a run-ahead step's, else 0).
        `ahead`: per row, the greedy mask the device picks the row's token under (a run-ahead step runs on
        it); `draws`: {row: (temperature, u, after)} for the rows whose pick is sampled instead (under that
        mask at u, as `picks.sample` samples; a run-ahead step's at `after`); `key`: see `run_ahead`; `cascade`:
        whether blocks of consecutive rows share prefixes (`KVPool.shares_prefixes`): attention then reads a
        shared tile once for a block (`lmq_kernels.triton.decode_attention`), else a row at a time."""
        B = len(tokens)
        self._specs = (tuple(ahead) if ahead is not None else (0,) * B, draws or {})
        last = (key, tuple(starts)) if key is not None else None
        if last is not None and self._take_ahead(last, tokens, end):
            return self.logits[:B]
        masks, draws = self._specs
        self._last, self._ahead_draws = last, {i: d[:2] for i, d in draws.items()}
        self.cascade = cascade
        self.sampling = self.masks is not None and bool(draws)
        bp = self._check(B, end)
        w = self._width
        if self._host_free is not None:
            self._host_free.synchronize()     # the previous step's copy has left the pinned buffer
        h = self._host.numpy()
        h[:B] = tokens
        np.maximum(h[:B], 0, out=h[:B])       # (-1: a row that left, any token)
        h[B:w] = 0
        h[2 * w:2 * w + B] = starts
        h[2 * w + B:3 * w] = self.S           # padded rows attend to nothing
        h[w:2 * w] = end - h[2 * w:3 * w]
        h[w + B:2 * w] = 0
        write_picks(h[3 * w:6 * w], masks, self._ahead_draws)
        h[6 * w], h[6 * w + 4], h[6 * w + 8] = end, end + 1, B
        self._first_int = min(starts)
        self._inputs.copy_(self._host, non_blocking=True)
        if self._host_free is not None:
            self._host_free.record()
        return self._run(B, bp)

    def _run(self, B: int, bp: int) -> torch.Tensor:
        self._ahead_key = None  # a run-ahead step not taken: the pool column it wrote is past `end`, free
        if not self.use_graphs:
            self._forward(bp)
        else:
            key = (bp, self.cascade, self.sampling)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(bp)
            graph.replay()
        self._copy_picks(B)
        return self.logits[:B]

    # ------------------------------------------------------------------------------------- CUDA graphs, picks
    def _pick_and_advance(self, bp: int) -> None:
        """The step's picks on the device (`picks_gpu.pick_in_step`: each row's greedy pick under each mask,
        its sample where the step samples, the mask it picked under, into `guess`) and, in a captured step,
        the inputs of the step after it: each row's pick, one position and one column further, and the mask
        its next pick will likely use (`_mask_after`; a run-ahead replays the same graph on them)."""
        mask = self.ahead[:bp]
        chosen = pick_in_step(self.logits[:bp], self.masks, self._masked_picks if self.triton else None, mask,
                              self.temperature[:bp] if self.sampling else None, self.u[:bp], self.guess)
        if self.use_graphs:
            self.tokens[:bp].copy_(chosen)
            self.positions[:bp].add_(1)
            self.end.add_(1)
            self.end1.add_(1)
            if self._mask_after is not None:
                self.ahead[:bp].copy_(self._mask_after[mask.long() * self.vocab + chosen])

    def _capture(self, bp: int) -> torch.cuda.CUDAGraph:
        inputs = self._inputs.clone()  # a step with greedy masks advances its inputs (`_pick_and_advance`)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # JIT + ticket buffer; rewrites the same K/V at the same column
                self._forward(bp)
                self._inputs.copy_(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool()):
            self._forward(bp)
        return graph

    def _copy_picks(self, B: int) -> None:
        """The step's picks on their way to the host (with the masks it picked under; its draws' (temperature,
        u): `_ahead_draws`)."""
        if self.masks is not None:
            self._guess_host.copy_(self.guess, non_blocking=True)
            self.picks = DevicePicks(self._guess_host, B, self._ahead_draws)

    # ------------------------------------------------------------------------------------- running ahead
    def run_ahead(self) -> bool:
        """Launch the next step now, on the tokens this step picked on the device, while the host picks and
        checks its own (call it after taking what you need of this step's logits: the run-ahead step
        overwrites them). The next `step_host` takes the run-ahead step's result instead of running the
        step again when everything it depends on is what the run-ahead assumed: the same `key` (the
        caller's name for the pool's rows and contents), starts, end + 1, and as tokens the device's picks;
        any other call discards it. Steps are deterministic, so a taken run-ahead step is the step itself,
        bit for bit. Its own picks are made with the last step's temperatures, under each row's mask after
        its pick (`mask_after`: within a UTF-8 character, the continuations'; without it, the last step's), its
        samples at each row's `after` uniform (`picks.sampled` says whether a draw is the device's: a caller
        whose draw differs samples itself). Only for CUDA-graph steps with greedy masks; returns whether it
        launched."""
        if self.masks is None or not self.use_graphs or self._last is None or self._end_int + 1 >= self.S:
            return False
        masks = () if self._mask_after is not None else self._specs[0]  # (else the step moved them)
        draws = {i: (t, after) for i, (t, _, after) in self._specs[1].items()}
        if masks or draws != self._ahead_draws:
            self._set_ahead(masks, draws)
        self.graphs[bucket_for(self._nrows_int, self.max_batch), self.cascade, self.sampling].replay()
        self._end_int += 1
        self._ahead_key = (self._last, self._end_int, self.picks)
        self.ran_ahead += 1
        return True

    @property
    def ahead_pending(self) -> bool:
        """Is a launched run-ahead step waiting to be taken (or discarded) by the next `step_host`?"""
        return self._ahead_key is not None

    def discard_ahead(self) -> None:
        """The pool changed otherwise (a prefill): the launched run-ahead step cannot be taken."""
        self._ahead_key = None

    def _take_ahead(self, last, tokens: list[int], end: int) -> bool:
        """Is the launched run-ahead step the step asked for? (Reads the picks it ran on: call it before
        anything else is queued.) A token -1 (a row that left) matches whatever the step ran on."""
        key, self._ahead_key = self._ahead_key, None
        if key is None or key[:2] != (last, end):
            return False
        ran = key[2].tokens()
        if ran != tokens and (len(ran) != len(tokens) or any(t != r and t >= 0 for t, r in zip(tokens, ran))):
            return False
        self._copy_picks(len(tokens))
        self.took_ahead += 1
        return True

    def _set_ahead(self, masks, draws: dict) -> None:
        """The picks of a run-ahead step (per row its mask, or () where the step before it moved them there;
        {row: (temperature, u)}) into the device's inputs, through a pinned buffer of their own (the step's
        inputs' buffer may still wait for the step before it)."""
        w = self._width
        self._run_free.synchronize()
        write_picks(self._run_host.numpy(), masks, draws)
        at = 3 * w if len(masks) else 4 * w
        self._inputs[at:6 * w].copy_(self._run_host[at - 3 * w:], non_blocking=True)
        self._run_free.record()
        self._ahead_draws = draws
