"""The fused decode step (`lmq_backend.engine.fused`) against the Hugging Face forward.

CPU (float32, eager, torch fallbacks + the reference attention): tiny random Llama / Qwen2 / Qwen3 models,
a left-padded batch of rows of different lengths prefilled by HF into a static pool, several steps in a
row; logits and the K/V written into the pool must match HF's padded-batch forward.

GPU (`gpu` tests, skipped without CUDA): bf16 logits against HF, float32 greedy tokens
identical to HF over 32 steps on a Llama-3.2-1B-shaped model, graphs on vs off bitwise identical.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lmq_backend.engine.fused import FusedDecoder, bucket_for, supports
from support.caches import paged_view
from support.fused import (PROMPTS, HFPadded, llama_1b_shaped, make_pool, prefill_into_pool, run_compare, tiny_llama,
                           tiny_qwen2, tiny_qwen3)


# ------------------------------------------------------------------------------------------------ CPU

def test_supports():
    assert supports(tiny_llama(), require_cuda=False)
    assert not supports(tiny_llama())  # on the CPU
    assert supports(tiny_qwen2(), require_cuda=False)
    assert supports(tiny_qwen3(), require_cuda=False)
    assert supports(tiny_llama(rope_scaling=True), require_cuda=False)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2))
    assert not supports(gpt2, require_cuda=False)
    assert not supports(tiny_llama(hidden_act="gelu"), require_cuda=False)
    assert not supports(tiny_llama(mlp_bias=True), require_cuda=False)
    with pytest.raises(ValueError):
        FusedDecoder(gpt2, *paged_view(torch.zeros(1, 2, 1, 2, 8, 16)), max_batch=1)


def test_bucket_for():
    assert [bucket_for(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(9, 12) == 12


@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_llama(rope_scaling=True), tiny_qwen2, tiny_qwen3],
                         ids=["llama", "llama3-rope", "qwen2", "qwen3"])
def test_cpu_matches_hf(make):
    worst, _, _ = run_compare(make(), PROMPTS, steps=5)
    assert worst < 1e-4


def test_cpu_single_row_and_full_bucket():
    model = tiny_llama(seed=3)
    run_compare(model, PROMPTS[:1], steps=3, max_batch=1)
    run_compare(model, PROMPTS + [[3, 3, 3, 3]], steps=3, max_batch=4)


def test_cpu_greedy_matches_hf():
    _, f, h = run_compare(tiny_llama(seed=2), PROMPTS, steps=10, greedy=True)
    assert f == h


def test_cpu_strided_pool_view():
    """The decoder works on a pool whose batch dim is a slice of a larger one (non-contiguous)."""
    model = tiny_llama(seed=4)
    big = make_pool(model, 6, 40)
    pool = big[:, :, :4]
    start, last = prefill_into_pool(model, PROMPTS, pool, 20)
    hf = HFPadded(model, pool, start, 20)
    dec = FusedDecoder(model, *paged_view(pool), max_batch=4, use_graphs=False)
    tok = last.argmax(-1)
    pos = torch.tensor([len(p) for p in PROMPTS])
    torch.testing.assert_close(dec.step(tok, pos, start, 20).float(), hf.step(tok, pos).float(), atol=1e-4, rtol=0)
    assert torch.isnan(big[:, :, 4:]).all()


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weights_loaded_after_the_layout_reach_every_step(device, assign):
    """`load_state_dict` into a model the fused step has laid out reaches the steps of a decoder built (and,
    on a GPU, captured) before it and of one built after, and the model's own forward: the fused step's
    copies (q/k/v biases, a tied LM head on the CPU, the q/k/v and gate/up concatenations on a GPU) follow,
    and so do its K-major matrices on the CPU when the load replaces the parameters (`assign=True`)."""
    def qwen2():  # q/k/v biases, a tied LM head, head_dim 64
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return Qwen2ForCausalLM(cfg).to(device).eval()

    model, reference = qwen2(), qwen2()
    pool = make_pool(model, 4, 48)
    end = max(map(len, PROMPTS)) + 3
    start, last = prefill_into_pool(model, PROMPTS, pool, end)
    tokens, positions = last.argmax(-1), torch.tensor([len(p) for p in PROMPTS], device=device)
    before = FusedDecoder(model, *paged_view(pool), max_batch=4)
    before.step(tokens, positions, start, end)  # on a GPU: captures its graph

    noise = torch.Generator().manual_seed(1)
    state = {k: v + torch.randn(v.shape, generator=noise).to(v) * (v.std() + 0.1)
             for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for m in (model, reference):
        m.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
    ids = torch.tensor([PROMPTS[0]], device=device)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    start, last = prefill_into_pool(reference, PROMPTS, pool, end)
    want = HFPadded(reference, pool, start, end).step(tokens, positions).float()
    after = FusedDecoder(model, *paged_view(pool), max_batch=4)
    for decoder in (before, after):
        torch.testing.assert_close(decoder.step(tokens, positions, start, end).float(), want, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------ GPU

def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.gpu
def test_cuda_bf16_logits_close_to_hf():
    """bf16 fused vs bf16 HF, both measured against the float32 HF forward of the same weights: the fused
    step's error must be within 1.5x HF bf16's own error (+ 0.01)."""
    model = llama_1b_shaped(layers=4, dtype=torch.float32)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts = _prompts([300, 37, 180], model.config.vocab_size)
    cap, end = 512, 310
    pool32, pool16 = make_pool(model, 4, cap), make_pool(model16, 4, cap)
    start, _ = prefill_into_pool(model, prompts, pool32, end)
    # the bf16 pool gets the float32 prefill rounded, so all three decode from the same K/V
    pool16.copy_(pool32.to(torch.bfloat16))
    hf32, hf16 = HFPadded(model, pool32, start, end), HFPadded(model16, pool16, start, end)
    dec = FusedDecoder(model16, *paged_view(pool16), max_batch=4, use_graphs=True)
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    errs_hf, errs_f = [], []
    for i in range(4):
        tok = torch.randint(0, 1000, (3,), device="cuda")
        ref = hf32.step(tok, pos + i).float()
        e_hf = (hf16.step(tok, pos + i).float() - ref).abs().max().item()
        e_f = (dec.step(tok, pos + i, start, end + i).float() - ref).abs().max().item()
        errs_hf.append(e_hf)
        errs_f.append(e_f)
    print(f"bf16 max |logit - fp32 HF|: HF {max(errs_hf):.4f}, fused {max(errs_f):.4f}, "
          f"logit scale {ref.abs().max().item():.3f}")
    assert max(errs_f) <= 1.5 * max(errs_hf) + 0.01


@pytest.mark.gpu
def test_cuda_fp32_greedy_identical_to_hf():
    model = llama_1b_shaped(layers=16, dtype=torch.float32)
    prompts = _prompts([200, 61, 130], model.config.vocab_size, seed=1)
    _, f, h = run_compare(model, prompts, steps=32, capacity=256, max_batch=4, use_graphs=True, greedy=True)
    assert f == h


@pytest.mark.gpu
def test_cuda_graphs_match_eager_bitwise():
    model = llama_1b_shaped(layers=4, dtype=torch.bfloat16)
    prompts = _prompts([100, 40, 77, 5, 90], model.config.vocab_size, seed=2)
    pool = make_pool(model, 8, 256, fill=0.0)
    start, last = prefill_into_pool(model, prompts, pool, 120)
    pool2 = pool.clone()
    eager = FusedDecoder(model, *paged_view(pool), max_batch=8, use_graphs=False)
    graph = FusedDecoder(model, *paged_view(pool2), max_batch=8, use_graphs=True)
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    tok = last.argmax(-1)
    for i, B in enumerate([5, 5, 1, 3, 5, 2]):
        a = eager.step(tok[:B], pos[:B] + i, start[:B], 120 + i).clone()
        b = graph.step(tok[:B], pos[:B] + i, start[:B], 120 + i).clone()
        assert torch.equal(a, b), f"step {i} (B={B}) differs: {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(pool, pool2)


def test_cpu_layout_keeps_the_model_savable(tmp_path):
    """On the CPU the fused step re-lays the model's Linear weights out K-major (views of shared buffers);
    the model must still compute the same, save with `save_pretrained` and load back equal."""
    from lmq_backend.engine.fused import decoder_weights

    model = tiny_llama(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        expected = model(x).logits
    decoder_weights(model)
    assert not model.model.layers[0].self_attn.q_proj.weight.is_contiguous()  # the layout did change
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, expected, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, use_kernels=False)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, before[k]), k
