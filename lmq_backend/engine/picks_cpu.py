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
    pick a row): rows with knobs on a copy of their logits with their penalties applied (`penalized`); then
    rows without a nucleus or a top-k by `plain_rows(part, masks, temperature [n], u [n])` (the GPU's kernel)
    or `inverse_cdf`; rows that cut a nucleus or a top-k by `inverse_cdf` everywhere; temperature 0 greedy.
    Returns [R] int64 on the logits' device. A row's token is the same whatever rows share the call (each
    row's arithmetic is its own; the rows are sorted into groups by what they cut, and by their knobs)."""
    knobbed = [i for i, d in enumerate(draws) if d.knobs is not None]
    if not knobbed:
        return _sample(logits, draws, plain_rows)
    device, r = logits.device, logits.shape[0]
    picks = torch.empty(r, dtype=torch.long, device=device)
    rest = [i for i, d in enumerate(draws) if d.knobs is None]
    if rest:
        idx = torch.tensor(rest, device=device)
        picks[idx] = _sample(logits[idx], [draws[i] for i in rest], plain_rows)
    idx = torch.tensor(knobbed, device=device)
    part = [draws[i] for i in knobbed]
    picks[idx] = _sample(penalized(logits[idx].float(), part), part, plain_rows)  # (logits[idx]: a copy)
    return picks


def _sample(logits: torch.Tensor, draws: list, plain_rows) -> torch.Tensor:
    """`sample` after the penalties: the rows by what they cut (nucleus, top-k), each group at once."""
    device, r = logits.device, logits.shape[0]
    temperature = _column([d.temperature for d in draws], device)  # (greedy rows are not sampled below)
    u = _column([d.u for d in draws], device)
    picks = torch.empty(r, dtype=torch.long, device=device)
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, d in enumerate(draws):
        if d.temperature > 0:
            groups.setdefault((d.top_p < 1, d.knobs is not None and d.knobs.top_k is not None), []).append(i)
    for (cuts_p, cuts_k), rows in groups.items():
        idx = torch.tensor(rows, device=device)
        part = logits if len(rows) == r else logits[idx]
        masks = [draws[i].allowed for i in rows]
        if not cuts_p and not cuts_k and plain_rows is not None:
            picks[idx] = plain_rows(part, masks, temperature[idx, 0], u[idx, 0])
        else:
            top_p = _column([draws[i].top_p for i in rows], device) if cuts_p else None
            top_k = [draws[i].knobs.top_k for i in rows] if cuts_k else None
            picks[idx] = inverse_cdf_rows(part.float(), masks, temperature[idx], u[idx], top_p, top_k)
    argmax_rows = [i for i, d in enumerate(draws) if d.temperature <= 0]
    if argmax_rows:
        idx = torch.tensor(argmax_rows, device=device)
        part = logits if len(argmax_rows) == r else logits[idx]
        picks[idx] = greedy(part, [draws[i].allowed for i in argmax_rows])
    return picks


def penalized(z: torch.Tensor, draws: list) -> torch.Tensor:
    """z [R, V] float32 (changed in place: give a copy) with row i's penalties (`picks.Knobs`: draws[i].knobs,
    from the tokens draws[i].tokens), as transformers' `RepetitionPenaltyLogitsProcessor` computes the
    repetition penalty (a scalar multiply or divide, all rows of one penalty at once) and vLLM the frequency
    and presence penalties (z - f * count - q). Rows without knobs are left as they are. Returns z."""
    repeated: dict[float, tuple[list[int], list[int]]] = {}  # penalty -> (rows, token ids)
    rows, ids, f, q, counts = [], [], [], [], []
    for i, d in enumerate(draws):
        knobs, tokens = d.knobs, d.tokens
        if knobs is None or tokens is None:
            continue
        if knobs.repetition_penalty != 1.0 and tokens.seen:
            at, seen = repeated.setdefault(knobs.repetition_penalty, ([], []))
            at.extend([i] * len(tokens.seen))
            seen.extend(tokens.seen)
        if (knobs.frequency_penalty != 0.0 or knobs.presence_penalty != 0.0) and tokens.counts:
            n = len(tokens.counts)
            rows.extend([i] * n)
            ids.extend(tokens.counts)
            counts.extend(tokens.counts.values())
            f.extend([knobs.frequency_penalty] * n)
            q.extend([knobs.presence_penalty] * n)
    device = z.device
    for penalty, (at, seen) in repeated.items():
        r, c = torch.tensor(at, device=device), torch.tensor(seen, device=device)
        s = z[r, c]
        z[r, c] = torch.where(s < 0, s * penalty, s / penalty)
    if rows:
        r, c = torch.tensor(rows, device=device), torch.tensor(ids, device=device)
        column = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
        z[r, c] = z[r, c] - column(f) * column(counts) - column(q)
    return z


def group_rows(logits: torch.Tensor) -> int:
    """How many rows of `logits` [R, V] a CPU takes at a time (all of them elsewhere)."""
    return len(logits) if logits.device.type != "cpu" else max(1, CPU_CHUNK_BYTES // (4 * logits.shape[1]))


def inverse_cdf_rows(z: torch.Tensor, masks: list[torch.Tensor | None], temperature: torch.Tensor,
                     u: torch.Tensor, top_p: torch.Tensor | None, top_k: list[int] | None = None) -> torch.Tensor:
    """`inverse_cdf` of the rows of z [R, V] under their masks; on a CPU a group of rows at a time, whose
    softmax and cumulative sum stay in the caches between their passes. A row's token is the same either
    way (each row's arithmetic is its own)."""
    n = group_rows(z)
    if n >= len(masks):
        return inverse_cdf(masked(z, masks), temperature, u, top_p, top_k)
    return torch.cat([inverse_cdf(masked(z[i:i + n], masks[i:i + n]), temperature[i:i + n], u[i:i + n],
                                  None if top_p is None else top_p[i:i + n], None if top_k is None else top_k[i:i + n])
                      for i in range(0, len(masks), n)])


def inverse_cdf(z: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                top_p: torch.Tensor | None = None, top_k: list[int] | None = None) -> torch.Tensor:
    """Per row of the masked logits z [R, V] (float32), the token of softmax(z / temperature), cut to its
    top_k most probable tokens (ties with the k-th kept, as transformers' `TopKLogitsWarper` cuts) and then to
    the top_p nucleus, at which the cumulative mass passes u times the whole (temperature, u, top_p: float32
    [R, 1]; top_k: an int a row). `sample`'s arithmetic, and a CUDA-graph step's without Triton
    (`picks_gpu.pick_in_step`), so that both pick alike."""
    z = z / temperature
    if top_k is not None:
        z = top_k_cut(z, top_k)
    p = torch.softmax(z, dim=-1)
    if top_p is not None:  # the most probable tokens, kept in the vocabulary's order (as cut, not as
        # sorted: a near-tie in two tokens' last bits must not reorder what u selects)
        p = p * nucleus(p, top_p)
    cdf = p.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    # never past the last token with mass (u * total may round up to total)
    return torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total))[:, 0]


def top_k_cut(z: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """z [R, V] with -inf where a logit is below the top_k[i]-th largest of row i (a k past V: none cut)."""
    v = z.shape[1]
    k = [min(k, v) for k in top_k]
    kth = z.topk(max(k), dim=-1).values.gather(1, torch.tensor(k, device=z.device)[:, None] - 1)
    return z.masked_fill(z < kth, float("-inf"))


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
