"""CUDA-graph captured decode steps, greedy and sampled picks on the device and running a step ahead
(`GraphSteps`, a mixin of `FusedDecoder`).

All activations live in buffers allocated once at `max_batch` rows and sliced per bucket (`bucket_for`); the
inputs (`tokens`, `positions`, `start`, `end`, the real row count) live in static device tensors, so a graph
captured once per bucket replays for every step. The first step of a bucket warms up (Triton JIT, the
attention kernel's ticket buffer) and captures; warm-up runs write the same K/V at the same column as the
real step, so they are harmless.
"""
from __future__ import annotations

import torch

from ..picks_gpu import DevicePicks, pick_in_step, write_picks


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
