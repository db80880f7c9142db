"""Triton kernels for the fused decode path (see ``decode_attention`` for the cache layout)."""

from .decode_attention import NewToken, choose_num_splits, decode_attention, interpreter_active
from .reference import decode_attention_reference

__all__ = ["decode_attention", "NewToken", "decode_attention_reference", "choose_num_splits", "interpreter_active"]
