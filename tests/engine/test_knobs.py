"""The decoding knobs of argmax and sample (`engine.picks.Knobs`): `top_k` and `repetition_penalty` against
transformers' own logits processors (`TopKLogitsWarper`, `RepetitionPenaltyLogitsProcessor`) on the same
logits, and against `model.generate` on a model; `frequency_penalty` and `presence_penalty` against their
definition (OpenAI's, vLLM's: z - f * count - q * [count > 0], over the call's generated tokens). A row's pick
depends on its own logits and tokens only (rows with knobs beside rows without, batched or alone, cache on or
off); the mask selects among the adjusted logits; out-of-range knobs are compile errors naming the argument.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (LogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper)

import lmq_backend as lmq
from lmq_backend.engine.picks import Draw, Greedy, Knobs, Sampling, Tokens, penalized, sample
from lmq_backend.errors import LMQCompileError, LMQNotSupportedError
from lmq_backend.runtime.decoders import DecoderSpec
from support.models import SCRIPT, Script, differences, next_logits, run_engine, standard_calls


class _Mask(LogitsProcessor):
    """A constraint's mask as transformers would apply it: a custom processor, before the warpers."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed

    def __call__(self, input_ids, scores):
        return scores.masked_fill(~self.allowed, float("-inf"))


def transformers_scores(z: torch.Tensor, ids: list[int], knobs: Knobs, temperature: float = 0.0,
                        allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The row z [V] through transformers' processors in generate's order: the repetition penalty over `ids`,
    the mask (a custom processor), then where sampled the temperature and top-k warpers."""
    processors = LogitsProcessorList()
    if knobs.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(knobs.repetition_penalty))
    if allowed is not None:
        processors.append(_Mask(allowed))
    if temperature > 0:
        processors.append(TemperatureLogitsWarper(temperature))
        if knobs.top_k is not None:
            processors.append(TopKLogitsWarper(knobs.top_k))
    return processors(torch.tensor([ids], device=z.device), z.clone()[None])[0]


def openai_penalties(z: torch.Tensor, counts: dict[int, int], f: float, q: float) -> torch.Tensor:
    """The definition, in float64: z[t] - f * count(t) - q * (count(t) > 0)."""
    out = z.double().clone()
    for t, c in counts.items():
        out[t] -= f * c + q * (c > 0)
    return out


def tokens_of(ids: list[int], generated: list[int]) -> Tokens:
    """What a sampler has seen after a hole began at `ids` and picked `generated` (`Sampler.start`, `took`)."""
    sampler = Greedy(Knobs(repetition_penalty=1.5))
    sampler.start(ids)
    for t in generated:
        sampler.took(t)
    return sampler.tokens


# ----------------------------------------------------------------------------------- the arithmetic

def test_the_repetition_penalty_is_transformers_bit_for_bit():
    """Rows of random logits (negative and positive), each with its own sequence (repeats in it: a token is
    penalised once) and penalty (above and below 1), beside rows without knobs: `penalized` gives exactly the
    processor's logits, and leaves the other rows as they were."""
    gen = torch.Generator().manual_seed(0)
    v = 500
    z = torch.randn(8, v, generator=gen) * 4
    draws, want = [], []
    for i in range(8):
        ids = torch.randint(0, v, (3 + 7 * i,), generator=gen).tolist()
        ids += ids[:3]  # repeated tokens
        knobs = None if i % 3 == 2 else Knobs(repetition_penalty=[1.3, 0.7, 2.0][i % 3])
        draws.append(Draw(1.0, 1.0, 0.5, None, None, knobs, tokens_of(ids[:-4], ids[-4:]) if knobs else None))
        want.append(z[i] if knobs is None else transformers_scores(z[i], ids, knobs))
    got = penalized(z.clone(), draws)
    assert torch.equal(got, torch.stack(want))
    assert not torch.equal(got, z)


def test_frequency_and_presence_penalties_follow_their_definition():
    """z - f * count - q where count > 0, the counts being the call's generated tokens (over its holes: a
    hole's start resets only what the repetition penalty reads); negative values reward a token."""
    gen = torch.Generator().manual_seed(1)
    v = 300
    z = torch.randn(4, v, generator=gen) * 3
    sampler = Sampling(knobs=Knobs(frequency_penalty=0.75, presence_penalty=-0.5))
    sampler.start([5, 6, 7])
    for t in (9, 9, 4, 9):
        sampler.took(t)
    sampler.start([5, 6, 7, 9, 9, 4, 9, 11, 12])  # a second hole: the counts stay
    sampler.took(4)
    assert sampler.tokens.counts == {9: 3, 4: 2} and sampler.tokens.seen == {4, 5, 6, 7, 9, 11, 12}
    knobs = [Knobs(frequency_penalty=0.75, presence_penalty=-0.5), Knobs(presence_penalty=2.0),
             Knobs(frequency_penalty=-2.0), None]
    draws = [Draw(0.0, 1.0, 0.0, None, None, k, sampler.tokens if k else None) for k in knobs]
    got = penalized(z.clone(), draws)
    for i, k in enumerate(knobs):
        want = z[i].double() if k is None else openai_penalties(z[i], sampler.tokens.counts, k.frequency_penalty,
                                                                k.presence_penalty)
        assert torch.allclose(got[i].double(), want, atol=1e-5, rtol=0)
        assert int(sample(z[i:i + 1], [draws[i]])[0]) == int(want.argmax())
    assert not torch.equal(got[:3], z[:3])


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
def test_greedy_picks_with_penalties_are_the_processors_argmax(masked):
    """Greedy rows with penalties, rows without, rows with a mask: each pick is the argmax of transformers'
    processed logits under the mask (the penalty changes logits, the mask selects tokens), and the same pick
    alone as in the batch; `Greedy(knobs).select` agrees."""
    gen = torch.Generator().manual_seed(2)
    v = 400
    z = torch.randn(12, v, generator=gen) * 2
    draws, want = [], []
    for i in range(12):
        ids = torch.randint(0, v, (40,), generator=gen).tolist()
        ids += [int(z[i].argmax())]  # the row's best token is a repeat
        knobs = None if i % 4 == 3 else Knobs(repetition_penalty=1.0 + 0.5 * (i % 4),
                                             frequency_penalty=0.5 * (i % 2), presence_penalty=0.25)
        allowed = torch.rand(v, generator=gen) < 0.5 if masked and i % 2 else None
        if allowed is not None:
            allowed[ids[-1]] = True
        tokens = tokens_of(ids[:-10], ids[-10:])
        draws.append(Draw(0.0, 1.0, 0.0, allowed, None, knobs, tokens if knobs else None))
        scores = z[i]
        if knobs is not None:
            scores = transformers_scores(scores, ids, Knobs(repetition_penalty=knobs.repetition_penalty))
            scores = openai_penalties(scores, tokens.counts, knobs.frequency_penalty, knobs.presence_penalty)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        want.append(int(scores.argmax()))
    together = sample(z, draws).tolist()
    assert together == want
    assert together == [int(sample(z[i:i + 1], [d])[0]) for i, d in enumerate(draws)]
    assert sum(w != int(z[i].argmax()) for i, w in enumerate(want)) >= 6  # the penalties changed picks
    for i, d in enumerate(draws):
        if d.knobs is not None:
            sampler = Greedy(d.knobs)
            sampler.tokens = d.tokens
            assert sampler.select(z[i], d.allowed) == want[i]


@pytest.mark.parametrize("case", ["top_k", "top_k and penalty", "top_k under a mask", "mask narrower than k",
                                  "ties at the k-th"])
def test_sampling_with_knobs_draws_from_the_processors_distribution(case):
    """A sampled row's distribution is softmax of transformers' processed scores (repetition penalty, mask,
    temperature, top-k): at a u inside each token's share of the cumulative mass (in the vocabulary's order)
    the pick is that token, and no token the processors drop is ever picked."""
    gen = torch.Generator().manual_seed(3)
    v, temperature = 64, 0.8
    z = torch.randn(v, generator=gen) * 2
    ids = torch.randint(0, v, (20,), generator=gen).tolist()
    knobs = Knobs(top_k=6, repetition_penalty=1.8 if case == "top_k and penalty" else 1.0)
    allowed = None
    if case == "top_k under a mask":
        allowed = torch.rand(v, generator=gen) < 0.4
    elif case == "mask narrower than k":
        allowed = torch.zeros(v, dtype=torch.bool)
        allowed[[3, 10, 20, 41]] = True
    if case == "ties at the k-th":
        z = torch.randint(0, 4, (v,), generator=gen).float()  # many tokens equal to the 6th best: all kept
    tokens = tokens_of(ids, [])
    p = torch.softmax(transformers_scores(z, ids, knobs, temperature, allowed), dim=-1)
    kept = p > 0
    if case == "mask narrower than k":
        assert 0 < int(allowed.sum()) < 6 and torch.equal(kept, allowed)
    elif case == "ties at the k-th":
        assert int(kept.sum()) > 6
    else:
        assert int(kept.sum()) == 6
    draw = lambda u: Draw(temperature, 1.0, u, allowed, None, knobs, tokens)  # noqa: E731
    cdf = p.double().cumsum(0)
    for t in kept.nonzero()[:, 0].tolist():
        low = float(cdf[t] - p[t])
        assert int(sample(z[None], [draw(low + float(p[t]) / 2)])[0]) == t
    picks = sample(z[None].expand(200, v), [draw(u) for u in torch.rand(200, generator=gen).tolist()])
    assert bool(kept[picks].all())
    # argmax ignores top_k (as transformers' greedy search does), but not the penalty
    greedy_pick = int(sample(z[None], [Draw(0.0, 1.0, 0.0, allowed, None, knobs, tokens)])[0])
    assert greedy_pick == int(transformers_scores(z, ids, knobs, 0.0, allowed).argmax())


def test_rows_with_knobs_sample_what_they_sample_alone():
    """Sampled rows with top_k, a nucleus, penalties, masks, beside rows without knobs and greedy rows: each
    row's token is the one it gets alone."""
    gen = torch.Generator().manual_seed(4)
    v = 300
    z = torch.randn(20, v, generator=gen) * 3
    masks = [None, torch.rand(v, generator=gen) < 0.3]
    seen = tokens_of(torch.randint(0, v, (50,), generator=gen).tolist(), [1, 2, 2, 3])
    knobs = [None, Knobs(top_k=5), Knobs(top_k=40, repetition_penalty=1.4), Knobs(frequency_penalty=1.0),
             Knobs(repetition_penalty=0.8, presence_penalty=1.5)]
    draws = [Draw([1.0, 0.6, 0.0][i % 3], [1.0, 0.9][i % 2], float(torch.rand((), generator=gen)), masks[i % 2],
                  None, knobs[i % 5], seen if knobs[i % 5] else None) for i in range(20)]
    together = sample(z, draws).tolist()
    assert together == [int(sample(z[i:i + 1], [d])[0]) for i, d in enumerate(draws)]
    for i, d in enumerate(draws):
        if d.allowed is not None:
            assert d.allowed[together[i]]


# --------------------------------------------------------------------------------- queries on a model

def generate_with(repetition_penalty: float, top_k: int):
    """A hole's tokens by the model's own `generate` (greedy, with its KV cache) with the knobs."""

    @torch.no_grad()
    def fill(model, ids, max_new, stop):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, repetition_penalty=repetition_penalty,
                             top_k=top_k, eos_token_id=sorted(stop), pad_token_id=sorted(stop)[0])
        out = out[0, len(ids):].tolist()
        return next((out[:k] for k, t in enumerate(out) if t in stop), out)
    return fill


def penalties_with(repetition_penalty: float, frequency: float, presence: float):
    """Greedy holes from a plain forward loop: transformers' repetition processor over the whole context,
    then the frequency and presence penalties over the tokens this call's holes generated (one fill a call)."""
    counts: dict[int, int] = {}
    repetition = RepetitionPenaltyLogitsProcessor(repetition_penalty)

    def fill(model, ids, max_new, stop):
        out: list[int] = []
        for _ in range(max_new):
            z = repetition(torch.tensor([ids + out]), next_logits(model, ids + out)[None])[0]
            z = openai_penalties(z, counts, frequency, presence)
            token = int(z.argmax())
            if token in stop:
                break
            out.append(token)
            counts[token] = counts.get(token, 0) + 1
        return out
    return fill


ONE_HOLE = Script((("text", "{shots}Input: {x}\nOutput:"), ("hole", "A", 16)))


async def test_greedy_tokens_equal_generate_with_the_knobs(zoo):
    """`argmax(repetition_penalty=1.3, top_k=4)` on a model gives the token ids transformers' `generate` gives
    with `repetition_penalty=1.3, top_k=4` (greedy: generate ignores top_k, and so does argmax), float32;
    the penalty changed tokens (on a model whose greedy values repeat tokens)."""
    backend = zoo.backend("qwen2", "64MB")
    model = zoo.reference("qwen2")
    calls = standard_calls()[:4]
    got = await run_engine(backend, ONE_HOLE, calls, batched=False, decoder="argmax(repetition_penalty=1.3, top_k=4)")
    want = [ONE_HOLE.reference(model, zoo.tokenizer, c, fill=generate_with(1.3, 4)) for c in calls]
    assert differences(got, want) == []
    plain = [ONE_HOLE.reference(model, zoo.tokenizer, c) for c in calls]
    assert [ids for ids, _ in want] != [ids for ids, _ in plain]


PENALTIES = (0.9, -0.5, 0.25)  # these random models rarely repeat a token: a reward shows more than a penalty
DECODER = "argmax(repetition_penalty=0.9, frequency_penalty=-0.5, presence_penalty=0.25)"


def penalised_reference(zoo, family: str) -> list[tuple]:
    key = ("knobs", family)
    if key not in zoo.memo:
        model = zoo.reference(family)
        zoo.memo[key] = [SCRIPT.reference(model, zoo.tokenizer, c, fill=penalties_with(*PENALTIES))
                         for c in standard_calls()]
    return zoo.memo[key]


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("cache_budget", [0, "64MB"], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_penalised_greedy_tokens_equal_the_reference(zoo, family, cache_budget, batched):
    """Seven calls of a query of two holes and a distribution, with all three penalties: the token ids equal
    the reference's, cache on and off, alone and batched with random arrival."""
    backend = zoo.backend(family, cache_budget)
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=batched, seed=3, decoder=DECODER)
    assert differences(got, penalised_reference(zoo, family)) == []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_reference_penalties_change_tokens_and_count_over_the_call(zoo, family):
    """What the test above checks is not the plain greedy run: the penalties change tokens, and counting
    the generated tokens per hole instead of per call would change tokens of the second hole."""
    model, calls = zoo.reference(family), standard_calls()
    want = [ids for ids, _ in penalised_reference(zoo, family)]
    plain = [SCRIPT.reference(model, zoo.tokenizer, c)[0] for c in calls]
    per_hole = [SCRIPT.reference(model, zoo.tokenizer, c, fill=lambda *a: penalties_with(*PENALTIES)(*a))[0]
                for c in calls]
    assert want != plain and want != per_hole


async def test_seeded_sampling_with_knobs_is_the_same_batched_and_cache_on_or_off(zoo):
    """Seeded `sample` with every knob beside greedy calls without knobs: each call's tokens are the same
    alone and batched, with the cache on and off."""
    source = 'sample(n=2, seed=11, temperature=0.9, top_k=8, repetition_penalty=1.2, frequency_penalty=0.5, ' \
             'presence_penalty=0.5)\n' \
             '"Input: {x}\\nOutput:[A]" where len(TOKENS(A)) < 10\n" again:[B]" where len(TOKENS(B)) < 8\n'
    greedy = '"Input: {x}\\nOutput:[A]" where len(TOKENS(A)) < 12'
    words = ["alpha river", "stone cloud seven", "green", "table quiet north apple"]
    runs = {}
    for cache_budget in (0, "64MB"):
        backend = zoo.backend("llama", cache_budget)
        sampled, plain = lmq.Query(source, model=backend), lmq.Query(greedy, model=backend)
        alone = [[r.variables for r in await sampled.run({"x": w})] for w in words]
        alone += [(await plain.run({"x": w})).variables for w in words]
        together = await asyncio.gather(*(sampled.run({"x": w}) for w in words),
                                         *(plain.run({"x": w}) for w in words))
        assert [[r.variables for r in rs] for rs in together[:4]] + [r.variables for r in together[4:]] == alone
        runs[cache_budget] = alone
    assert runs[0] == runs["64MB"]
    assert len({tuple(r.items()) for rs in runs[0][:4] for r in rs}) > 4  # the draws differ


# ------------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("decoder, argument", [
    ("sample(top_k=0)", "top_k must be an integer >= 1, got 0"),
    ("sample(top_k=2.5)", "top_k must be an integer >= 1, got 2.5"),
    ("argmax(top_k=True)", "top_k must be an integer >= 1, got True"),
    ("argmax(repetition_penalty=0)", "repetition_penalty must be a number > 0, got 0"),
    ("sample(repetition_penalty=-1.2)", "repetition_penalty must be a number > 0, got -1.2"),
    ('sample(repetition_penalty="high")', "repetition_penalty must be a number > 0, got 'high'"),
    ("argmax(frequency_penalty=2.5)", r"frequency_penalty must be a number in \[-2, 2\], got 2.5"),
    ("sample(presence_penalty=None)", r"presence_penalty must be a number in \[-2, 2\], got None"),
])
def test_a_knob_out_of_range_is_a_compile_error_naming_it(decoder, argument):
    """In the query (with the decoder's position) and as `decoder=` text, before any model call."""
    with pytest.raises(LMQCompileError, match=rf"decoder \w+ \(line 1, column 1\): {argument}"):
        lmq.Query(f'{decoder}\n    "a[X]"')
    with pytest.raises(LMQCompileError, match=rf"decoder \w+: {argument}"):
        lmq.Query('"a[X]"', decoder=decoder)


@pytest.mark.parametrize("decoder, argument", [
    ("sample(temperature=True)", "temperature must be a finite number >= 0, got True"),
    ("sample(temperature=1e400)", "temperature must be a finite number >= 0, got inf"),
    ("sample(temperature=-0.5)", "temperature must be a finite number >= 0, got -0.5"),
    ("sample(seed=True)", "seed must be an integer, got True"),
    ("sample(seed=1.5)", "seed must be an integer, got 1.5"),
    ("sample(top_p=True)", r"top_p must be a number in \(0, 1\], got True"),
])
def test_a_decoder_argument_out_of_range_is_a_compile_error_naming_it(decoder, argument):
    """A bool is an int in Python, and 1e400 a float: neither is a temperature or a seed."""
    with pytest.raises(LMQCompileError, match=rf"decoder \w+: {argument}"):
        lmq.Query(f'{decoder}\n    "a[X]"')


def test_knobs_in_range_compile():
    spec = lmq.Query('sample(top_k=1, repetition_penalty=1, frequency_penalty=-2, presence_penalty=2)\n'
                     '    "a[X]"').decoder
    assert spec.knobs == Knobs(1, 1.0, -2.0, 2.0)
    assert DecoderSpec.parse("argmax(top_k=5)").knobs is None  # a greedy pick's top-k changes nothing
    assert DecoderSpec.parse("argmax").knobs is None and DecoderSpec.parse("sample(n=2)").knobs is None
    assert type(DecoderSpec.parse("argmax(presence_penalty=0.5)").sampler(0)) is Greedy


@pytest.mark.parametrize("decoder", ["beam(n=2, top_k=3)", "best_k(repetition_penalty=1.2)"])
def test_beam_decoders_take_no_knobs(decoder):
    with pytest.raises(LMQNotSupportedError, match="unknown argument"):
        lmq.Query(f'{decoder}\n    "a[X]"')


# ------------------------------------------------------------------------------------- the GPU's picks

@pytest.mark.gpu
def test_the_penalties_on_a_gpu_are_transformers_and_pick_as_the_host():
    """On CUDA tensors: `penalized` gives exactly the processor's logits on the same device, and greedy rows
    with penalties (beside rows without) pick what the host picks from the same logits; sampled rows with
    top-k pick only tokens transformers' processors keep."""
    gen = torch.Generator().manual_seed(5)
    v = 2000
    z = torch.randn(6, v, generator=gen) * 3
    ids = [torch.randint(0, v, (60,), generator=gen).tolist() for _ in range(6)]
    knobs = [Knobs(repetition_penalty=1.3, frequency_penalty=0.5), None, Knobs(repetition_penalty=0.7),
             Knobs(presence_penalty=1.0), Knobs(top_k=3, repetition_penalty=1.5), None]
    draws = [Draw(1.0 if k and k.top_k else 0.0, 1.0, 0.3, None, None, k, tokens_of(i[:-5], i[-5:]) if k else None)
             for i, k in zip(ids, knobs)]
    cuda = z.cuda()
    got = penalized(cuda.clone(), draws[:3])
    repeated = transformers_scores(cuda[0], ids[0], Knobs(repetition_penalty=1.3))
    want = openai_penalties(repeated, draws[0].tokens.counts, 0.5, 0.0)
    assert torch.allclose(got[0].double(), want, atol=1e-5, rtol=0)
    assert torch.equal(got[1], cuda[1]) and torch.equal(got[2], transformers_scores(cuda[2], ids[2], knobs[2]))
    on_gpu, on_host = sample(cuda, draws).tolist(), sample(z, draws).tolist()
    assert [t for t, d in zip(on_gpu, draws) if d.temperature == 0] == \
        [t for t, d in zip(on_host, draws) if d.temperature == 0]
    kept = transformers_scores(cuda[4], ids[4], knobs[4], 1.0) > float("-inf")
    assert int(kept.sum()) == 3 and bool(kept[on_gpu[4]])


GREEDY = '"Once upon a time, {x}[A]" where len(TOKENS(A)) < 20'
KNOBBED = f"argmax(repetition_penalty=1.5, frequency_penalty=0.5)\n{GREEDY}"
SAMPLED_TOP_K = f"sample(n=2, temperature=0.8, seed=4, top_k=5, presence_penalty=0.5)\n{GREEDY}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_rows_with_knobs_beside_rows_the_device_picks(tokenizer, device):
    """Greedy rows without knobs (which a GPU step picks on the device, and runs ahead on while they are
    alone), greedy rows with penalties and sampled rows with top-k and a penalty, arriving at different
    steps: the values of a backend whose device makes no picks (the host picks every row from the logits),
    float32; the penalties changed values."""
    from test_fused_engine import ahead_and_plain, llama

    model = llama(device, 256, 2, 4)
    model.lm_head.weight.data *= 10  # a trained model's peaked distributions (see test_fused_engine)
    ahead, plain = ahead_and_plain(model, tokenizer)

    async def late(backend, i):
        await asyncio.sleep(0.002 * (i % 3))  # arrive at different steps
        source = (GREEDY, KNOBBED, SAMPLED_TOP_K)[i % 3]
        result = await lmq.Query(source, model=backend).run({"x": "word " * i})
        return [r.variables for r in result] if isinstance(result, list) else result.variables

    want = await asyncio.gather(*(late(plain, i) for i in range(9)))
    assert await asyncio.gather(*(late(ahead, i) for i in range(9))) == want
    unpenalised = [(await lmq.Query(GREEDY, model=plain).run({"x": "word " * i})).variables for i in (1, 4, 7)]
    assert [want[i] for i in (1, 4, 7)] != unpenalised
