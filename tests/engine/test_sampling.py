"""Sampling is tested for its distribution: many seeded draws against softmax(logits / T), restricted to
the top-p nucleus and renormalised (an independent numpy reference, not the code under test).

Every draw is seeded, so each test is deterministic; the bound is a chi-square test at a 0.1% level, and
each test also checks that the wrong distributions (temperature ignored, top_p ignored, the nucleus one
token too small or too large, computed before the temperature) are rejected by the same bound, so the
test cannot pass by accident if the sampler ignores an argument.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import lmq_backend as lmq
from lmq_backend.runtime.decoders import DecoderSpec, Greedy, Sampling

from support.tiny import tiny_llama

# chi-square critical values at the 0.1% level, by degrees of freedom
CHI2_CRIT = {0: 0.0, 1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
             9: 27.877, 10: 29.588}

LOGITS = torch.tensor([3.0, 2.2, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0])
DRAWS = 2000


def reference(logits, temperature: float = 1.0, top_p: float = 1.0, allowed=None,
              nucleus_before_temperature: bool = False) -> np.ndarray:
    """The distribution a sampler must draw from: softmax(logits / T) over the allowed tokens, then the
    smallest set of most probable tokens whose mass reaches top_p, renormalised to 1."""
    z = np.asarray(logits, dtype=np.float64)
    if allowed is not None:
        z = np.where(np.asarray(allowed), z, -np.inf)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    p = softmax(z / temperature)
    ranking = softmax(z) if nucleus_before_temperature else p
    keep, mass = [], 0.0
    for i in sorted(range(len(p)), key=lambda i: -ranking[i]):
        if mass >= top_p or ranking[i] == 0:
            break
        keep.append(i)
        mass += ranking[i]
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def nucleus_margin(logits, temperature: float, top_p: float) -> float:
    """How far top_p lies from the cumulative masses where the nucleus would change (so that float
    rounding cannot decide which tokens are in it)."""
    if top_p >= 1.0:
        return float("inf")  # no cut
    p = np.sort(reference(logits, temperature))[::-1]
    return float(np.min(np.abs(np.cumsum(p[p > 0])[:-1] - top_p)))


def chi2(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson's statistic over the tokens with expected mass; inf if a token without mass was drawn."""
    n = counts.sum()
    if counts[expected_p == 0].any():
        return float("inf")
    e = n * expected_p[expected_p > 0]
    return float((((counts[expected_p > 0] - e) ** 2) / e).sum())


def crit(expected_p: np.ndarray) -> float:
    return CHI2_CRIT[int((expected_p > 0).sum()) - 1]


def draw(sampler, logits: torch.Tensor, allowed=None, n: int = DRAWS) -> np.ndarray:
    picks = [sampler.select(logits, allowed) for _ in range(n)]
    return np.bincount(picks, minlength=len(logits))


def assert_matches(counts: np.ndarray, expected_p: np.ndarray, wrong: dict[str, np.ndarray]) -> list[str]:
    """The draws fit `expected_p`, and do not fit any of the `wrong` distributions that differ from it by
    a total variation of 0.05 or more (closer ones are left to other parameters); returns those names."""
    stat = chi2(counts, expected_p)
    assert stat < crit(expected_p), (stat, counts.tolist(), np.round(counts.sum() * expected_p, 1).tolist())
    rejected = []
    for name, q in wrong.items():
        if 0.5 * np.abs(q - expected_p).sum() < 0.05:
            continue
        # the same draws against the wrong distribution: rejected (so the test can tell them apart)
        assert chi2(counts, q) > crit(q), f"the test cannot tell the sampler from one with {name}"
        rejected.append(name)
    return rejected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_logits(temperature):
    counts = draw(Sampling(temperature=temperature, seed=1), LOGITS)
    assert_matches(counts, reference(LOGITS, temperature), {
        "the temperature ignored": reference(LOGITS, 1.0),
        "the temperature inverted": reference(LOGITS, 1 / temperature),
    })


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.6), (1.0, 0.8), (1.0, 0.9), (0.7, 0.8), (0.7, 0.9), (2.0, 0.6),
                                               (2.0, 0.85)])
def test_top_p_keeps_the_nucleus_and_renormalises_it(temperature, top_p):
    assert nucleus_margin(LOGITS, temperature, top_p) > 0.01
    expected = reference(LOGITS, temperature, top_p)
    kept = expected > 0
    assert 1 < kept.sum() < len(LOGITS)
    counts = draw(Sampling(temperature=temperature, top_p=top_p, seed=2), LOGITS)
    assert counts[~kept].sum() == 0, f"tokens outside the top-{top_p} nucleus were drawn: {counts.tolist()}"
    assert counts[kept].all()  # every token of the nucleus is drawn
    smaller, larger = expected.copy(), reference(LOGITS, temperature)
    smaller[np.flatnonzero(kept)[-1]] = 0  # the nucleus one token too small
    order = np.argsort(-larger)
    larger[order[kept.sum() + 1:]] = 0  # one token too large
    unrenormalised = np.where(kept, reference(LOGITS, temperature), 0.0)
    unrenormalised[0] += 1 - unrenormalised.sum()
    assert_matches(counts, expected, {
        "top_p ignored": reference(LOGITS, temperature),
        "the temperature ignored": reference(LOGITS, 1.0, top_p),
        "the nucleus chosen before the temperature": reference(LOGITS, temperature, top_p,
                                                               nucleus_before_temperature=True),
        "the nucleus one token too small": smaller / smaller.sum(),
        "the nucleus one token too large": larger / larger.sum(),
        "the mass outside the nucleus moved to the top token": unrenormalised,
    })


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
def test_the_constraint_mask_comes_before_temperature_and_top_p(temperature, top_p):
    """Only allowed tokens are drawn, in proportion to their own softmax: the nucleus is taken among them."""
    allowed = torch.tensor([False, True, True, False, True, True, False, True])
    assert nucleus_margin(torch.where(allowed, LOGITS, -torch.inf), temperature, top_p) > 0.01
    expected = reference(LOGITS, temperature, top_p, allowed=allowed.numpy())
    counts = draw(Sampling(temperature=temperature, top_p=top_p, seed=3), LOGITS, allowed)
    assert counts[~allowed.numpy()].sum() == 0
    assert_matches(counts, expected, {
        "the mask ignored": reference(LOGITS, temperature, top_p),
        "the nucleus taken before the mask": (lambda q: q / q.sum())(
            reference(LOGITS, temperature, top_p) * allowed.numpy()),
    })


def test_temperature_zero_is_greedy_within_the_mask():
    allowed = torch.tensor([False, False, True, True, False, False, False, False])
    s = Sampling(temperature=0.0, seed=4)
    assert {s.select(LOGITS, None) for _ in range(50)} == {0}
    assert {s.select(LOGITS, allowed) for _ in range(50)} == {2} == {Greedy().select(LOGITS, allowed)}


def test_seeds_repeat_and_differ():
    runs = [[s.select(LOGITS, None) for _ in range(200)] for s in (Sampling(1.0, seed=5), Sampling(1.0, seed=5),
                                                                    Sampling(1.0, seed=6))]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    spec = DecoderSpec(name="sample", n=3, temperature=1.0, seed=10)
    first = [[s.select(LOGITS, None) for _ in range(50)] for s in (spec.sampler(i) for i in range(3))]
    assert first[0] != first[1] and first[1] != first[2]  # result i has seed 10 + i: the n results are independent draws


# ----- end to end: a sample(n=...) query on a tiny model -----------------------------------------------

PAIRS = [a + b for a in "123" for b in "12"]  # two-token values: one token at the prefill, one at a decode step
SAMPLES = 300


def scaled_models(tokenizer, seed: int, factor: float, tokens: list[str] | None, name: str):
    """A tiny Llama whose LM head rows of `tokens` (None: every row) are scaled by `factor` (a random model's
    logits are nearly equal), served by lmq, and an untouched copy of it (never wrapped by lmq) that computes
    the reference distribution."""
    from lmq_backend.backend.hf import HFBackend

    model = tiny_llama(seed=seed)
    rows = slice(None) if tokens is None else [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    with torch.no_grad():
        model.lm_head.weight[rows] *= factor
    reference_model = copy.deepcopy(model)
    return HFBackend.from_model(model, tokenizer, cache_budget="64MB", name=name), reference_model


@pytest.fixture(scope="module")
def peaked_models(tokenizer):
    """The digits' logits spread over a few units."""
    return scaled_models(tokenizer, 3, 14.0, list("0123456789"), "tiny-sampling")


def reference_pairs(backend, reference_model, prompt: str, temperature: float, top_p: float) -> np.ndarray:
    """P(value) over PAIRS: the first digit's distribution at the prompt times the second's after it,
    each softmax / T over the digits the choice allows there, cut to the top-p nucleus, renormalised."""
    vocab = backend.vocab
    ids = backend.sequence("ref").ids + vocab.encode(prompt)
    first, second = ["1", "2", "3"], ["1", "2"]
    first_ids = [vocab.encode_continuation(d) for d in first]
    second_ids = [vocab.encode_continuation(d) for d in second]
    assert all(len(t) == 1 for t in first_ids + second_ids)

    def step(context: list[int], options: list[list[int]]) -> tuple[np.ndarray, float]:
        with torch.no_grad():
            logits = reference_model(torch.tensor([context])).logits[0, -1].double()
        z = logits[[t[0] for t in options]].numpy()
        return reference(z, temperature, top_p), nucleus_margin(z, temperature, top_p)

    p1, margin = step(ids, first_ids)
    out, margins = [], [margin]
    for i, a in enumerate(first_ids):
        p2, margin = step(ids + a, second_ids)
        margins.append(margin)
        out += [p1[i] * p2[j] for j in range(len(second))]
    if top_p < 1.0:
        assert min(margins) > 0.01  # no nucleus decided by rounding
    return np.array(out)


@pytest.mark.parametrize("temperature,top_p", [(2.5, 1.0), (0.5, 0.9)])
async def test_sample_query_draws_from_the_model_distribution(peaked_models, temperature, top_p):
    """sample(n=300, ...) over a two-token choice: the values' frequencies are the model's distribution
    (first digit at the prompt, second after it), tempered and cut to the nucleus at each step."""
    backend, reference_model = peaked_models
    prompt = "Pick a number:"
    q = lmq.compile(f'sample(n={SAMPLES}, temperature={temperature}, top_p={top_p}, seed=100)\n'
                    f'    "{prompt}[X]" where X in {PAIRS!r}', model=backend)
    results = await q()
    assert len(results) == SAMPLES
    counts = np.array([sum(r["X"] == v for r in results) for v in PAIRS])
    assert counts.sum() == SAMPLES and all(r.prompt == prompt + r["X"] for r in results)

    def ref(t, p):
        return reference_pairs(backend, reference_model, prompt, t, p)

    expected = ref(temperature, top_p)
    if top_p < 1.0:
        assert (expected == 0).any() and counts[expected == 0].sum() == 0  # outside the nucleus: never drawn
    rejected = assert_matches(counts, expected, {
        "the temperature ignored": ref(1.0, top_p),
        "top_p ignored": ref(temperature, 1.0),
        "every result drawn with the same seed": np.eye(len(PAIRS))[np.argmax(counts)],
    })
    assert len(rejected) >= 2, rejected  # the model's logits make the arguments matter here


@pytest.fixture(scope="module")
def spread_models(tokenizer):
    """Every token's logit spread over a few units (some tens to hundreds of tokens carry most of the mass)."""
    return scaled_models(tokenizer, 5, 12.0, None, "tiny-spread")


CHECKED = 600


@pytest.mark.parametrize("temperature", [1.0, 0.6])
async def test_a_checked_sample_draws_from_the_constrained_distribution(spread_models, temperature, monkeypatch):
    """A one-token value under a REGEX (llguidance: a hole whose mask is dear draws without it, keeps an
    allowed draw, and draws again under the mask after one that is not, `HoleLoop._checked`): the values'
    frequencies are the model's distribution over the tokens the expression allows (found here from the
    tokens' bytes, not by llguidance), in bins of equal mass; draws both kept and redrawn."""
    import re

    from lmq_backend.runtime.constraints import llg

    backend, reference_model = spread_models
    redrawn = []  # the mask is asked for (here always the template's, computed once) only to draw again
    allowed_mask = llg._LLGState.allowed
    monkeypatch.setattr(llg._LLGState, "allowed", lambda self: redrawn.append(1) or allowed_mask(self))
    prompt = "Say:"
    q = lmq.compile(f'sample(n={CHECKED}, temperature={temperature}, seed=11)\n'
                    f'    "{prompt}[X]" where REGEX(X, r"[a-m][a-z]*") and len(TOKENS(X)) < 2', model=backend)
    results = await q()
    assert len(results) == CHECKED

    vocab = backend.vocab
    allowed = np.array([vocab.nonspecial[t] and re.fullmatch(rb"[a-m][a-z]*", vocab.token_bytes[t]) is not None
                        for t in range(vocab.size)])
    with torch.no_grad():
        ids = backend.sequence("ref").ids + vocab.encode(prompt)
        logits = reference_model(torch.tensor([ids])).logits[0, -1].double().numpy()
    text = {vocab.token_bytes[t].decode(): t for t in np.flatnonzero(allowed)}
    drawn = [text.get(r["X"]) for r in results]
    assert None not in drawn, [r["X"] for r in results if r["X"] not in text][:5]
    # 8 bins of the allowed tokens, most likely first, of equal mass under the expected distribution
    expected = reference(logits, temperature, allowed=allowed)
    order = np.argsort(-expected, kind="stable")
    bin_of = np.empty(vocab.size, dtype=np.int64)
    bin_of[order] = np.minimum((np.cumsum(expected[order]) - expected[order] / 2) * 8, 7).astype(np.int64)

    def binned(p):
        return np.bincount(bin_of, weights=p, minlength=8)

    counts = np.bincount(bin_of[drawn], minlength=8)
    wrong = {"every allowed token as likely": binned(allowed / allowed.sum())}
    if temperature != 1.0:
        wrong["the temperature ignored"] = binned(reference(logits, 1.0, allowed=allowed))
    rejected = assert_matches(counts, binned(expected), wrong)
    assert len(rejected) == len(wrong), rejected
    assert 0 < len(redrawn) < CHECKED  # kept and redrawn draws both
