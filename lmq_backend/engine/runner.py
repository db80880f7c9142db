"""The model runner: forwards of a Hugging Face causal LM on top of cached K/V.

K/V move between the runner and the prefix trie in the trie's layout `[L, 2, H_kv, T, D]`
(see `lmq_backend/cache/trie.py`); inside a forward they live in a transformers cache, per layer
`[B, H_kv, T, D]`.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass

from . import compat
from .kv_buffer import KVBuffer


@dataclass(slots=True)
class RowCache:
    """One row's K/V during a generation: the buffer and the transformers cache that writes into it."""

    buffer: KVBuffer
    cache: object

    def segment(self, start: int, end: int) -> torch.Tensor:
        """K/V of positions [start, end), trie layout [L, 2, H, T, D] (a view: the trie copies it)."""
        return self.buffer.segment(0, start, end)


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().out_features
        self.kv_shape = compat.kv_shape(model.config)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, segments: list[torch.Tensor], ids: list[int], start: int, room: int = 64):
        """Run `ids` at positions start.. on top of the cached `segments` (trie nodes' K/V [L,2,H,T,D], `start`
        tokens in all), leaving room for `room` more tokens.

        Returns (logits of the last position [V] float32, a RowCache holding start + len(ids) tokens)."""
        assert ids, "a prefill needs at least one new token"
        buffer = KVBuffer.from_segments(segments, len(ids) + room, shape=self.kv_shape,
                                        dtype=self.dtype, device=self.device)
        row = RowCache(buffer, compat.buffer_cache(buffer, start))
        n = start + len(ids)
        positions = torch.arange(start, n, device=self.device)[None]
        mask = torch.ones(1, n, dtype=torch.long, device=self.device)
        logits, _ = compat.forward(self.model, self._ids(ids), mask, positions, row.cache)
        return logits[0, -1].float(), row

    @torch.inference_mode()
    def decode(self, row: "RowCache", token: int, position: int) -> torch.Tensor:
        """One token at `position` on top of `row` (which holds `position` tokens); returns its logits [V]."""
        positions = torch.tensor([[position]], device=self.device)
        mask = torch.ones(1, position + 1, dtype=torch.long, device=self.device)
        logits, _ = compat.forward(self.model, self._ids([token]), mask, positions, row.cache)
        return logits[0, -1].float()

    @torch.inference_mode()
    def score(self, row: "RowCache", start: int, last_logits: torch.Tensor, options: list[list[int]]) -> list[float]:
        """Sum of log-probabilities of each option's tokens after the `start` tokens held in `row`, whose
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
        layers = [(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in compat.cache_layers(row.cache)]
        logits, _ = compat.forward(self.model, ids, mask, positions, compat.make_cache(layers), logits_to_keep=width)
        logp = torch.log_softmax(logits.float(), dim=-1)
        for r, (i, o) in enumerate(rows):
            targets = torch.tensor(o[1:], device=self.device)
            scores[i] += float(logp[r, torch.arange(len(o) - 1), targets].sum())
        return scores
