"""The fused step's test models and drivers, shared by the fused step's tests and the kernels' tests: tiny
Llama / Qwen2 / Qwen3 models, a Llama-3.2-1B-shaped one, dense pools, per-row HF prefills into a pool, HF's own
decode of a padded batch, and a prefill-then-steps run whose forwards two configurations must agree on."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lmq_backend.engine import compat
from lmq_backend.engine.fused import FusedDecoder
from support.caches import paged_view


# ------------------------------------------------------------------------------------------------ models

def tiny_llama(seed=0, rope_scaling=False, **kw):
    torch.manual_seed(seed)
    extra = {}
    if rope_scaling:
        extra["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, **extra, **kw)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-zero q/k/v biases
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return model


def tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


# ------------------------------------------------------------------------------------------------ helpers

def make_pool(model, batch, capacity, fill=float("nan")):
    layers, heads, head_dim = compat.kv_shape(model.config)
    p = next(model.parameters())
    return torch.full((layers, 2, batch, heads, capacity, head_dim), fill, dtype=p.dtype, device=p.device)


@torch.inference_mode()
def prefill_into_pool(model, prompts, pool, end):
    """Per-row HF prefills, K/V copied right-aligned so every row ends at column `end`.
    Returns (start int32 [B], last-position logits [B, V])."""
    dev = pool.device
    last = []
    # the pool's invariant (kv_pool.py): a row's columns from the batch's first valid one hold finite values
    pool[:, :, :len(prompts), :, end - max(map(len, prompts)):end] = 0
    for b, ids in enumerate(prompts):
        n = len(ids)
        logits, cache = compat.forward(model, torch.tensor([ids], device=dev), torch.ones(1, n, dtype=torch.long,
                                       device=dev), torch.arange(n, device=dev)[None], compat.make_cache(None))
        for l, (k, v) in enumerate(compat.cache_layers(cache)):
            pool[l, 0, b, :, end - n:end] = k[0]
            pool[l, 1, b, :, end - n:end] = v[0]
        last.append(logits[0, -1])
    start = torch.tensor([end - len(p) for p in prompts], dtype=torch.int32, device=dev)
    return start, torch.stack(last)


class HFPadded:
    """HF's own decode of the same left-padded batch: a DynamicCache built once from the pool's columns
    [0, end) (padding zeroed) that HF then grows itself, and the padded attention mask."""

    def __init__(self, model, pool, start, end):
        B = start.shape[0]
        self.model = model
        layers = [(pool[l, 0, :B, :, :end].nan_to_num(0.0).clone(), pool[l, 1, :B, :, :end].nan_to_num(0.0).clone())
                  for l in range(pool.shape[0])]
        self.cache = compat.make_cache(layers)
        cols = torch.arange(end, device=pool.device)
        self.mask = (cols[None] >= start.long()[:, None]).long()

    @torch.inference_mode()
    def step(self, tokens, positions):
        B = tokens.shape[0]
        self.mask = torch.cat([self.mask, torch.ones(B, 1, dtype=torch.long, device=self.mask.device)], dim=1)
        logits, self.cache = compat.forward(self.model, tokens[:, None], self.mask, positions[:, None], self.cache)
        return logits[:, -1]

    def new_kv(self, layer):
        k, v = compat.cache_layers(self.cache)[layer]
        return k[:, :, -1], v[:, :, -1]


def run_compare(model, prompts, steps, *, capacity=48, max_batch=4, use_graphs=False, atol=1e-4,
                kv_atol=1e-5, greedy=False):
    """Prefill, then `steps` fused steps vs HF; returns (max logit error, tokens fused, tokens HF)."""
    torch.manual_seed(1)
    B = len(prompts)
    dev = next(model.parameters()).device
    pool = make_pool(model, max_batch, capacity)
    end = max(len(p) for p in prompts) + 3
    start, last = prefill_into_pool(model, prompts, pool, end)
    before_pad_rows = pool[:, :, B:].clone()
    hf = HFPadded(model, pool, start, end)
    dec = FusedDecoder(model, *paged_view(pool), max_batch=max_batch, use_graphs=use_graphs)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    tok_f = tok_h = last.argmax(-1)
    worst = 0.0
    seq_f, seq_h = [], []
    for i in range(steps):
        if not greedy:
            tok_f = tok_h = torch.randint(0, model.config.vocab_size, (B,), device=dev)
        pos = lengths + i
        ref = hf.step(tok_h, pos).float()
        got = dec.step(tok_f, pos, start, end + i).float()
        if not greedy:
            err = (got - ref).abs().max().item()
            worst = max(worst, err)
            assert err <= atol, f"step {i}: logits differ by {err}"
            for l in range(pool.shape[0]):
                k, v = hf.new_kv(l)
                torch.testing.assert_close(pool[l, 0, :B, :, end + i].float(), k.float(), atol=kv_atol, rtol=0)
                torch.testing.assert_close(pool[l, 1, :B, :, end + i].float(), v.float(), atol=kv_atol, rtol=0)
        else:
            tok_f, tok_h = got.argmax(-1), ref.argmax(-1)
            seq_f.append(tok_f.tolist())
            seq_h.append(tok_h.tolist())
    # rows past the batch (padding of the bucket) were never written
    assert torch.equal(pool[:, :, B:].nan_to_num(7.0), before_pad_rows.nan_to_num(7.0))
    return worst, seq_f, seq_h


PROMPTS = [[5, 17, 33, 2, 9, 11, 4], [8, 1, 99], [42] * 12]


def prefill_then_steps(model, configure=lambda decoder: None, steps=2, seed=0):
    """A fused prefill of three ragged rows (new tokens 7, 9, 2 after 0, 3, 1 cached) into slots 1..3 of a
    pool of random stand-in K/V (slot 0 another row), then `steps` decode steps on the greedy picks;
    `configure(decoder)` picks the ops under test. Returns (logits of each forward, pool, pool before)."""
    gen = torch.Generator().manual_seed(seed)
    before = torch.randn(make_pool(model, 4, 40).shape, generator=gen)
    rows = [(torch.randint(0, 1000, (m,), generator=gen).tolist(), c) for m, c in ((7, 0), (9, 3), (2, 1))]
    end = 30
    start = torch.tensor([end - c - len(ids) for ids, c in rows], dtype=torch.int32)
    lengths = torch.tensor([c + len(ids) for ids, c in rows])
    pool = before.clone()
    kv, table = paged_view(pool)
    whole = FusedDecoder(model, kv, table, max_batch=4, use_graphs=False)
    configure(whole)
    out = [whole.prefill(rows, 1, end).clone()]
    decoder = FusedDecoder(model, kv, table[1:], max_batch=3, use_graphs=False)
    configure(decoder)
    tokens = out[0].argmax(-1)
    for i in range(steps):
        out.append(decoder.step(tokens, lengths + i, start, end + i).clone())
        tokens = out[-1].argmax(-1)
    return out, pool, before


def assert_same_forwards(run, reference, atol=2e-5, rtol=1e-5):
    """Two `prefill_then_steps` runs agree: every forward's logits, every K/V, slot 0 untouched."""
    (out, pool, before), (ref_out, ref_pool, _) = run, reference
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    torch.testing.assert_close(pool, ref_pool, atol=atol, rtol=rtol)
    assert torch.equal(pool[:, :, 0], before[:, :, 0])


def llama_1b_shaped(layers=16, dtype=torch.bfloat16, vocab=128256):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa").eval()
