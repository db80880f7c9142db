"""The device's token masks for picks made before a constraint's check (`hole_loop.py`), and how a row moves
from one to the next, so that a GPU step run ahead (`FusedDecoder.run_ahead`) picks under the mask its row's
next pick will use.

A hole whose constraint checks tokens (llguidance's REGEX / JSON / GRAMMAR) picks among
- every token where the value may end (a token outside the value ends the hole);
- the tokens that may extend a value where it may not;
- inside a UTF-8 character that expects k (1-3) more bytes, the tokens that keep it well-formed
  (`VocabIndex.utf8_continuing(k)`: every token a constraint over text may allow there).

The runner's greedy masks, numbered: 0, every token (unchecked picks: a free hole's); then two families of
four masks, (may not end, within a character of 1-3 more bytes) and (may end, the same three): a character
begun where the value could end goes back there when done, as most do (a text REGEX), and one begun where it
could not goes back there (a JSON string). `after[k, t]`: the mask of the next pick of a row that picked
token t under mask k, by the UTF-8 bytes t leaves pending (`VocabIndex.utf8_tables`) within k's family; mask
0 stays 0. The host moves the same way (`HoleLoop._pending`), and also where the value's may-end changes,
which the device cannot see: there the step run ahead is not taken (a guess, never a token).
"""
from __future__ import annotations

import numpy as np
import torch

from ..engine.picks import allows_every_token

FAMILY = 4  # masks a family: pending 0 (its base), then within a character expecting 1, 2, 3 more bytes


class Proposals:
    def __init__(self, vocab, extendable: np.ndarray, pick_all: torch.Tensor | None, device: torch.device):
        """`extendable`: bool [V], the tokens that may extend a value; `pick_all`: the tokens ever picked (None:
        every one)."""
        V = vocab.size
        every = allows_every_token(torch.ones(V, dtype=torch.bool, device=device)) if pick_all is None else \
            pick_all.clone()
        continuing = [vocab.utf8_continuing(k) & extendable for k in (1, 2, 3)]
        self.families = {
            False: [torch.from_numpy(extendable).to(device)] + [torch.from_numpy(c).to(device) for c in continuing],
            True: [every] + [torch.from_numpy(c).to(device) for c in continuing]}  # (distinct objects)
        self.masks: list[torch.Tensor | None] = [pick_all, *self.families[False], *self.families[True]]
        after = np.repeat(np.arange(len(self.masks), dtype=np.int32)[:, None], V, axis=1)
        for first in (1, 1 + FAMILY):
            for pending in range(FAMILY):
                after[first + pending] = first + vocab.utf8_tables(pending)[1][:V]
        self.after = torch.from_numpy(after)

    def mask(self, pending: int, can_end: bool) -> torch.Tensor:
        """The mask a checked pick proposes from where the value's last character expects `pending` more UTF-8
        bytes, in the family of whether the value could end where that character began (`pending` 0: whether
        it may end now)."""
        return self.families[can_end][pending]
