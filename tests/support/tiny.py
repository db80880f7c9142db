"""Tiny random-weight models on the default model's tokenizer, and a Llama-2-style tokenizer built here."""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


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
