"""lmq's Triton kernels, on the paged K/V store read through page tables: decode attention (one query a row,
split-K, cascade over shared prefixes; the step's new token rotated and appended in the same launch),
prefill attention, the greedy pick under masks, sampling of many rows, and the decode step's small ops."""

from .decode_attention import NewToken, choose_num_splits, decode_attention, interpreter_active
from .reference import decode_attention_reference

__all__ = ["decode_attention", "NewToken", "decode_attention_reference", "choose_num_splits", "interpreter_active"]
