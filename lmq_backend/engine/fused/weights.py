"""Which models the fused step runs (`supports`), and their weights laid out for it (`decoder_weights`).

Per decoder layer (`LayerWeights`): the q/k/v projections as one [(Hq + 2 H_kv) D, hidden] matrix and their biases
as one vector, gate and up as one [2 I, hidden] matrix, the norms, o_proj and down_proj as they are. On a
GPU the concatenations are copies; on the CPU every matrix is stored K-major and the model's own Linear
modules are re-pointed to views of it. Made once per model (`decoder_weights`). The CPU layout's K-major
buffers are named (`_Weights.k_major`: "layers.3.qkv", "lm_head.tied", ...); `prepared` buffers of those
names (the same values, kept on disk by `weight_cache.py`) are taken as they are instead of filled.

A weight-only quantized model (`engine/quantize.py`: its Linear modules are `QuantizedLinear`) keeps them:
each matrix of the layout is then a `QuantizedLinear` (q/k/v and gate/up stacked copies), which `LayerOps._mm`
multiplies with; a quantized model's weights are fixed once laid out (a later `load_state_dict` does not
reach the stacked copies).
"""
from __future__ import annotations

import weakref

import torch

from lmq_kernels.cpu.layout import padded_stride

from ..quantize import QuantizedLinear

_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ROPE_TYPES = ("default", "llama3", "linear")  # these only change inv_freq (attention_scaling == 1)


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def why_not(model, require_cuda: bool = True) -> str | None:
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
    return why_not(model, require_cuda) is None


def _k_major(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """An [N, K] matrix stored K-major (column-major): `x @ w.t()` then reads a row-major [K, N] operand,
    which the CPU's BLAS multiplies faster than [N, K] at a few rows. Its row stride
    is `padded_stride` (the padding zeros)."""
    n, k = shape
    ld = padded_stride(n, like.element_size())
    buf = torch.zeros(k, ld, dtype=like.dtype, device=like.device) if ld != n else \
        torch.empty(k, n, dtype=like.dtype, device=like.device)
    return buf[:, :n].t()


# ---------------------------------------------------------------------------------- keeping the layout

def _bind(dest: torch.Tensor, module, name: str = "weight", *, share: bool, also=(), filled: bool = False
          ) -> torch.Tensor:
    """Make `dest` (a laid-out tensor, or a view of one) hold `module.<name>`, now and after every
    `load_state_dict` that reaches `module` or a module in `also` (their load post-hooks place it again).
    `share`: `dest` becomes the parameter's storage, so that every write to the parameter reaches the fused
    step; else `dest` is a copy, which only a load refreshes. `filled`: `dest` holds the parameter's values
    already (a prepared buffer), so placing it now copies nothing. Returns `dest`."""
    _place(dest, module, name, share, filled)
    for m in (module, *also):
        if "_lmq_bindings" not in vars(m):
            m._lmq_bindings = []
            m.register_load_state_dict_post_hook(_place_again)
        m._lmq_bindings.append((dest, module, name, share))
    return dest


def _place(dest: torch.Tensor, module, name: str, share: bool, filled: bool = False) -> None:
    param = getattr(module, name)
    if param.data_ptr() == dest.data_ptr() and param.stride() == dest.stride():
        return  # the parameter is `dest`: a load wrote into it
    if not filled:
        dest.copy_(param)  # a copy, or a parameter a load replaced (`assign=True`)
    if share:
        param.data = dest
        if not dest.is_contiguous() and not getattr(module, "_lmq_contiguous_state", False):
            # its `state_dict` keeps giving a contiguous copy: saving the model (safetensors) works as before
            module.register_state_dict_post_hook(_contiguous_weight_state)
            module._lmq_contiguous_state = True


_LOADS = [0]  # loads that placed weights again (copies made from the laid-out weights are stale after one)


def loads() -> int:
    """How many `load_state_dict`s have placed laid-out weights again (in any model): a copy made from them
    (the CPU step's panel-major weights, `fused/cpu_step.py`) is made again when this changed."""
    return _LOADS[0]


def _place_again(module, incompatible_keys) -> None:
    with torch.no_grad():
        for dest, source, name, share in module._lmq_bindings:
            _place(dest, source, name, share)
    _LOADS[0] += 1


def _contiguous_weight_state(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].contiguous()


class _Buffers:
    """The K-major buffers of a CPU layout by name (`made`); a `prepared` one of the same shape, dtype, strides
    and device is taken instead of a new one (`adopted`: its values are the parameters' already)."""

    def __init__(self, prepared: dict[str, torch.Tensor] | None):
        self.prepared = prepared or {}
        self.made: dict[str, torch.Tensor] = {}
        self.adopted: set[str] = set()

    def k_major(self, key: str, shape: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """An [N, K] K-major buffer for `key`, and whether it is filled already."""
        t = self.prepared.get(key)
        filled = (t is not None and tuple(t.shape) == tuple(shape) and t.dtype == like.dtype
                  and t.device == like.device and t.stride() == (1, padded_stride(shape[0], like.element_size())))
        if filled:
            self.adopted.add(key)
        self.made[key] = t if filled else _k_major(shape, like)
        return self.made[key], filled


def _share(module, buffers: _Buffers | None = None, key: str = "") -> torch.Tensor:
    """The module's weight as the fused step reads it: the parameter's own storage (with `buffers`: moved to
    a K-major buffer named `key`, which the parameter then views)."""
    w = module.weight
    if buffers is None:
        return _bind(w.detach(), module, share=True)
    dest, filled = buffers.k_major(key, tuple(w.shape), w)
    return _bind(dest, module, share=True, filled=filled)


def _stacked(modules, buffers: _Buffers | None = None, key: str = "", name: str = "weight") -> torch.Tensor:
    """The modules' `name` parameters (weights [N_i, K], or biases [N_i]: zeros where one has none)
    concatenated along N; K-major weights (with `buffers`, named `key`) are the modules' own (they view
    it), everything else a copy."""
    rows = [m.out_features for m in modules]
    param = next(getattr(m, name) for m in modules if getattr(m, name) is not None)
    shape = (sum(rows), *param.shape[1:])
    out, filled = buffers.k_major(key, shape, param) if buffers is not None else (param.new_empty(shape), False)
    if any(getattr(m, name) is None for m in modules):
        out.zero_()
    row = 0
    for m, n in zip(modules, rows):
        if getattr(m, name) is not None:
            _bind(out[row:row + n], m, name, share=buffers is not None, filled=filled)
        row += n
    return out


# ---------------------------------------------------------------------------------------- the layout

class LayerWeights:
    """One decoder layer's weights, as the fused step uses them.

    On the GPU the concatenated projections are copies. On the CPU they are stored K-major and the model's
    own Linear modules are re-pointed to views of them: one copy of the weights in memory, and the model's
    forward (prefills) reads the faster layout too. The q/k/v biases are concatenated copies."""

    def __init__(self, layer, buffers: _Buffers | None = None, key: str = ""):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm = _share(layer.input_layernorm)
        self.post_norm = _share(layer.post_attention_layernorm)
        self.eps = float(layer.input_layernorm.variance_epsilon)
        qkv, gu = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        if isinstance(attn.q_proj, QuantizedLinear):        # stacked copies; the q/k/v biases: `bqkv` below
            self.wqkv, self.wgu = QuantizedLinear.stack(qkv), QuantizedLinear.stack(gu)
            self.wo, self.wdown = attn.o_proj, mlp.down_proj
        else:
            self.wqkv = _stacked(qkv, buffers, key + "qkv")          # [(Hq + 2 H_kv) D, hidden]
            self.wgu = _stacked(gu, buffers, key + "gate_up")        # [2 I, hidden]
            self.wo = _share(attn.o_proj, buffers, key + "o")        # [hidden, Hq D]
            self.wdown = _share(mlp.down_proj, buffers, key + "down")  # [hidden, I]
        self.bqkv = _stacked(qkv, name="bias") if any(m.bias is not None for m in qkv) else None
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = _share(qn) if qn is not None else None
        self.k_norm = _share(kn) if kn is not None else None
        self.qk_eps = float(qn.variance_epsilon) if qn is not None else 1e-6
        self.scaling = float(attn.scaling)


class _Weights:
    """A model's weights as the fused step reads them, built once per model (a decoder is rebuilt whenever
    a growable CPU pool is reallocated). Weights loaded into the model later (`load_state_dict`) reach them
    in place: the tensors, and the CUDA graphs captured on them, stay valid. `k_major`: the CPU layout's
    K-major buffers by name, `adopted`: those of them taken from `prepared`."""

    def __init__(self, model, prepared: dict[str, torch.Tensor] | None = None):
        k_major = next(model.parameters()).device.type == "cpu"
        buffers = _Buffers(prepared) if k_major else None
        for m in model.modules():  # a copy of a laid-out model (deepcopy) comes with the original's bindings
            if "_lmq_bindings" in vars(m):
                m._lmq_bindings.clear()
        with torch.inference_mode(False), torch.no_grad():  # loads write into these tensors outside inference mode
            self.layers = [LayerWeights(layer, buffers, f"layers.{i}.") for i, layer in enumerate(model.model.layers)]
            embed = model.model.embed_tokens
            self.embed = _share(embed)                      # [V, hidden]
            self.final_norm = _share(model.model.norm)
            head = model.lm_head
            tied = not isinstance(head, QuantizedLinear) and head.weight.data_ptr() == embed.weight.data_ptr()
            if isinstance(head, QuantizedLinear):
                self.lm_head = head
            elif not k_major:
                self.lm_head = self.embed if tied else _share(head)
            elif not tied:
                self.lm_head = _share(head, buffers, "lm_head")
            else:  # a K-major copy of our own: the embedding's row lookups need its rows contiguous
                dest, filled = buffers.k_major("lm_head.tied", tuple(embed.weight.shape), embed.weight)
                self.lm_head = _bind(dest, embed, share=False, also=(head,), filled=filled)
        self.k_major = buffers.made if buffers is not None else {}
        self.adopted = buffers.adopted if buffers is not None else set()
        self.final_eps = float(model.model.norm.variance_epsilon)
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().to(torch.float32).contiguous()


_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_weights(model, prepared: dict[str, torch.Tensor] | None = None) -> _Weights:
    """The model's weights laid out for the fused step (once per model; on the CPU this re-points the model's
    own Linear weights, see `LayerWeights`). They follow the model's `load_state_dict`; other writes to its weights
    reach the fused step where it shares the parameters' storage (everything but the concatenated copies:
    q/k/v and gate/up on a GPU, q/k/v biases, a tied LM head on the CPU). `prepared`: K-major buffers with
    the values the layout would copy into them (`weight_cache.py`'s promise), taken as they are."""
    w = _WEIGHTS.get(model)
    if w is None:
        w = _WEIGHTS[model] = _Weights(model, prepared)
    return w
