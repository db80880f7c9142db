"""The token masks a hole picks under (`PickMasks`, one per backend): the tokens that may extend a value, those
the tokenizer has, and the device's masks for picks made before a constraint's check (`Proposals`, with how a
row moves from one to the next, so that a GPU step run ahead (`FusedDecoder.run_ahead`) picks under the mask its
row's next pick will use).

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

from ..engine.picks import allows_every_token, numbering
from ..text.vocab import VocabIndex

FAMILY = 4  # masks a family: pending 0 (its base), then within a character expecting 1, 2, 3 more bytes


class Proposals:
    """The runner's greedy masks as numbered above, their families, and `after` (see the module docstring)."""

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


class PickMasks:
    """The backend's token masks, built once: `extendable` (bool [V], numpy: the tokens that may extend a value,
    all but the special ones), `pickable` (bool [V] on the device: the tokens the tokenizer has, the only ones
    ever picked; None where that is every id of the model's vocabulary), the `proposals` a checked pick
    proposes from, and `greedy`, the runner's greedy masks (every token, then the proposals' families): a
    greedy pick under one of them may come from the device."""

    def __init__(self, vocab: VocabIndex, tokens: int, device: torch.device):
        """`tokens`: the ids the tokenizer has (a model's vocabulary may be padded beyond them)."""
        self.extendable = ~vocab.special
        self.extendable_any = bool(self.extendable.any())
        self.extendable_count = int(self.extendable.sum())
        pickable = np.arange(vocab.size) < tokens
        self.pickable = None if pickable.all() else torch.from_numpy(pickable).to(device)
        self.proposals = Proposals(vocab, self.extendable, self.pickable, device)
        self.greedy = tuple(self.proposals.masks)
        self._number = numbering(self.greedy)
        self.extendable_on_device = self.proposals.mask(0, False)
        self._under: dict[int, tuple] = {}  # id of a constraint's shared mask -> (it, `under`'s answer)

    def under(self, allowed: np.ndarray | None) -> tuple[np.ndarray, bool, torch.Tensor | None]:
        """The tokens that may extend a value where `allowed` (None: every token) are, whether one may, and
        they as a tensor (None where `allowed` is). A read-only `allowed` is a constraint's shared mask
        (`HoleState.allowed`): its answer is memoized by identity, so that the rows in one state pick under one
        mask object (a step stacks and moves it once, not once a row)."""
        if allowed is None:
            return self.extendable, self.extendable_any, None
        shared = not allowed.flags.writeable
        hit = self._under.get(id(allowed)) if shared else None
        if hit is not None and hit[0] is allowed:
            return hit[1:]
        extendable = allowed & self.extendable
        answer = (extendable, bool(extendable.any()), torch.from_numpy(extendable))
        if shared:
            extendable.flags.writeable = False
            if len(self._under) >= 256:
                self._under.clear()
            self._under[id(allowed)] = (allowed, *answer)
        return answer

    def greedy_mask(self, pick: torch.Tensor | None) -> int | None:
        """Which of the greedy masks `pick` is (a greedy pick under it may come from the device), or None."""
        return self._number.get(id(pick))

    def proposal(self, pending: int, can_end: bool) -> torch.Tensor:
        """The device's mask a checked pick proposes from (`Proposals.mask`)."""
        return self.proposals.mask(pending, can_end)
