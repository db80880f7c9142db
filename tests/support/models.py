"""Context-sensitive test models on the default tokenizer's vocabulary, and an independent reference for them.

The models have random weights shaped so that the greedy continuation depends on the whole context:
- token embeddings small next to what attention writes into the residual stream, so the next token is not
  a bigram lookup of the current one (the conftest models are: they keep their greedy token in most cases
  when a context token is dropped);
- half the query heads sharp (large q/k projections): every score depends on the RoPE'd relative position,
  so a wrong K column or a position id off by one changes what a query attends to; the other half soft:
  they weigh every column, so a column too many or too few shows (Qwen3, whose q/k norms fix the scale of q
  and k, gets a soft first layer and a sharp second one through the norms' gains).
Llama-family models have hidden 256, 4 query heads over 2 kv heads (GQA), head_dim 64 (lmq's C attention
kernel takes 64/128/256), 2 layers. No training: building one takes a fraction of a second. Their measured
sensitivity is a test (tests/backend/test_fault_injection.py).

The reference side never touches lmq: a second instance loaded from a copy of the `state_dict` taken
before lmq sees the model (`HFBackend.from_model` re-routes the model's attention through lmq's function and,
on the CPU, re-points its Linear weights), with transformers' own sdpa attention, run by a plain forward
loop that recomputes the whole context at every token (no KV cache at all). `Script` describes a query
once, so that the same description gives lmq's source and the reference's token ids.
"""
from __future__ import annotations

import asyncio
import contextvars
import copy
import json
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")  # the fused decode step serves these
VOCAB = 49152  # the default model's tokenizer

# std of the weights (see the module docstring); 1/16 = 1/sqrt(hidden). The first half of the query heads
# are sharp (QK_STD), the others soft (SOFT_QK_STD: they weigh many columns, so an extra or a missing one
# shows); Qwen3's q/k norms fix the scale of q and k, so there the norm gains set it per layer.
EMBED_STD, QK_STD, SOFT_QK_STD, VO_STD, MLP_STD, QKV_BIAS_STD = 0.02, 4 / 16, 0.25 / 16, 1 / 16, 1 / 16, 0.5
QK_NORM_GAINS = (1.0, 3.0)  # per layer: soft, then sharp


def _config(family: str):
    llama = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                 bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(**llama, tie_word_embeddings=False)
    if family == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**llama, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norms, tied embeddings
        return Qwen3Config(**llama, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**llama, sliding_window=None, tie_word_embeddings=False)
    if family == "gpt2":  # learned absolute positions, fused qkv (Conv1D), no fused decode step in lmq
        return GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=4, n_positions=4096,
                          bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


@torch.no_grad()
def _shape_weights(model) -> None:
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.fill_(QK_NORM_GAINS[int(name.split("layers.")[1].split(".")[0])])
        elif p.dim() == 1 and any(s in name for s in ("q_proj", "k_proj", "v_proj")):
            p.normal_(0, QKV_BIAS_STD)
        elif p.dim() < 2:
            continue
        elif any(s in name for s in ("q_proj", "k_proj", "attn.c_attn")):
            p.normal_(0, QK_STD)
        elif any(s in name for s in ("v_proj", "o_proj", "attn.c_proj")):
            p.normal_(0, VO_STD)
        elif any(s in name for s in ("embed_tokens", "lm_head", "wte", "wpe")):
            p.normal_(0, EMBED_STD)
        elif "mlp" in name:
            p.normal_(0, MLP_STD)
        if name.endswith("q_proj.weight"):  # [Hq D, hidden]: the second half of the heads soft
            p[p.shape[0] // 2:] *= SOFT_QK_STD / QK_STD
        elif name.endswith("attn.c_attn.weight"):  # GPT-2's Conv1D [hidden, 3 hidden]: q is the first third
            hidden = p.shape[0]
            p[:, hidden // 2: hidden] *= SOFT_QK_STD / QK_STD
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def build(family: str, seed: int = 0):
    """A fresh context-sensitive model of `family` (float32, eval, transformers' sdpa attention)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa", dtype=torch.float32)
    _shape_weights(model)
    return model.eval()


class Zoo:
    """Per family, built on first use: the weights (a `state_dict` copied once, before lmq sees any model),
    the instance lmq's backends wrap (shared by the whole test run), and reference instances that lmq never sees."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, tuple] = {}
        self._engine: dict[str, torch.nn.Module] = {}
        self._reference: dict[str, torch.nn.Module] = {}
        self.memo: dict = {}  # reference results, keyed by the caller (they are the same in every test)

    def state(self, family: str) -> tuple:
        if family not in self._states:
            model = build(family, seed=FAMILIES.index(family))
            self._states[family] = (copy.deepcopy(model.config),
                                    {k: v.detach().clone() for k, v in model.state_dict().items()})
        return self._states[family]

    def fresh(self, family: str):
        """A new instance with the family's weights and transformers' sdpa attention."""
        config, state = self.state(family)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                 dtype=torch.float32)
        model.load_state_dict(state)
        return model.eval()

    def reference(self, family: str):
        """The test run's reference instance of `family`: never passed to lmq."""
        if family not in self._reference:
            self._reference[family] = self.fresh(family)
        return self._reference[family]

    def backend(self, family: str, cache_budget="64MB", fused: bool | None = None):
        """An HFBackend over the test run's engine instance of `family` (the same instance for every backend,
        as a user would share one model). `fused=False` sends decode steps through the model's forward."""
        from lmq_backend.backend.hf import HFBackend

        if family not in self._engine:
            self._engine[family] = self.fresh(family)
        backend = HFBackend.from_model(self._engine[family], self.tokenizer, cache_budget=cache_budget,
                                       name=f"sharp-{family}")
        if fused is not None:
            backend.runner.fused = fused
        return backend


_ZOOS: dict[int, Zoo] = {}   # one zoo a tokenizer (the test run has one), built once


@pytest.fixture(scope="module")
def zoo(tokenizer) -> Zoo:
    if id(tokenizer) not in _ZOOS:
        _ZOOS[id(tokenizer)] = Zoo(tokenizer)
    return _ZOOS[id(tokenizer)]


# ----------------------------------------------------------------------------------------- the reference

@torch.no_grad()
def next_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's float32 logits after `ids`: one forward over the whole context, no cache."""
    return model(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()


def greedy(model, ids: list[int], max_new: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """Up to `max_new` greedy tokens after `ids`, ending before the first token in `stop`."""
    out: list[int] = []
    for _ in range(max_new):
        token = int(next_logits(model, ids + out).argmax())
        if token in stop:
            break
        out.append(token)
    return out


@torch.no_grad()
def generate(model, ids: list[int], max_new: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """`greedy` through the model's own `generate(do_sample=False)` (with its KV cache: for larger models)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop),
                         pad_token_id=sorted(stop)[0])[0, len(ids):].tolist()
    return next((out[:k] for k, t in enumerate(out) if t in stop), out)


@torch.no_grad()
def token_log_probs(model, ids: list[int], continuation: list[int]) -> list[float]:
    """log P(continuation[i] | ids + continuation[:i]) for each i, from one forward."""
    n = len(continuation)
    logits = model(torch.tensor([ids + continuation]), use_cache=False, logits_to_keep=n + 1).logits[0, :n]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[torch.arange(len(continuation)), torch.tensor(continuation)].tolist()


def special_ids(tokenizer) -> frozenset[int]:
    """Tokens that can never be part of a value: a free hole ends when the greedy pick is one of them."""
    return frozenset(tokenizer.all_special_ids) | frozenset(tokenizer.added_tokens_decoder)


@dataclass(frozen=True)
class Script:
    """A query as steps: ("text", template) with `{name}` inputs, ("hole", name, max_tokens) a free hole,
    ("dist", name, options) the final `distribution` clause. `source()` is the lmq query, `reference()`
    replays it on an HF model the way lmq tokenizes (the text up to each hole as one segment, a hole's
    tokens as they were picked, the chosen option as its own segment)."""

    steps: tuple

    def source(self) -> str:
        lines, text, tail = [], "", ""
        for step in self.steps:
            if step[0] == "text":
                text += step[1]
            elif step[0] == "hole":
                lines.append(f"{json.dumps(text)[:-1]}[{step[1]}]\" where len(TOKENS({step[1]})) < {step[2] + 1}")
                text = ""
            else:
                lines.append(f"{json.dumps(text)[:-1]}[{step[1]}]\"")
                text, tail = "", f"distribution {step[1]} in {json.dumps(list(step[2]))}"
        if text:
            lines.append(json.dumps(text))
        return "\n".join(lines + [tail])

    def reference(self, model, tokenizer, inputs: dict, fill=greedy) -> tuple[list[int], dict | None]:
        """(the final token ids, the distribution as {option: log-probability normalised over options});
        `fill(model, ids, max_tokens, stop)` picks a hole's tokens."""
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        # lmq's segments are then plain encodes (no start tokens, no SentencePiece leading space)
        assert tokenizer("a b").input_ids == encode("a b") == encode("a") + encode(" b")
        ids, text, dist, stop = [], "", None, special_ids(tokenizer)
        for step in self.steps:
            if step[0] == "text":
                text += step[1].format(**inputs)
                continue
            ids += encode(text) if text else []
            text = ""
            if step[0] == "hole":
                ids += fill(model, ids, step[2], stop)
            else:
                sums = [sum(token_log_probs(model, ids, encode(o))) for o in step[2]]
                norm = torch.log_softmax(torch.tensor(sums, dtype=torch.float64), 0).tolist()
                dist = dict(zip(step[2], norm))
                ids += encode(max(step[2], key=dist.get))
        return ids + (encode(text) if text else []), dist


# ------------------------------------------------------------------------------------------ the engine

_CALL: contextvars.ContextVar = contextvars.ContextVar("lmq_test_call")


async def run_engine(backend, script: Script, calls: list[dict], batched: bool, seed: int = 0,
                     decoder: str | None = None) -> list[tuple]:
    """Run `script` on an lmq backend for each input dict: one after another, or all at once with random
    arrival (each call waits 0-12 event-loop turns first); `decoder` as `lmq.Query` takes it (None: argmax).
    Returns per call (the token ids lmq ran on, read from the query's Sequence when it is released, and the
    distribution as log-probabilities or None)."""
    import lmq_backend as lmq

    seen: dict[int, list[int]] = {}
    release = backend.release

    def spy(seq):
        seen[_CALL.get()] = list(seq.ids)
        release(seq)

    backend.release = spy
    query = lmq.Query(script.source(), model=backend, decoder=decoder)
    rng = random.Random(seed)

    async def call(i: int):
        _CALL.set(i)
        if batched:
            for _ in range(rng.randint(0, 12)):
                await asyncio.sleep(0)
        r = await query.run(calls[i])
        dist = None if r.distribution is None else {o: float(torch.tensor(p, dtype=torch.float64).log())
                                                    for o, p in r.distribution.items()}
        return seen[i], dist

    try:
        if batched:
            return list(await asyncio.gather(*(call(i) for i in range(len(calls)))))
        return [await call(i) for i in range(len(calls))]
    finally:
        del backend.release


def differences(got: list[tuple], want: list[tuple], tol: float = 1e-4) -> list[str]:
    """Where lmq's calls differ from the reference's: token ids not equal, or a distribution's
    log-probabilities further apart than `tol`."""
    out = []
    for i, ((ids, dist), (ref_ids, ref_dist)) in enumerate(zip(got, want, strict=True)):
        if ids != ref_ids:
            k = next((k for k, (x, y) in enumerate(zip(ids, ref_ids)) if x != y), min(len(ids), len(ref_ids)))
            out.append(f"call {i}: token {k} of {len(ref_ids)}: lmq {ids[k:k + 4]}, reference {ref_ids[k:k + 4]}")
        elif (dist is None) != (ref_dist is None) or (dist and (dist.keys() != ref_dist.keys() or any(
                abs(dist[o] - ref_dist[o]) > tol for o in dist))):
            out.append(f"call {i}: distribution lmq {dist}, reference {ref_dist}")
    return out


# ------------------------------------------------------------------------------ the standard comparison

SCRIPT = Script((("text", "{shots}Input: {x}\nOutput:"), ("hole", "A", 8), ("text", "\nAgain{y}:"), ("hole", "B", 6),
                 ("text", " Verdict:"), ("dist", "C", (" yes", " no", " maybe so"))))
_WORDS = ["alpha", "river", "stone", "cloud", "seven", "green", "table", "quiet", "north", "apple", "lamp",
          "Review", "é", "42", "!", "of the", "matrix", "orbit"]


def standard_calls(seed: int = 0) -> list[dict]:
    """Seven calls of SCRIPT: a shared few-shot prefix (~90 tokens, so the trie hits), one call whose
    prefix shares only its first half, one call repeated (its prompt is then cached but for its last token)."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
    shots = "".join(f"Input: {words(3)}\nOutput: {words(2)}\n\n" for _ in range(6))
    other = shots[: len(shots) // 2] + f"Input: {words(4)}\nOutput: {words(1)}\n\n"
    calls = [dict(shots=shots, x=words(rng.randint(1, 4)), y=" " + words(rng.randint(0, 2))) for _ in range(5)]
    calls.append(dict(shots=other, x=words(2), y=""))
    calls.append(dict(calls[1]))
    return calls


def expected(zoo: Zoo, family: str) -> list[tuple]:
    """The reference's (ids, distribution) of `standard_calls()` on `family`, computed once a test run."""
    key = ("standard", family)
    if key not in zoo.memo:
        model = zoo.reference(family)
        zoo.memo[key] = [SCRIPT.reference(model, zoo.tokenizer, c) for c in standard_calls()]
    return zoo.memo[key]
