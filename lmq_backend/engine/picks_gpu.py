"""Token picks on a GPU: every rows' picks of a step on the device, one copy to the host.

Sampling rows without a nucleus runs `lmq_kernels.triton.sample_rows` (two passes over the rows: the kernel a
decode step's CUDA graph samples with, so that the host and the device pick alike); the greedy picks under
each of the runner's masks run `MaskedPicks` (one pass over the logits for every mask) into pinned memory,
read at the first pick (`MaskPicks`); a captured decode step picks inside its graph (`pick_in_step`) and its
picks travel to the host as `DevicePicks`. Nucleus rows, greedy rows and a beam's choices run the torch
arithmetic every device shares (`picks_cpu.py`) on the device.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from . import picks_cpu
from .picks_cpu import choose, greedy, inverse_cdf, masked_argmax

# this device's picks (`picks.py` dispatches to them): the torch arithmetic's greedy and choices, the kernels'
# sampling and picks under masks, and what a captured step picks with
__all__ = ["greedy", "sample", "choose", "MaskPicks", "masked_picks", "pick_in_step", "DevicePicks", "write_picks"]


def sample(logits: torch.Tensor, draws: list) -> torch.Tensor:
    """`picks_cpu.sample`, rows without a nucleus through `sample_rows`."""
    return picks_cpu.sample(logits, draws, plain_rows=_sample_rows)


def _sample_rows(logits: torch.Tensor, masks: list, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    from lmq_kernels.triton.sample_rows import sample_rows  # (imports triton: not at start-up)

    table, index = picks_cpu.mask_table(masks, logits.shape[1], logits.device)
    return sample_rows(logits, table, torch.tensor(index, dtype=torch.int32, device=logits.device), temperature, u)


class MaskPicks:
    """The greedy picks of a step's rows under each of the runner's greedy masks, as `picks(k, row)`: every
    mask's at once (`MaskedPicks`; without Triton one masked argmax a mask), one copy to pinned memory, read
    at the first pick (not one sync a row)."""

    def __init__(self, masks: list[torch.Tensor | None]):
        self.masks = masks
        self._kernel = None

    def __call__(self, logits: torch.Tensor) -> Callable[[int, int], int]:
        if self._kernel is None:
            self._kernel = masked_picks(self.masks, logits)
        picks = self._kernel(logits.contiguous(), torch.empty(len(self.masks), len(logits), dtype=torch.int64,
                                                             device=logits.device))
        host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True).copy_(picks, non_blocking=True)
        done, table = torch.cuda.Event(), []
        done.record()

        def pick(k: int, i: int) -> int:
            if not table:
                done.synchronize()
                table.extend(host.tolist())
            return table[k][i]
        return pick


def masked_picks(masks: list[torch.Tensor | None], logits: torch.Tensor):
    """`out` := the picks of `logits` [B, V] under each mask, as a callable (z, out): `MaskedPicks` (imports
    triton: not at start-up); without triton, one masked argmax a mask."""
    try:
        from lmq_kernels.triton.masked_argmax import MaskedPicks
    except ImportError:
        return lambda z, out: out.copy_(torch.stack([masked_argmax(z, m) for m in masks]))
    v, device = logits.shape[1], logits.device
    return MaskedPicks(torch.stack([torch.ones(v, dtype=torch.bool, device=device) if m is None else m.to(device)
                                    for m in masks]))


# ----- inside a captured decode step ----------------------------------------------------------------------

def pick_in_step(logits: torch.Tensor, masks: torch.Tensor, kernel, ahead: torch.Tensor,
                 temperature: torch.Tensor | None, u: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A decode step's picks on the device (captured with the step): into out[:K] each row's greedy pick under
    each of the K `masks` (bool [K, V]; `kernel`: their `MaskedPicks`, None without Triton: `masked_argmax`,
    as `Greedy` picks), where `temperature` is given (some row is sampled) into out[K] each row's sample under
    its `ahead` mask at its `u` (`sample_rows`, as `sample` samples), into out[K + 1] the mask each row
    picked under. logits [B, V]; ahead int32 [B]; temperature, u float32 [B] (0: greedy). Returns each row's
    pick (int64 [B]: its greedy pick under its mask, or its sample)."""
    k, bp = len(masks), len(logits)
    picks = out[:k, :bp]
    if kernel is not None:  # one pass over the logits for every mask (few-token masks: a gather)
        kernel(logits, picks)
    else:
        picks.copy_(masked_argmax(logits[None], masks[:, None]))  # [K, bp]
    mask = ahead.long()
    chosen = picks.gather(0, mask[None])[0]
    if temperature is not None:
        if kernel is not None:  # two passes over the logits (as `sample` samples on a GPU)
            from lmq_kernels.triton.sample_rows import sample_rows

            sample_rows(logits, masks, ahead, temperature, u, out=out[k, :bp])
        else:
            z = torch.where(masks[mask], logits.float(), float("-inf"))
            out[k, :bp].copy_(inverse_cdf(z, torch.where(temperature > 0, temperature, 1.0)[:, None], u[:, None]))
        chosen = torch.where(temperature > 0, out[k, :bp], chosen)
    out[k + 1, :bp].copy_(mask)
    return chosen


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

    def table(self) -> list[list[int]]:
        """The picks as lists (waits for the step): [K + 2][rows]."""
        if self._picks is None:  # once a step: a list of lists, not a tensor index a row
            self._event.synchronize()
            self._picks = self._host.tolist()
        return self._picks

    def __call__(self, mask: int, row: int) -> int:
        """The greedy pick of `row` under mask number `mask` (K: its sampled pick)."""
        return self.table()[mask][row]

    def sampled(self, row: int, mask: int, temperature: float, u: float) -> int | None:
        """The row's sampled pick if the device sampled it under that mask, temperature and u, else None."""
        if row >= self.rows or self.draws.get(row) != (temperature, u):
            return None
        picks = self.table()
        return picks[-2][row] if picks[-1][row] == mask else None

    def tokens(self) -> list[int]:
        """Each row's pick (the tokens a run-ahead step ran on)."""
        picks = self.table()
        tokens = [picks[m][b] for b, m in enumerate(picks[-1][:self.rows])]
        for b in self.draws:
            tokens[b] = picks[-2][b]
        return tokens


def write_picks(h: np.ndarray, masks, draws: dict) -> None:
    """A step's picks (per row its mask, {row: (temperature, u)}) into the host mirror of the inputs `ahead`,
    `temperature`, `u` (three parts of w int32 each; the floats as their bits), zeros past the rows."""
    n = len(h) // 3
    h[:len(masks)] = masks
    h[len(masks):] = 0
    if draws:
        f, rows = h.view(np.float32), np.fromiter(draws, dtype=np.int64, count=len(draws))
        t, u = zip(*draws.values())
        f[n + rows], f[2 * n + rows] = t, u
