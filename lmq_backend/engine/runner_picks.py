"""The runner's picks (`RunnerPicks`, a mixin of `ModelRunner`): the greedy masks under which a step also picks on
the device, each row's pick under them from a step's logits, the device's share of a step's sampled rows, and a
beam's choices; all rows of a step at once, one copy to the host.
"""
from __future__ import annotations

import torch

from .picks import Choices, Draw, choose, masked_argmax, numbering, sample


class RunnerPicks:
    """State (set by `ModelRunner.__init__` and `set_greedy_masks`): `greedy_masks`, `_mask_after`, `_mask_index`
    (id of a mask -> its number), `_masked_picks` (a GPU's `MaskedPicks` for prefill logits), `_sampled` (the
    last step's `DevicePicks` where it sampled rows), `_decoder`."""

    def set_greedy_masks(self, masks: list[torch.Tensor | None], after: torch.Tensor | None = None) -> None:
        """Token masks (bool [V], None: every token) under which fused GPU steps also pick greedily on the
        device: `picks(k, row)` is then `Greedy().select(logits[row], masks[k])` without a host sync on
        the logits; a row sampled under one of the masks is sampled there too; and a step whose rows all
        give such a pick (`ahead`) runs the next one ahead on those picks (`FusedDecoder.run_ahead`), each
        row's under mask `after[k, token]` (int [K, V]: the mask a row picking `token` under mask k will
        likely pick under next; None: k)."""
        self.greedy_masks, self._mask_after = masks, after
        self._mask_index = numbering(masks)
        self._masked_picks = self._decoder = None

    def greedy_mask(self, mask: torch.Tensor | None) -> int | None:
        """Which of the greedy masks `mask` is (the object, not its values), or None."""
        return self._mask_index.get(id(mask))

    def _greedy_picks(self, logits: torch.Tensor):
        """`picks(k, row)`: the greedy pick of each row of `logits` [B, V] under each greedy mask, one op a
        mask for the whole batch, not one a row: on a GPU every mask's at once, with one copy to the host
        (not one sync a row); on the CPU a mask's at its first use (read them before the logits change)."""
        if not self.greedy_masks:
            return None
        if logits.device.type != "cpu":  # one copy to pinned memory, read at the first pick
            if self._masked_picks is None:
                self._masked_picks = _masked_picks(self.greedy_masks, logits)
            picks = self._masked_picks(logits.contiguous(), torch.empty(len(self.greedy_masks), len(logits),
                                                                      dtype=torch.int64, device=logits.device))
            host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True).copy_(picks, non_blocking=True)
            done, table = torch.cuda.Event(), []
            done.record()

            def device_pick(k: int, i: int) -> int:
                if not table:
                    done.synchronize()
                    table.extend(host.tolist())
                return table[k][i]
            return device_pick
        masks, done = self.greedy_masks, {}

        def pick(k: int, i: int) -> int:
            column = done.get(k)
            if column is None:
                column = done[k] = masked_argmax(logits, masks[k]).tolist()
            return column[i]
        return pick

    def _device_picks(self, ahead: list[int | Draw | None] | None) -> tuple[list | None, dict | None]:
        """The rows' picks as a fused GPU step makes them (`FusedDecoder.step_host`'s `ahead` and `draws`): per
        row the greedy mask, None where the device cannot pick (nor run ahead), and {row: (temperature, u,
        after)} for the rows it samples."""
        if ahead is None:
            return None, None
        masks, draws = list(ahead), {}
        for i, a in enumerate(ahead):
            if isinstance(a, Draw):
                pick = self._device_draw(a)
                masks[i] = None if pick is None else pick[0]
                if pick is not None:
                    draws[i] = pick[1:]
        return masks, draws

    def _device_draw(self, draw: Draw) -> tuple[int, float, float, float] | None:
        """(mask, temperature, u, after) of a draw the device samples: under one of the greedy masks, without
        a nucleus; else None."""
        k = None if draw.temperature <= 0 or draw.top_p < 1 or draw.after is None else self.greedy_mask(draw.allowed)
        return None if k is None else (k, draw.temperature, draw.u, draw.after)

    @staticmethod
    def choose(logits: torch.Tensor, asks: list[tuple[int, Choices]]) -> list[tuple]:
        """The choices (`picks.choose`) of the rows of a step's logits [B, V] that asked ((row, choices) pairs):
        all at once, one copy to the host (a beam's own top-k took a sync or two on a GPU)."""
        return choose(_rows(logits, [i for i, _ in asks]), [a for _, a in asks])

    def sample(self, logits: torch.Tensor, draws: list[tuple[int, Draw]]) -> list[int]:
        """The samples of the rows of a step's logits [B, V] that gave a draw ((row, draw) pairs): the device's
        where the step sampled the row with that draw, else a few ops for all the others, one copy to the host
        (a pick a row took ~1 ms of the host's time, and a sync, each)."""
        out: dict[int, int] = {}
        if self._sampled is not None:
            for i, d in draws:
                pick = self._device_draw(d)
                token = None if pick is None else self._sampled.sampled(i, *pick[:3])
                if token is not None:
                    out[i] = token
        rest = [(i, d) for i, d in draws if i not in out]
        if rest:
            rows = [i for i, _ in rest]
            out.update(zip(rows, sample(_rows(logits, rows), [d for _, d in rest]).tolist()))
        return [out[i] for i, _ in draws]


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without a copy where `rows` is every row in order."""
    if rows == list(range(len(logits))):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]


def _masked_picks(masks: list[torch.Tensor | None], logits: torch.Tensor):
    """`out` := the picks of `logits` [B, V] under each mask, as a callable (z, out): `MaskedPicks` on a GPU
    (imports triton: not at start-up); without triton, one masked argmax a mask."""
    try:
        from lmq_kernels.triton.masked_argmax import MaskedPicks
    except ImportError:
        return lambda z, out: out.copy_(torch.stack([masked_argmax(z, m) for m in masks]))
    v, device = logits.shape[1], logits.device
    return MaskedPicks(torch.stack([torch.ones(v, dtype=torch.bool, device=device) if m is None else m.to(device)
                                    for m in masks]))
