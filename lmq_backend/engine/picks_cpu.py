"""Token picks on the CPU, and the torch arithmetic of picks that every device shares.

The CPU's own: the greedy pick through lmq's kernel (`lmq_kernels.cpu.masked_argmax`, where calibration chose
it), sampling and choices a group of rows at a time (each group's softmax and cumulative sum stay in the
caches between their passes), the picks under the runner's greedy masks made at each mask's first use
(`MaskPicks`). Shared with the GPU's module (`picks_gpu.py`): the masked argmax, the inverse CDF and nucleus
of a sampled pick, a beam's choices, the mask tables. Draws and choices come duck-typed (`picks.Draw`,
`picks.Choices`): this module is below the interface (`picks.py`) that defines them.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

_EVERY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # see `allows_every_token`

CPU_CHUNK_BYTES = 6 << 20  # a CPU samples rows in groups of about this many bytes of logits
NUCLEUS_CANDIDATES = (64, 1024)  # how many of a row's most probable tokens `nucleus` looks among, in turn


def allows_every_token(mask: torch.Tensor) -> torch.Tensor:
    """Mark `mask` (bool [V], all True) as what it is: the host picks under it as under None (no mask pass),
    where a mask object distinct from None is needed (one of the runner's greedy masks: `PickMasks`)."""
    _EVERY[id(mask)] = mask
    return mask


def plain(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask to apply: None where `mask` allows every token (`allows_every_token`)."""
    return None if mask is None or _EVERY.get(id(mask)) is mask else mask


# ----- greedy ---------------------------------------------------------------------------------------------

def masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Index of the largest logit among the allowed tokens, over the last dimension.

    logits: [..., V]; allowed: bool broadcastable to logits (e.g. [V], or [K, 1, V] against [1, B, V] for a
    pick under each of K masks), or None for every token; moved to the logits' device. Ties go to the
    first maximal logit (torch.argmax), so the pick is exact and the same on every device. Returns [...]
    (int64, on the logits' device)."""
    allowed = plain(allowed)
    if logits.device.type == "cpu" and logits.dim() <= 2 and (allowed is None or allowed.dim() == 1):
        rows = logits.reshape(-1, logits.shape[-1])
        return greedy(rows, [allowed] * len(rows)).reshape(logits.shape[:-1])
    if allowed is not None:
        allowed = allowed.to(logits.device, non_blocking=logits.device.type == "cuda")
        logits = torch.where(allowed, logits, float("-inf"))
    return logits.argmax(-1)


def greedy(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Row i's greedy pick of `logits` [R, V] under masks[i] (bool [V], None: every token): `masked_argmax`'s
    pick, for all rows at once. On a CPU lmq's kernel (one pass a row, each mask read where it lies) where
    calibration chose it; else one where and one argmax. int64 [R] on the logits' device."""
    z, masks = logits.float(), [plain(m) for m in masks]
    if z.device.type == "cpu":
        from lmq_kernels import cpu  # (not at start-up)

        out = torch.empty(len(masks), dtype=torch.long)
        if cpu.masked_argmax(z, None if all(m is None for m in masks) else masks, out):
            return out
    return masked(z, masks).argmax(-1)


class MaskPicks:
    """The greedy picks of a step's rows under each of the runner's greedy masks, as `picks(k, row)`: on the
    CPU a mask's picks for every row at its first use (read them before the logits change)."""

    def __init__(self, masks: list[torch.Tensor | None]):
        self.masks = masks

    def __call__(self, logits: torch.Tensor) -> Callable[[int, int], int]:
        masks, done = self.masks, {}

        def pick(k: int, i: int) -> int:
            column = done.get(k)
            if column is None:
                column = done[k] = masked_argmax(logits, masks[k]).tolist()
            return column[i]
        return pick


# ----- sampling -------------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, draws: list, plain_rows=None) -> torch.Tensor:
    """The token of each row of `logits` [R, V] under its draw (`picks.Draw`), a few ops for all rows (not a
    pick a row): rows without a nucleus by `plain_rows(part, masks, temperature [n], u [n])` (the GPU's
    kernel) or `inverse_cdf`; rows that cut a nucleus by `inverse_cdf` everywhere; temperature 0 greedy.
    Returns [R] int64 on the logits' device. A row's token is the same whatever rows share the call (each
    row's arithmetic is its own; the rows that cut a nucleus are sorted apart from those that do not)."""
    device, r = logits.device, logits.shape[0]
    temperature = _column([d.temperature for d in draws], device)  # (greedy rows are not sampled below)
    u = _column([d.u for d in draws], device)
    picks = torch.empty(r, dtype=torch.long, device=device)
    flat = [i for i, d in enumerate(draws) if d.temperature > 0 and d.top_p >= 1]
    cut = [i for i, d in enumerate(draws) if d.temperature > 0 and d.top_p < 1]
    for rows, top_p in ((flat, None), (cut, _column([draws[i].top_p for i in cut], device))):
        if not rows:
            continue
        idx = torch.tensor(rows, device=device)
        part = logits if len(rows) == r else logits[idx]
        masks = [draws[i].allowed for i in rows]
        if top_p is None and plain_rows is not None:
            picks[idx] = plain_rows(part, masks, temperature[idx, 0], u[idx, 0])
        else:
            picks[idx] = inverse_cdf_rows(part.float(), masks, temperature[idx], u[idx], top_p)
    argmax_rows = [i for i, d in enumerate(draws) if d.temperature <= 0]
    if argmax_rows:
        idx = torch.tensor(argmax_rows, device=device)
        part = logits if len(argmax_rows) == r else logits[idx]
        picks[idx] = greedy(part, [draws[i].allowed for i in argmax_rows])
    return picks


def group_rows(logits: torch.Tensor) -> int:
    """How many rows of `logits` [R, V] a CPU takes at a time (all of them elsewhere)."""
    return len(logits) if logits.device.type != "cpu" else max(1, CPU_CHUNK_BYTES // (4 * logits.shape[1]))


def inverse_cdf_rows(z: torch.Tensor, masks: list[torch.Tensor | None], temperature: torch.Tensor,
                     u: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """`inverse_cdf` of the rows of z [R, V] under their masks; on a CPU a group of rows at a time, whose
    softmax and cumulative sum stay in the caches between their passes. A row's token is the same either
    way (each row's arithmetic is its own)."""
    n = group_rows(z)
    if n >= len(masks):
        return inverse_cdf(masked(z, masks), temperature, u, top_p)
    return torch.cat([inverse_cdf(masked(z[i:i + n], masks[i:i + n]), temperature[i:i + n], u[i:i + n],
                                  None if top_p is None else top_p[i:i + n]) for i in range(0, len(masks), n)])


def inverse_cdf(z: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of the masked logits z [R, V] (float32), the token of softmax(z / temperature), cut to the
    top_p nucleus, at which the cumulative mass passes u times the whole (temperature, u, top_p: float32
    [R, 1]). `sample`'s arithmetic, and a CUDA-graph step's without Triton (`picks_gpu.pick_in_step`), so
    that both pick alike."""
    p = torch.softmax(z / temperature, dim=-1)
    if top_p is not None:  # the most probable tokens, kept in the vocabulary's order (as cut, not as
        # sorted: a near-tie in two tokens' last bits must not reorder what u selects)
        p = p * nucleus(p, top_p)
    cdf = p.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    # never past the last token with mass (u * total may round up to total)
    return torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total))[:, 0]


def nucleus(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of the probabilities p [R, V], the smallest set of most probable tokens whose mass reaches
    top_p ([R, 1]; of equal probabilities the lower id first): bool [R, V]. Each row is cut among its 64, then
    1,024 most probable tokens (a top-k, far cheaper than sorting the row) where the cut lies there, strictly
    above every token left out; else its whole row is sorted. The same set either way: the tokens kept, their
    order and their running mass are those of the sort."""
    r, v = p.shape
    keep = torch.zeros(r, v, dtype=torch.bool, device=p.device)
    rows = torch.arange(r, device=p.device)
    for k in NUCLEUS_CANDIDATES:
        if k >= v or not len(rows):
            break
        values, ids = (p if len(rows) == r else p[rows]).topk(k, dim=-1)
        by_id = ids.argsort(dim=-1)  # then a stable sort by value: of equal values the lower id first
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
        order = values.argsort(dim=-1, descending=True, stable=True)
        ranked, ids = values.gather(1, order), ids.gather(1, order)
        kept = ranked.cumsum(-1) - ranked < top_p[rows]  # a prefix of the ranking
        n = kept.sum(-1)
        last = ranked.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        cut = (n < k) & (last > ranked[:, -1])  # every token outside the k is below the last one kept
        if cut.any():
            done = cut.nonzero()[:, 0]
            keep[rows[done]] = torch.zeros(len(done), v, dtype=torch.bool, device=p.device).scatter_(
                1, ids[done], kept[done])
            rows = rows[~cut]
    if len(rows):
        ranked, order = (p if len(rows) == r else p[rows]).sort(dim=-1, descending=True, stable=True)
        kept = ranked.cumsum(-1) - ranked < top_p[rows]
        keep[rows] = torch.zeros_like(kept).scatter_(1, order, kept)
    return keep


# ----- a beam's choices -----------------------------------------------------------------------------------

def choose(logits: torch.Tensor, asks: list) -> list[tuple[list[int], list[float], float | None]]:
    """Each row's choices (`picks.Choices`) from `logits` [R, V]: one log-softmax, one top-k and one copy to
    the host for all rows. Per row: (token ids, their log-probabilities, best first, without tokens of no
    probability; the log-probability of ending, None where the value cannot end or no token ends it). On a
    CPU a group of rows at a time, as `sample`."""
    n = group_rows(logits)
    if n < len(asks):
        return [c for i in range(0, len(asks), n) for c in choose(logits[i:i + n], asks[i:i + n])]
    logp = torch.log_softmax(masked(logits.float(), [a.pickable for a in asks]), dim=-1)
    extend = stacked([a.extend for a in asks], logits.shape[1], logits.device)
    width = max(min(a.k, a.count) for a in asks)
    top = torch.topk(logp.masked_fill(~extend, float("-inf")), width)
    ends = logp.masked_fill(extend, float("-inf")).amax(-1)
    ids, values, ends = top.indices.tolist(), top.values.tolist(), ends.tolist()
    out = []
    for a, row_ids, row_values, end in zip(asks, ids, values, ends):
        n = min(a.k, a.count)
        keep = [j for j in range(n) if row_values[j] > float("-inf")]
        out.append(([row_ids[j] for j in keep], [row_values[j] for j in keep],
                    end if a.can_end and end > float("-inf") else None))
    return out


# ----- masks ----------------------------------------------------------------------------------------------

def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def masked(z: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """z [R, V] with -inf where row i's mask (bool [V], None: every token) is False."""
    allowed = stacked(masks, z.shape[1], z.device)
    return z if allowed is None else torch.where(allowed, z, float("-inf"))


def stacked(masks: list[torch.Tensor | None], v: int, device: torch.device) -> torch.Tensor | None:
    """Row i's mask (bool [V], None: every token) as row i of a [R, V] (or, one mask for all, [1, V]) bool
    tensor on `device`; None where no row has a mask."""
    table, index = mask_table(masks, v, device)
    if table is None or len(table) == 1:
        return table
    return table[torch.tensor(index, device=device)]


def mask_table(masks: list[torch.Tensor | None], v: int, device: torch.device
               ) -> tuple[torch.Tensor | None, list[int]]:
    """The distinct masks (bool [M, V] on `device`, each moved once; None where no row has a mask) and the
    index of row i's."""
    index: dict[int, int] = {}
    unique: list[torch.Tensor | None] = []
    for m in masks:
        if id(m) not in index:
            index[id(m)] = len(unique)
            unique.append(plain(m))
    rows = [index[id(m)] for m in masks]
    if all(m is None for m in unique):
        return None, [0] * len(rows)
    far = [j for j, m in enumerate(unique) if m is not None and m.device.type != device.type]
    if len(far) > 1:  # the host's masks (a constraint's, one a row) in one copy, not one a mask
        for j, m in zip(far, torch.stack([unique[j] for j in far]).to(device, non_blocking=True)):
            unique[j] = m
    on = [torch.ones(v, dtype=torch.bool, device=device) if m is None else m.to(device, non_blocking=True)
          for m in unique]
    return torch.stack(on), rows
