"""Shared fixtures: the embedded default model, and tiny random-weight models on its tokenizer."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lmq_backend.backend.default_model import default_model_dir


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


def tiny_llama(vocab_size: int = 49152, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(vocab_size: int = 49152, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=4096,
                        bos_token_id=0, eos_token_id=2)
    return GPT2LMHeadModel(config).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


@pytest.fixture(scope="session")
def tiny_models():
    return {name: make() for name, make in MODELS.items()}


@pytest.fixture
def make_backend(tokenizer, tiny_models):
    """make_backend("llama" | "gpt2", cache_budget) -> an HFBackend over a tiny random model."""
    from lmq_backend.backend.hf import HFBackend

    def make(kind: str = "llama", cache_budget="64MB"):
        return HFBackend.from_model(tiny_models[kind], tokenizer, cache_budget=cache_budget, name=f"tiny-{kind}")

    return make


@pytest.fixture(scope="session")
def default_backend():
    from lmq_backend.backend.protocol import get_backend

    return get_backend("default")
