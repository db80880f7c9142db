"""The model runner: forwards of a Hugging Face causal LM on top of cached K/V.

K/V move between the runner and the prefix trie in the trie's layout `[L, 2, H_kv, T, D]`
(see `lmq_backend/cache/trie.py`); inside a forward they live in a transformers cache, per layer
`[B, H_kv, T, D]`.
"""
from __future__ import annotations

import torch

from . import compat


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().out_features

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, prefix: torch.Tensor | None, ids: list[int], start: int):
        """Run `ids` at positions start.. on top of `prefix` ([L,2,H,start,D] or None when start == 0).

        Returns (logits of the last position [V] float32, cache holding start + len(ids) tokens)."""
        assert ids, "a prefill needs at least one new token"
        layers = None if prefix is None else [(prefix[i, 0][None], prefix[i, 1][None]) for i in range(prefix.shape[0])]
        cache = compat.make_cache(layers)
        n = start + len(ids)
        positions = torch.arange(start, n, device=self.device)[None]
        mask = torch.ones(1, n, dtype=torch.long, device=self.device)
        logits, cache = compat.forward(self.model, self._ids(ids), mask, positions, cache)
        return logits[0, -1].float(), cache

    @torch.inference_mode()
    def decode(self, cache, token: int, position: int):
        """One token at `position` on top of `cache` (which holds `position` tokens)."""
        positions = torch.tensor([[position]], device=self.device)
        mask = torch.ones(1, position + 1, dtype=torch.long, device=self.device)
        logits, cache = compat.forward(self.model, self._ids([token]), mask, positions, cache)
        return logits[0, -1].float(), cache

    @staticmethod
    def kv_slice(cache, start: int, end: int) -> torch.Tensor:
        """K/V of positions [start, end) of row 0, as a new tensor in the trie layout [L, 2, H, T, D]."""
        return torch.stack([torch.stack((k[0, :, start:end], v[0, :, start:end]))
                            for k, v in compat.cache_layers(cache)])

    @torch.inference_mode()
    def score(self, cache, start: int, last_logits: torch.Tensor, options: list[list[int]]) -> list[float]:
        """Sum of log-probabilities of each option's tokens after the `start` tokens held in `cache`, whose
        next-token logits are `last_logits`. The options run as one right-padded batch."""
        first = torch.log_softmax(last_logits, dim=-1)
        scores = [float(first[o[0]]) if o else 0.0 for o in options]
        rows = [(i, o) for i, o in enumerate(options) if len(o) > 1]
        if not rows:
            return scores
        width = max(len(o) - 1 for _, o in rows)
        b = len(rows)
        ids = torch.zeros(b, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(b, start + width, dtype=torch.long, device=self.device)
        mask[:, :start] = 1
        for r, (_, o) in enumerate(rows):
            ids[r, : len(o) - 1] = torch.tensor(o[:-1])
            mask[r, start: start + len(o) - 1] = 1
        positions = torch.arange(start, start + width, device=self.device)[None].expand(b, -1)
        layers = [(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in compat.cache_layers(cache)]
        logits, _ = compat.forward(self.model, ids, mask, positions, compat.make_cache(layers), logits_to_keep=width)
        logp = torch.log_softmax(logits.float(), dim=-1)
        for r, (i, o) in enumerate(rows):
            targets = torch.tensor(o[1:], device=self.device)
            scores[i] += float(logp[r, torch.arange(len(o) - 1), targets].sum())
        return scores
