"""`masked_argmax`, the one greedy pick of the runtime (`Greedy`), the runner's prefill picks and the fused
step's device picks: the first maximal allowed logit, alone or broadcast over masks and rows, on a CPU through
lmq's kernel (`lmq_kernels.cpu.masked_argmax`, each variant this host runs) or torch's. `sample`, the one
sampled pick (`Sampling` and the steps that sample all their rows at once): a row's token is its own, whatever
rows share the call. `choose`, a beam's next choices, the same way."""
from __future__ import annotations

import pytest
import torch

from lmq_backend.engine.picks import Choices, Draw, choose, greedy, masked_argmax, nucleus, sample
from lmq_backend.engine.picks import Greedy, Sampling
from lmq_kernels import cpu
from support.cpu_targets import TARGETS  # noqa: F401 (the variants `kernels` runs)
from support.cpu_targets import kernels  # noqa: F401 (fixture)


def test_ties_go_to_the_first_maximal_allowed_logit():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert int(masked_argmax(logits, None)) == 1
    assert int(masked_argmax(logits, torch.tensor([True, False, True, True, True]))) == 2
    assert int(masked_argmax(logits, torch.tensor([True, False, False, True, False]))) == 3
    assert Greedy().select(logits, torch.tensor([True, False, False, False, True])) == 4


def test_masks_by_rows_is_each_pick_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (5, 50), generator=gen).float()  # many ties
    masks = torch.rand(3, 50, generator=gen) < 0.5
    table = masked_argmax(logits[None], masks[:, None])  # [K, B]
    assert table.shape == (3, 5)
    for k in range(3):
        for b in range(5):
            assert int(table[k, b]) == Greedy().select(logits[b], masks[k])
            assert int(table[k, b]) == int(torch.where(masks[k], logits[b], float("-inf")).argmax())


@pytest.mark.parametrize("v", [49152, 1003, 7])
def test_the_kernels_greedy_pick_is_torchs(kernels, v):
    """lmq's pick against torch's where + argmax: ties (the first maximal logit), -inf logits, a mask allowing
    nothing (0), rows without a mask, rows sharing one, a vocabulary that is not a whole number of vectors;
    a row's pick is its own, on one thread or two."""
    gen = torch.Generator().manual_seed(v)
    for r in (1, 2, 9, 64):
        logits = torch.randint(0, 5, (r, v), generator=gen).float() if r % 2 else torch.randn(r, v, generator=gen)
        logits[0, : v // 2] = float("-inf")
        shared = torch.rand(v, generator=gen) < 0.01
        masks = [None if i % 4 == 3 else shared if i % 4 == 2 else torch.rand(v, generator=gen) < 0.5
                 for i in range(r)]
        if r > 1:
            masks[1] = torch.zeros(v, dtype=torch.bool)
        want = [int(torch.where(m, row, float("-inf")).argmax()) if m is not None else int(row.argmax())
                for row, m in zip(logits, masks)]
        out = torch.empty(r, dtype=torch.long)
        assert cpu.masked_argmax(logits, masks, out) and out.tolist() == want
        assert cpu.masked_argmax(logits, None, out) and out.tolist() == logits.argmax(-1).tolist()
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert cpu.masked_argmax(logits, masks, out) and out.tolist() == want
        finally:
            torch.set_num_threads(threads)
        assert greedy(logits, masks).tolist() == want
    # what it does not take: torch's form runs
    assert not cpu.masked_argmax(logits.double(), masks, out)
    assert not cpu.masked_argmax(logits[:, :-1], masks, out)
    assert not cpu.masked_argmax(logits, masks[:-1], out)


def in_groups(monkeypatch, rows: int | None, v: int) -> None:
    """A CPU's sampling and choices take `rows` rows of `v` logits at a time (None: as they come)."""
    from lmq_backend.engine import picks_cpu

    if rows:
        monkeypatch.setattr(picks_cpu, "CPU_CHUNK_BYTES", rows * 4 * v)


@pytest.mark.parametrize("group", [None, 5], ids=["one group", "groups of 5 rows"])
def test_a_rows_sample_does_not_depend_on_the_rows_beside_it(group, monkeypatch):
    """Rows with other temperatures, nuclei, masks (or none) and greedy rows in one call: each row's token is
    the one it gets alone, and `Sampling.select` (one row) is the same function of the same draw; also where
    a CPU samples the rows a group at a time (`picks.CPU_CHUNK_BYTES`)."""
    gen = torch.Generator().manual_seed(1)
    v = 300
    in_groups(monkeypatch, group, v)
    logits = torch.randn(24, v, generator=gen) * 3
    masks = [None, torch.rand(v, generator=gen) < 0.3, torch.rand(v, generator=gen) < 0.05]
    draws = [Draw(temperature=[1.0, 0.7, 0.0, 2.0][i % 4], top_p=[1.0, 0.9, 0.5][i % 3],
                  u=float(torch.rand((), generator=gen)), allowed=masks[i % 3]) for i in range(24)]
    together = sample(logits, draws)
    alone = [int(sample(logits[i:i + 1], [d])[0]) for i, d in enumerate(draws)]
    assert together.tolist() == alone
    for i, d in enumerate(draws):
        if d.allowed is not None:
            assert d.allowed[alone[i]]
        if d.temperature == 0:
            assert alone[i] == Greedy().select(logits[i], d.allowed)
    # the same draw from a seeded sampler gives its select's token
    a, b = Sampling(0.8, 0.95, seed=7), Sampling(0.8, 0.95, seed=7)
    for i in range(10):
        assert a.select(logits[i], masks[1]) == int(sample(logits[i:i + 1], [b.draw(masks[1])])[0])


def test_the_draw_inverts_the_cumulative_distribution():
    """u picks the first token whose cumulative mass passes u (tokens without mass are never picked, not
    even at u just below 1)."""
    logits = torch.log(torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0]]))
    for u, want in [(0.0, 0), (0.49, 0), (0.5, 2), (0.74, 2), (0.76, 3), (1 - 2 ** -24, 3)]:
        assert int(sample(logits, [Draw(1.0, 1.0, u)])[0]) == want, u
    # a nucleus of 0.6: the two most probable tokens (0.5, then one of the 0.25s), renormalised to 2/3, 1/3
    picks = [int(sample(logits, [Draw(1.0, 0.6, u)])[0]) for u in (0.6, 0.7, 0.99)]
    assert picks[0] == 0 and picks[1] == picks[2] in (2, 3)


@pytest.mark.parametrize("group", [None, 4], ids=["one group", "groups of 4 rows"])
def test_a_rows_choices_are_its_own_top_k(group, monkeypatch):
    """Beams' choices in one call: each row's are its top-k of the extendable tokens under the log-softmax
    over the pickable ones, best first, no token of no probability; the best ending where it may end (also
    where a CPU takes the rows a group at a time)."""
    gen = torch.Generator().manual_seed(2)
    v = 200
    in_groups(monkeypatch, group, v)
    logits = torch.randn(6, v, generator=gen) * 2
    pickable = torch.arange(v) < 190
    extends = [torch.rand(v, generator=gen) < 0.5, torch.zeros(v, dtype=torch.bool), torch.arange(v) < 2]
    extends[1][185:195] = True  # five of them not pickable
    asks = [Choices(k=[3, 8, 5][i % 3], extend=extends[i % 3], count=int(extends[i % 3].sum()),
                    can_end=i % 2 == 0, pickable=pickable) for i in range(6)]
    together = choose(logits, asks)
    assert together == [choose(logits[i:i + 1], [a])[0] for i, a in enumerate(asks)]
    for row, a, (ids, lps, end) in zip(logits, asks, together):
        logp = torch.log_softmax(torch.where(pickable, row, float("-inf")), -1)
        want = sorted((i for i in range(v) if a.extend[i] and pickable[i]), key=lambda i: -float(logp[i]))
        assert ids == want[:a.k] and lps == pytest.approx([float(logp[i]) for i in ids])
        outside = [float(logp[i]) for i in range(v) if not a.extend[i] and pickable[i]]
        assert end == (pytest.approx(max(outside)) if a.can_end else None)


def whole_sort_nucleus(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by sorting each whole row (of equal probabilities the lower id first)."""
    ranked, order = p.sort(dim=-1, descending=True, stable=True)
    kept = ranked.cumsum(-1) - ranked < top_p
    return torch.zeros_like(kept).scatter_(1, order, kept)


def test_the_nucleus_among_the_most_probable_tokens_is_the_whole_sorts():
    """`nucleus` cuts most rows among their 64 or 1,024 most probable tokens: the same tokens as sorting the
    whole row, for peaked and flat rows, ties (at the cut too), masked tokens, every top_p; each tier taken."""
    gen = torch.Generator().manual_seed(0)
    v = 5000
    rows = []
    for spread in (0.3, 1.0, 3.0, 8.0, 20.0):  # flat (the whole sort) to peaked (the first tier)
        rows.append(torch.randn(16, v, generator=gen) * spread)
    tied = torch.randint(0, 6, (16, v), generator=gen).float()  # many equal logits, at the cut as well
    rows.append(tied)
    masked = torch.randn(16, v, generator=gen) * 4
    masked[torch.rand(16, v, generator=gen) < 0.7] = float("-inf")
    rows.append(masked)
    straddling = torch.full((4, v), float("-inf"))  # a few tokens above 500 equal ones, cut among those
    for i in range(4):
        straddling[i, torch.randperm(v, generator=gen)[:500]] = 2.0
        straddling[i, torch.randperm(v, generator=gen)[:3]] = 5.0
    rows.append(straddling)
    z = torch.cat(rows)
    p = torch.softmax(z, dim=-1)
    tiers = {"64": 0, "1024": 0, "sort": 0}
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        t = torch.full((len(z), 1), top_p)
        got, want = nucleus(p, t), whole_sort_nucleus(p, t)
        assert torch.equal(got, want), top_p
        for n in want.sum(-1).tolist():
            tiers["64" if n < 64 else "1024" if n < 1024 else "sort"] += 1
    assert all(tiers.values()), tiers
    # rows alone and together agree (each row's cut is its own)
    t = torch.full((len(z), 1), 0.9)
    together = nucleus(p, t)
    assert all(torch.equal(nucleus(p[i:i + 1], t[i:i + 1])[0], together[i]) for i in range(0, len(z), 7))


def test_a_mask_marked_as_every_token_is_no_mask():
    """`allows_every_token`: a mask object of its own (a greedy mask of the device's) that host picks treat as
    None: no mask table, no pass over it."""
    from lmq_backend.engine import picks, picks_cpu

    z = torch.randn(3, 50)
    every = picks.allows_every_token(torch.ones(50, dtype=torch.bool))
    assert picks_cpu.mask_table([every, None, every], 50, z.device)[0] is None
    unmarked = torch.ones(50, dtype=torch.bool)
    assert picks_cpu.mask_table([unmarked], 50, z.device)[0] is not None
    assert torch.equal(picks.greedy(z, [every] * 3), z.argmax(-1))


def test_the_runners_picks_under_every_greedy_mask_at_once():
    """A GPU prefill's greedy picks under the runner's masks (`picks_gpu.masked_picks`: `MaskedPicks`, masks
    of few tokens gathered; None is every token) are `masked_argmax` under each (here through the kernel's
    torch form), ties to the first index."""
    from lmq_backend.engine.picks_gpu import masked_picks

    gen = torch.Generator().manual_seed(3)
    z = torch.randint(-3, 4, (6, 5000), generator=gen).float()
    few = torch.zeros(5000, dtype=torch.bool)
    few[[7, 90, 4001]] = True
    masks = [None, torch.rand(5000, generator=gen) < 0.5, few, few.clone()]
    out = torch.empty(4, 6, dtype=torch.long)
    masked_picks(masks, z)(z, out)
    assert torch.equal(out, torch.stack([masked_argmax(z, m) for m in masks]))
