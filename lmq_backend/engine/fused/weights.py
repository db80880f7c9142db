"""Which models the fused step runs (`supports`), and their weights laid out for it (`decoder_weights`).

Per decoder layer (`_Layer`): the q/k/v projections as one [(Hq + 2 H_kv) D, hidden] matrix and their biases
as one vector, gate and up as one [2 I, hidden] matrix, the norms, o_proj and down_proj as they are. On a
GPU the concatenations are copies; on the CPU every matrix is stored K-major and the model's own Linear
modules are re-pointed to views of it. Made once per model (`decoder_weights`).
"""
from __future__ import annotations

import weakref

import torch

_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ROPE_TYPES = ("default", "llama3", "linear")  # these only change inv_freq (attention_scaling == 1)


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def _why_not(model, require_cuda: bool = True) -> str | None:
    """None when `FusedDecoder` handles `model`, else the reason."""
    name = type(model).__name__
    if name not in _ARCHS:
        return f"architecture {name} is not a supported Llama-family model"
    config = model.config
    try:
        param = next(model.parameters())
    except StopIteration:
        return "model has no parameters"
    if require_cuda and param.device.type != "cuda":
        return "model is not on a CUDA device"
    if _rope_type(config) not in _ROPE_TYPES:
        return f"rope type {_rope_type(config)!r} is not supported"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq") or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "rotary embedding without a plain inv_freq"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        return "sliding-window layers"
    if name == "MistralForCausalLM" and getattr(config, "sliding_window", None) is not None:
        return "Mistral sliding window"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit softcapping"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn.o_proj, "bias", None) is not None:
            return "o_proj bias"
        if any(getattr(p, "bias", None) is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "MLP biases"
        if getattr(attn, "sliding_window", None):
            return "sliding-window attention"
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            return "q_norm without k_norm"
    return None


def supports(model, *, require_cuda: bool = True) -> bool:
    """True for Llama / Mistral (no sliding window) / Qwen2 (q/k/v biases) / Qwen3 (q/k norms) causal LMs with
    default, llama3 or linear RoPE and SiLU MLPs, on CUDA (`require_cuda=False`: on any device, eager)."""
    return _why_not(model, require_cuda) is None


def _k_major(w: torch.Tensor) -> torch.Tensor:
    """The same [N, K] matrix stored K-major (column-major): `x @ w.t()` then reads a row-major [K, N]
    operand, which the CPU's BLAS multiplies 1.2-1.6x faster than [N, K] at 8-21 rows (SmolLM2 shapes)."""
    return w.t().contiguous().t()


def _repoint(module, weight: torch.Tensor) -> None:
    """Make `weight` (a K-major view) the module's weight. Its `state_dict` keeps giving a contiguous copy,
    so that saving the model (`save_pretrained`, safetensors) works as before."""
    module.weight.data = weight
    if not getattr(module, "_lmq_contiguous_state", False):
        module.register_state_dict_post_hook(_contiguous_weight_state)
        module._lmq_contiguous_state = True


def _contiguous_weight_state(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].contiguous()


class _Layer:
    """One decoder layer's weights, as the fused step uses them.

    On the GPU the concatenated projections are copies. On the CPU they are stored K-major and the model's
    own Linear modules are re-pointed to views of them: one copy of the weights in memory, and the model's
    forward (prefills) reads the faster layout too."""

    def __init__(self, layer, k_major: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            self.in_norm = layer.input_layernorm.weight
            self.post_norm = layer.post_attention_layernorm.weight
            self.eps = float(layer.input_layernorm.variance_epsilon)
            qkv, gu = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
            if k_major:
                self.wqkv = _k_major(torch.cat([m.weight for m in qkv]))  # [(Hq + 2 H_kv) D, hidden]
                self.wgu = _k_major(torch.cat([m.weight for m in gu]))    # [2 I, hidden]
                self.wo, self.wdown = _k_major(attn.o_proj.weight), _k_major(mlp.down_proj.weight)
                for modules, stored in ((qkv, self.wqkv), (gu, self.wgu)):
                    row = 0
                    for m in modules:
                        n = m.weight.shape[0]
                        _repoint(m, stored[row:row + n])
                        row += n
                _repoint(attn.o_proj, self.wo)
                _repoint(mlp.down_proj, self.wdown)
            else:
                self.wqkv = torch.cat([m.weight for m in qkv]).contiguous()
                self.wgu = torch.cat([m.weight for m in gu]).contiguous()
                self.wo = attn.o_proj.weight                      # [hidden, Hq D]
                self.wdown = mlp.down_proj.weight                 # [hidden, I]
            biases = [m.bias for m in qkv]
            if any(b is not None for b in biases):
                self.bqkv = torch.cat([b if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype,
                                                                              device=m.weight.device)
                                       for b, m in zip(biases, qkv)])
            else:
                self.bqkv = None
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.q_norm = qn.weight if qn is not None else None
            self.k_norm = kn.weight if kn is not None else None
            self.qk_eps = float(qn.variance_epsilon) if qn is not None else 1e-6
            self.scaling = float(attn.scaling)


class _Weights:
    """A model's weights as the fused step reads them, built once per model (a decoder is rebuilt whenever
    a growable CPU pool is reallocated)."""

    def __init__(self, model):
        k_major = next(model.parameters()).device.type == "cpu"
        self.layers = [_Layer(layer, k_major) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight         # [V, hidden]
        self.final_norm = model.model.norm.weight
        self.final_eps = float(model.model.norm.variance_epsilon)
        lm_head = model.lm_head.weight                       # [V, hidden] (tied: the embedding itself)
        if k_major:
            with torch.no_grad():
                tied = lm_head.data_ptr() == self.embed.data_ptr()
                lm_head = _k_major(lm_head)
                if not tied:  # tied: the K-major copy stays ours, the embedding's row lookups need rows contiguous
                    _repoint(model.lm_head, lm_head)
        self.lm_head = lm_head
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().to(torch.float32).contiguous()


_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_weights(model) -> _Weights:
    """The model's weights laid out for the fused step (once per model; on the CPU this re-points the model's
    own Linear weights, see `_Layer`)."""
    w = _WEIGHTS.get(model)
    if w is None:
        w = _WEIGHTS[model] = _Weights(model)
    return w
