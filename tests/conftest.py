"""Shared fixtures: the embedded default model, and tiny random-weight models on its tokenizer."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lmq_backend.backend.default_model import default_model_dir


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def vocab(tokenizer):
    """The default tokenizer's vocabulary index (the constraint tests': constraint_sim.py)."""
    from lmq_backend.runtime.vocab import VocabIndex

    return VocabIndex.for_tokenizer(tokenizer)


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


def llama_style_tokenizer():
    """A Llama-2-like tokenizer: BPE over `▁`-pieces with <0xNN> byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = []
    for ch in "▁abcdefghijklmnopqrstuvwxyz,.!0123456789é":
        vocab.setdefault(ch, len(vocab))
    for a, b in [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "h"), ("e", "l"), ("el", "l"), ("ell", "o"),
                 ("▁h", "ello"), ("▁", "w"), ("o", "r"), ("▁w", "or")]:
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tk = Tokenizer(model)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


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
    from lmq_backend.backend.registry import get_backend

    return get_backend("default")


# context-sensitive models (tests/models.py): `zoo.backend(family)`, `zoo.reference(family)`
from models import zoo  # noqa: E402,F401


def pytest_collection_modifyitems(items):
    """The Ray tests run first: `ray.init` forks its cluster's processes from this one, and a fork of the
    process the later tests grow to GBs can fail for memory on a small host (heuristic overcommit)."""
    items.sort(key=lambda item: item.path.name != "test_distributed.py")
