"""The sampled pick in two passes (`lmq_kernels.triton.sample_rows`) against the engine's torch form
(`engine/picks.inverse_cdf`): the token whose interval of the cumulative distribution holds u (checked at
u inside an interval, away from its ends, where float rounding cannot move the pick), never a masked token or
one without mass, the same token for a row alone and among others, and splits of the vocabulary that meet.

CPU (`interpreter` tests): the kernels run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported). GPU (`gpu` tests): compiled, at a Llama-3 vocabulary."""
import pytest
import torch

from lmq_backend.engine.picks import inverse_cdf
from lmq_kernels.triton.sample_rows import BLOCK, sample_rows

CHUNK = 2 * BLOCK  # small splits: a few of them in a short vocabulary


def _case(R, V, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=gen) * 3).to(dtype)
    masks = torch.rand(3, V, generator=gen) < 0.3
    masks[0] = True
    masks[2] = False
    masks[2, V - 1] = True                                  # one token, in the last split
    mask_of = torch.randint(0, 3, (R,), generator=gen, dtype=torch.int32)
    temperature = torch.rand(R, generator=gen) * 1.5 + 0.2
    temperature[0] = 0.0                                     # a greedy row: taken as T = 1
    return [x.to(device) for x in (logits, masks, mask_of, temperature)]


def _reference_cdf(logits, masks, mask_of, temperature):
    z = torch.where(masks[mask_of.long()], logits.float(), float("-inf"))
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    return torch.softmax(z.double() / t.double(), dim=-1).cumsum(-1), z, t


def _inner_u(cdf, gen):
    """Per row a u inside a random token's interval of the cdf (the middle), and that token (one of mass
    1e-4 or more: float32 sums in another order move the ends of an interval by far less)."""
    R, V = cdf.shape
    p = torch.diff(cdf, dim=-1, prepend=torch.zeros(R, 1, dtype=cdf.dtype))
    token = torch.multinomial(torch.where(p >= 1e-4, p, 0).float(), 1, generator=gen)[:, 0]
    hi = cdf.gather(1, token[:, None])[:, 0]
    return ((hi - p.gather(1, token[:, None])[:, 0] / 2) / cdf[:, -1]).float(), token


@pytest.mark.interpreter
@pytest.mark.parametrize("R,V,seed", [(4, 7, 0), (64, 3 * CHUNK + 17, 1), (3, CHUNK, 2), (32, 2 * CHUNK + 1, 3)])
def test_the_pick_is_the_token_whose_interval_holds_u(R, V, seed):
    logits, masks, mask_of, temperature = _case(R, V, seed)
    cdf, z, t = _reference_cdf(logits, masks, mask_of, temperature)
    u, token = _inner_u(cdf.cpu(), torch.Generator().manual_seed(seed))
    out = sample_rows(logits, masks, mask_of, temperature, u, chunk=CHUNK)
    assert torch.equal(out, token)
    assert torch.equal(out, inverse_cdf(z, t, u[:, None]))  # the engine's torch form agrees there
    assert masks[mask_of.long(), out].all()


@pytest.mark.interpreter
def test_the_ends_of_the_distribution_and_a_row_alone():
    R, V = 6, 3 * CHUNK + 5
    logits, masks, mask_of, temperature = _case(R, V, 7)
    logits[:, -40:-1] = -1e4                                     # tokens without mass (exp underflows to 0)
    allowed = masks[mask_of.long()]
    has_mass = allowed & (logits > -1e3)
    first = has_mass.float().argmax(-1)                          # u = 0: the first token with mass
    assert torch.equal(sample_rows(logits, masks, mask_of, temperature, torch.zeros(R), chunk=CHUNK), first)
    end = sample_rows(logits, masks, mask_of, temperature, torch.ones(R), chunk=CHUNK)
    cdf, _, _ = _reference_cdf(logits, masks, mask_of, temperature)
    assert has_mass[torch.arange(R), end].all()                  # u = 1 (rounded up): never a token without mass,
    assert (cdf[torch.arange(R), end] > 1 - 1e-5).all()          # one at the very end of the distribution
    u = torch.rand(R, generator=torch.Generator().manual_seed(1))
    together = sample_rows(logits, masks, mask_of, temperature, u, chunk=CHUNK)
    for r in range(R):  # each row's arithmetic is its own
        alone = sample_rows(logits[r:r + 1], masks, mask_of[r:r + 1], temperature[r:r + 1], u[r:r + 1], chunk=CHUNK)
        assert alone[0] == together[r]
    none = torch.zeros(1, V, dtype=torch.bool)                   # no token allowed: 0, no error
    assert sample_rows(logits[:1], none, torch.zeros(1, dtype=torch.int32), temperature[:1], u[:1], chunk=CHUNK)[0] == 0
    assert torch.equal(sample_rows(logits, None, mask_of, temperature, u, chunk=CHUNK),
                       sample_rows(logits, masks[:1], torch.zeros_like(mask_of), temperature, u, chunk=CHUNK))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pick_is_the_token_whose_interval_holds_u(dtype):
    logits, masks, mask_of, temperature = _case(64, 128256, 11, "cuda", dtype)
    cdf, _, _ = _reference_cdf(logits, masks, mask_of, temperature)
    u, token = _inner_u(cdf.cpu(), torch.Generator().manual_seed(11))
    assert torch.equal(sample_rows(logits, masks, mask_of, temperature, u.cuda()).cpu(), token)
