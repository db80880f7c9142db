"""The exactness tests have teeth: the test models notice a wrong context, and a broken engine fails the
comparison with the independent reference (tests/support/models.py, tests/backend/test_reference.py).

- Sensitivity: on every family, dropping one context token changes the greedy continuation in >= 90% of
  40 random prompts.
- Fault injection: the engine with one cached K column corrupted, or one position id shifted by one in a
  prefill or a decode step, gives tokens that differ from the reference, where the intact engine gives
  the same tokens (tests/backend/test_reference.py).
"""
from __future__ import annotations

import random

import pytest
import torch

from support.models import FAMILIES, SCRIPT, differences, expected, run_engine, special_ids, standard_calls


@torch.no_grad()
def _greedy_batch(model, prompts: list[list[int]], n: int) -> torch.Tensor:
    """n greedy tokens after each prompt (all of one length), by the model's own `generate`."""
    ids = torch.tensor(prompts)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("family", FAMILIES)
def test_dropping_one_context_token_changes_the_greedy_continuation(zoo, family):
    """40 prompts of 30 random (non-special) token ids; drop the token at a random position (any, the first
    included); the next 8 greedy tokens of the reference instance must differ in at least 36 of 40."""
    rng = random.Random(1)
    specials = special_ids(zoo.tokenizer)
    vocab = [i for i in range(len(zoo.tokenizer)) if i not in specials]
    prompts = [rng.sample(vocab, 30) for _ in range(40)]
    drops = [rng.randrange(30) for _ in prompts]
    model = zoo.reference(family)
    full = _greedy_batch(model, prompts, 8)
    dropped = _greedy_batch(model, [p[:d] + p[d + 1:] for p, d in zip(prompts, drops)], 8)
    changed = (full != dropped).any(dim=1)
    assert int(changed.sum()) >= 36, f"{family}: only {int(changed.sum())}/40 continuations changed"


# --------------------------------------------------------------------------------------- fault injection

def inject_fault(monkeypatch, backend, fault: str, at: int = 0) -> list[int]:
    """Break `backend`'s engine in one place; returns a list that counts the times the fault fired.

    Engine internals patched (adapt these when the engine's K/V layout or forwards change):
    - "cached_k": `backend.trie.path_slots(node)`, the page table of a cached prefix that a prefill reads
      (K/V in the paged store `backend.trie.store.data`, `[L, 2, slots, H_kv, D]`, K after RoPE): on each
      trie hit the K of the prefix's middle token, layer 0, every kv head, gets noise of its own scale
      added in the store (once per slot). Fires on every cache hit.
    - "prefill_position": in the `at`-th prefill with more than one new token a row, the last token of the
      first row gets position + 1 (its RoPE or learned position, and the K it stores): through the model's
      forward `backend.runner._forward(ids, mask, positions, cache, ...)` (GPT-2; unfused decode steps go
      there too), or through `FusedDecoder._set_rope(positions)` in the fused prefill (Llama on the CPU).
    - "decode_position": the `at`-th decode step, first row, position + 1: in the fused CPU step through
      `FusedDecoder._set_rope(positions)` (RoPE's cos/sin of the step's tokens), in an unfused step (GPT-2,
      `runner.fused = False`) through `runner._forward` with one token a row.
    """
    fired: list[int] = []
    if fault == "cached_k":
        trie, path_slots = backend.trie, backend.trie.path_slots
        noise = torch.Generator().manual_seed(0)

        def corrupted_path_slots(node):
            slots = path_slots(node)
            if len(slots):
                slot = int(slots[len(slots) // 2])
                if slot not in fired:
                    k = trie.store.data[0, 0, slot]
                    k += torch.randn(k.shape, generator=noise) * trie.store.data[0, 0, slots].std()
                    fired.append(slot)
            return slots

        monkeypatch.setattr(trie, "path_slots", corrupted_path_slots)
        return fired
    if fault not in ("prefill_position", "decode_position"):
        raise ValueError(fault)
    runner, forward = backend.runner, backend.runner._forward
    seen = {"prefill": 0, "decode": 0}
    wanted = fault.split("_")[0]

    def shift(kind: str, positions: torch.Tensor, column: int) -> torch.Tensor:
        seen[kind] += 1
        if kind != wanted or seen[kind] != at + 1:
            return positions
        fired.append(seen[kind])
        positions = positions.clone()
        positions[0, column] += 1
        return positions

    def shifted_forward(ids, mask, positions, cache, *args, **kwargs):
        kind = "prefill" if ids.shape[1] > 1 else "decode"
        return forward(ids, mask, shift(kind, positions, -1), cache, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward", shifted_forward)
    if runner.fused:
        from lmq_backend.engine.fused import FusedDecoder

        set_rope, prefill = FusedDecoder._set_rope, FusedDecoder.prefill
        width: list[int] = []   # the new tokens a row of the fused prefill under way (none: a decode step)

        def tracked_prefill(self, rows, *args, **kwargs):
            width.append(max(len(ids) for ids, _ in rows))
            try:
                return prefill(self, rows, *args, **kwargs)
            finally:
                width.pop()

        def shifted_rope(self, positions):
            t = width[-1] if width else 1
            if t == 1:
                return set_rope(self, shift("decode", positions[None], 0)[0])
            return set_rope(self, shift("prefill", positions.view(-1, t), -1).reshape(-1))

        monkeypatch.setattr(FusedDecoder, "prefill", tracked_prefill)
        monkeypatch.setattr(FusedDecoder, "_set_rope", shifted_rope)
    return fired


FAULTS = ["cached_k", "prefill_position", "decode_position"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("family", FAMILIES)
async def test_a_broken_engine_fails_the_reference_comparison(zoo, monkeypatch, family, fault):
    """The comparison of tests/backend/test_reference.py (cache on, batched with random arrival) on an engine with
    one fault: lmq's tokens no longer equal the reference's."""
    backend = zoo.backend(family, "64MB")
    fired = inject_fault(monkeypatch, backend, fault, at=2)
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=True, seed=3)
    assert fired, "the fault never fired: the engine no longer runs the patched code"
    assert differences(got, expected(zoo, family)), f"{family}: a {fault} fault went unnoticed"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
async def test_the_same_comparison_passes_without_a_fault(zoo, family):
    """The control: the same run as above without the fault matches the reference."""
    backend = zoo.backend(family, "64MB")
    got = await run_engine(backend, SCRIPT, standard_calls(), batched=True, seed=3)
    assert differences(got, expected(zoo, family)) == []
