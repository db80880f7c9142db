"""The greedy pick under a token mask, shared by the runtime's `Greedy` decoder, the runner's prefill picks
and the fused step's device picks, so that all three pick the same token."""
from __future__ import annotations

import torch


def masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Index of the largest logit among the allowed tokens, over the last dimension.

    logits: [..., V]; allowed: bool broadcastable to logits (e.g. [V], or [K, 1, V] against [1, B, V] for a
    pick under each of K masks), or None for every token; moved to the logits' device. Ties go to the
    first maximal logit (torch.argmax), so the pick is exact and the same on every device. Returns [...]
    (int64, on the logits' device)."""
    if allowed is not None:
        allowed = allowed.to(logits.device, non_blocking=logits.device.type == "cuda")
        logits = torch.where(allowed, logits, float("-inf"))
    return logits.argmax(-1)
