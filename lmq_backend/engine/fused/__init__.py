"""The fused decode step of Llama-family models: see `decoder.py`."""
from .decoder import DevicePicks, FusedDecoder, bucket_for
from .weights import decoder_weights, supports

__all__ = ["supports", "FusedDecoder", "DevicePicks", "bucket_for", "decoder_weights"]
