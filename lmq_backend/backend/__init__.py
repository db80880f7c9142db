"""Backends: the protocol the query runtime calls (`protocol.py`), the registry of named backends, and the
Hugging Face backend on lmq's engine (`hf.py`: tokenizing, a hole's token loop in `hole_loop.py`, the token
masks it picks under in `masks.py`)."""
