"""CUDA-graph captured decode steps, greedy and sampled picks on the device and running a step ahead
(`GraphSteps`, a mixin of `FusedDecoder`).

All activations live in buffers allocated once at `max_batch` rows and sliced per bucket (`bucket_for`); the
inputs (`tokens`, `positions`, `start`, `end`, the real row count) live in static device tensors, so a graph
captured once per bucket replays for every step. The first step of a bucket warms up (Triton JIT, the
attention kernel's ticket buffer) and captures; warm-up runs write the same K/V at the same column as the
real step, so they are harmless.
"""
from __future__ import annotations

import numpy as np
import torch

from lmq_kernels.triton.sample_rows import sample_rows

from ..picks import inverse_cdf, masked_argmax


def bucket_for(n: int, max_batch: int) -> int:
    """Smallest power of two >= n, capped at max_batch."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_batch)


class GraphSteps:
    """`FusedDecoder`'s steps under CUDA graphs: capture per bucket, the greedy picks under each mask and the
    sampled picks on the device (`DevicePicks`), and `run_ahead`. Reads the decoder's static buffers and step
    state."""

    def _pick_and_advance(self, bp: int) -> None:
        """Greedy picks under each mask (`MaskedPicks`: the picks of `masked_argmax`, as `Greedy.select`
        picks, in one pass over the logits), where a row's pick is sampled (a `sampling` step) its sample
        under its `ahead` mask at its `u` (`sample_rows`, as `picks.sample` samples), the masks it picked under
        (row K + 1 of `guess`), and, in a captured step, the inputs of the step after it: each row's pick, one
        position and one column further, and the mask its next pick will likely use (`_mask_after`; a
        run-ahead replays the same graph on them)."""
        k = len(self.masks)
        logits, picks = self.logits[:bp], self.guess[:k, :bp]
        if self.triton:  # one pass over the logits for every mask (few-token masks: a gather)
            self._masked_picks(logits, picks)
        else:
            picks.copy_(masked_argmax(logits[None], self.masks[:, None]))  # [K, bp]
        mask = self.ahead[:bp].long()
        chosen = picks.gather(0, mask[None])[0]
        if self.sampling:
            t = self.temperature[:bp]
            if self.triton:  # two passes over the logits (as `picks.sample` samples on a GPU)
                sample_rows(logits, self.masks, self.ahead[:bp], t, self.u[:bp], out=self.guess[k, :bp])
            else:
                z = torch.where(self.masks[mask], logits.float(), float("-inf"))
                self.guess[k, :bp].copy_(inverse_cdf(z, torch.where(t > 0, t, 1.0)[:, None], self.u[:bp, None]))
            chosen = torch.where(t > 0, self.guess[k, :bp], chosen)
        self.guess[k + 1, :bp].copy_(mask)
        if self.use_graphs:
            self.tokens[:bp].copy_(chosen)
            self.positions[:bp].add_(1)
            self.end.add_(1)
            self.end1.add_(1)
            if self._mask_after is not None:
                self.ahead[:bp].copy_(self._mask_after[mask * self.vocab + chosen])

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
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
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


class DevicePicks:
    """One step's picks on their way to the host: the greedy pick per mask and row (rows 0..K-1), the sampled
    pick of the rows `draws` says were sampled ({row: (temperature, u)}) (row K), and the mask each row
    picked under (row K + 1) (read them before the next step: they share one pinned buffer). Reading waits
    for this step only, not for a run-ahead step queued after it."""

    def __init__(self, host: torch.Tensor, rows: int, draws: dict):
        self._host, self.rows, self.draws = host, rows, draws
        self._event = torch.cuda.Event()
        self._event.record()
        self._picks: list[list[int]] | None = None

    def _wait(self) -> list[list[int]]:
        if self._picks is None:  # once a step: a list of lists, not a tensor index a row
            self._event.synchronize()
            self._picks = self._host.tolist()
        return self._picks

    def __call__(self, mask: int, row: int) -> int:
        """The greedy pick of `row` under mask number `mask` (K: its sampled pick)."""
        return self._wait()[mask][row]

    def sampled(self, row: int, mask: int, temperature: float, u: float) -> int | None:
        """The row's sampled pick if the device sampled it under that mask, temperature and u, else None."""
        if row >= self.rows or self.draws.get(row) != (temperature, u):
            return None
        picks = self._wait()
        return picks[-2][row] if picks[-1][row] == mask else None

    def tokens(self) -> list[int]:
        """Each row's pick (the tokens a run-ahead step ran on)."""
        picks = self._wait()
        tokens = [picks[m][b] for b, m in enumerate(picks[-1][:self.rows])]
        for b in self.draws:
            tokens[b] = picks[-2][b]
        return tokens


def write_picks(h, masks, draws: dict) -> None:
    """A step's picks (per row its mask, {row: (temperature, u)}) into the host mirror of the inputs `ahead`,
    `temperature`, `u` (three parts of w int32 each; the floats as their bits), zeros past the rows."""
    n = len(h) // 3
    h[:len(masks)] = masks
    h[len(masks):] = 0
    if draws:
        f, rows = h.view(np.float32), np.fromiter(draws, dtype=np.int64, count=len(draws))
        t, u = zip(*draws.values())
        f[n + rows], f[2 * n + rows] = t, u
