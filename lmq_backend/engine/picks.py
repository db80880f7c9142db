"""Picking a token: what a pick asks for, and the picks, on the logits' device.

What a pick asks for, settled before its logits exist: a `Draw` (a sampled pick: temperature, nucleus, the
uniform it inverts; the decoding knobs and the tokens they count), `Choices` (a beam's next tokens), `Checked`
(a greedy pick the host checks against a constraint). A `Sampler` is how a hole picks: `Greedy`, `Sampling`
(one uniform a pick, from its own generator), or a plugin's own `select`.

The decoding knobs (`Knobs`) change a row's logits before its mask selects among them: the penalties, from
the tokens the sampler has seen (`Tokens`), then, after the mask and the temperature, `top_k`. A row with
knobs is picked by `sample` (on the logits' device), never by a GPU step's own picks, so that no step runs
ahead on a pick made without its penalties.

The picks, for all rows of a step at once, one module per device behind these functions: `picks_cpu.py`
(lmq's C kernels where calibration chose them, rows in cache-sized groups) and `picks_gpu.py` (Triton
kernels, pinned copies; the picks a CUDA-graph step makes on the device). `masked_argmax` is the one greedy
pick (of `Greedy`, the runner's picks under its greedy masks and the fused step's device picks), `sample` the
one sampled pick (of `Sampling` and the steps that sample all their rows at once), `choose` a beam's choices:
whichever path picks, the token is the same.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import picks_cpu
from .picks_cpu import allows_every_token, inverse_cdf, masked_argmax, nucleus, penalized

__all__ = ["Checked", "Knobs", "Tokens", "Draw", "Choices", "Sampler", "Greedy", "Sampling", "masked_argmax",
           "greedy", "sample", "choose", "mask_picks", "numbering", "per_row", "allows_every_token", "inverse_cdf",
           "nucleus", "penalized"]


def _on(device: torch.device):
    """The picks module of `device`."""
    if device.type == "cuda":
        from . import picks_gpu  # (imports triton on first use: not at start-up)

        return picks_gpu
    return picks_cpu


# ----- what a pick asks for -------------------------------------------------------------------------------

class Checked(int):
    """A row's `ahead` (see `ModelRunner.decode`): one of the runner's greedy masks, as an int is, whose pick the
    host then checks against the row's own constraint and, where it fails, makes again from the step's
    logits: a step with such a row keeps its logits."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Knobs:
    """A sampler's decoding knobs, applied to a row's logits z [V] before its pick, in this order:

    - `repetition_penalty` p (transformers' `RepetitionPenaltyLogitsProcessor`): each distinct token of the
      sequence so far (prompt and generated, `Tokens.seen`) gets z * p where z < 0, else z / p (1: none);
    - `frequency_penalty` f and `presence_penalty` q (OpenAI's, vLLM's): z -= f * count, then z -= q where
      count > 0, count being how often the query call has generated the token (`Tokens.counts`; 0: none);
    - then the row's mask, and its temperature; then `top_k` k (transformers' `TopKLogitsWarper`, sampled
      picks only: a greedy pick is the best token either way): every token below the k-th largest value of
      what the mask allows is dropped (ties with it are kept); None: no cut. Then the nucleus (`top_p`)."""

    top_k: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def penalizes(self) -> bool:
        """Does any penalty change the logits?"""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(slots=True, eq=False)
class Tokens:
    """The tokens a sampler's penalties count, for its next pick: `seen`, the distinct tokens of the sequence
    (the prompt as the hole began, and each pick since: `Sampler.start`, `Sampler.took`); `counts`, how often
    the query call has picked each token, over all its holes."""

    seen: set[int] = field(default_factory=set)
    counts: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)  # (not frozen: a frozen dataclass's __init__ costs ~3x, once a pick a sampled row)
class Draw:
    """One sampled pick, settled before its logits exist: a token of softmax(logits / temperature) over the
    `allowed` tokens (bool [V], None: every token), cut to the smallest set of most probable tokens whose
    mass reaches `top_p`, chosen by inverting the cumulative distribution at `u` (uniform in [0, 1), from
    the sampler's own generator). Temperature 0 is the greedy pick. The token depends on the row's logits
    and its draw alone, so a decode step samples all its rows at once (`sample`). `after`: the u of the
    sampler's next draw (a GPU step run ahead samples with it), or None. `knobs`: the logits' adjustment
    first (`Knobs`), from `tokens` (read at the pick: the sampler adds the pick to them only after it). Never
    changed once made."""

    temperature: float
    top_p: float
    u: float
    allowed: torch.Tensor | None = None
    after: float | None = None
    knobs: Knobs | None = None
    tokens: Tokens | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Choices:
    """A beam's next choices, asked before its logits exist: the `k` most probable tokens of `extend` (bool
    [V], `count` of them) under the log-softmax over the `pickable` tokens (None: every token), best first,
    and where `can_end` the best log-probability of a token outside `extend` (ending the value there)."""

    k: int
    extend: torch.Tensor
    count: int
    can_end: bool
    pickable: torch.Tensor | None = None


class Sampler:
    """How a hole picks its tokens. `select` picks from one row's logits; the engine's own samplers (`Greedy`,
    `Sampling`) also say so ahead of the logits, so that a step picks all its rows at once. A sampler with
    `knobs` (one a query call: its `tokens` are the call's) is told the sequence as each hole begins
    (`start`) and each token picked (`took`)."""

    knobs: Knobs | None = None
    tokens: Tokens | None = None

    def __init__(self, knobs: Knobs | None = None):
        self.knobs = knobs
        self.tokens = Tokens() if knobs is not None else None

    def select(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> int:
        """Pick a token id. logits: [V] float; allowed: bool [V] or None for every token."""
        raise NotImplementedError

    def start(self, ids: list[int]) -> None:
        """A hole begins after the sequence `ids` (its tokens are what a repetition penalty reads from now)."""
        if self.tokens is not None:
            self.tokens.seen = set(ids)

    def took(self, token: int) -> None:
        """The hole picked `token` (it counts for the next picks' penalties)."""
        if self.tokens is not None:
            self.tokens.seen.add(token)
            self.tokens.counts[token] = self.tokens.counts.get(token, 0) + 1


class Greedy(Sampler):
    """The first maximal allowed logit (after the penalties of its `knobs`, if any)."""

    def draw(self, allowed: torch.Tensor | None) -> Draw:
        """The next pick as a draw at temperature 0 with the knobs (a sampler with knobs picks by draws)."""
        return Draw(0.0, 1.0, 0.0, allowed, None, self.knobs, self.tokens)

    def select(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> int:
        if self.knobs is not None:
            return int(sample(logits[None], [self.draw(allowed)])[0])
        return int(masked_argmax(logits, allowed))


class Sampling(Sampler):
    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 knobs: Knobs | None = None):
        super().__init__(knobs)
        self.temperature, self.top_p = temperature, top_p
        # Python's Mersenne Twister (seeded from the OS without a seed): a uniform costs far less than
        # torch.rand on a torch.Generator, once a pick at 1,000s of concurrent queries
        self.generator = random.Random(seed)
        self._next = self.generator.random()

    def draw(self, allowed: torch.Tensor | None) -> Draw:
        """The next pick's draw (one uniform from the generator), before its logits exist: a decode step
        samples the rows of all its queries' draws at once (`sample`). It tells the uniform of the draw
        after it too (a GPU step run ahead samples with that)."""
        u, self._next = self._next, self.generator.random()
        return Draw(self.temperature, self.top_p, u, allowed, self._next, self.knobs, self.tokens)

    def select(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> int:
        return int(sample(logits[None], [self.draw(allowed)])[0])


# ----- the picks ------------------------------------------------------------------------------------------

def greedy(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Row i's greedy pick of `logits` [R, V] under masks[i] (bool [V], None: every token): `masked_argmax`'s
    pick, for all rows at once. int64 [R] on the logits' device."""
    return _on(logits.device).greedy(logits, masks)


def sample(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """The token of each row of `logits` [R, V] under its draw, a few ops for all rows (not a pick a row); rows
    with knobs on their own copy of their logits, adjusted. Returns [R] int64 on the logits' device. A row's
    token is the same whatever rows share the call."""
    return _on(logits.device).sample(logits, draws)


def choose(logits: torch.Tensor, asks: list[Choices]) -> list[tuple[list[int], list[float], float | None]]:
    """Each row's choices (`Choices`) from `logits` [R, V], all rows at once, one copy to the host. Per row:
    (token ids, their log-probabilities, best first, without tokens of no probability; the log-probability of
    ending, None where the value cannot end or no token ends it)."""
    return _on(logits.device).choose(logits, asks)


def mask_picks(masks: list[torch.Tensor | None], device: torch.device) -> Callable:
    """The greedy picks under each of `masks` (bool [V], None: every token), of every row of a step's logits
    on `device`: `mask_picks(masks, device)(logits)` is `picks(k, row)`, `masked_argmax(logits[row],
    masks[k])`, all rows' in one op a mask (a GPU's in one op for every mask, one copy to the host)."""
    return _on(device).MaskPicks(masks)


def numbering(masks) -> dict[int, int]:
    """id of each mask object (None too) -> its number in `masks` (the first, where one repeats); the masks must
    be held for as long as the ids are looked up."""
    return {id(m): k for k, m in reversed(list(enumerate(masks or ())))}


def per_row(pick, logits: torch.Tensor, asks: list, rows: list[int] | None = None) -> dict:
    """A step's picks for the rows that asked for one (`asks[k]` not None: a `Draw`, `Choices`), by k, made
    for all of them at once by `pick(logits, [(row, ask), ...])` (`ModelRunner.sample`, `ModelRunner.choose`);
    ask k is on row rows[k] of `logits` (None: row k; asks may share a row)."""
    pairs = [(k, a) for k, a in enumerate(asks) if a is not None]
    if not pairs:
        return {}
    return dict(zip((k for k, _ in pairs), pick(logits, pairs if rows is None else [(rows[k], a) for k, a in pairs])))
