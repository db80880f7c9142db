"""What the README says about a model folder of your own, on a real folder written by save_pretrained:
`HFBackend(path, device=, dtype=, cache_budget=)`, `register_backend` + `from "name"`, `from "hf:<dir>"`
and `lmq run --model hf:<dir>`; each gives what transformers alone gives with those weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lmq_backend as lmq
from lmq_backend.backend import registry
from lmq_backend.cli import main

from support.folders import tiny_folder  # noqa: F401 - a fixture

PROMPT = "Once upon a time, in a land far away,"
QUERY = f'"{PROMPT}[X]" where len(TOKENS(X)) < 9'


def hf_greedy(folder, n: int = 8) -> str:
    """transformers alone: the saved model's greedy continuation of PROMPT, n tokens, as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_kernels=False).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert not set(new) & set(tok.all_special_ids)  # (the value would end there)
    return tok.decode(new)


@pytest.fixture(scope="module")
def expected(tiny_folder):  # noqa: F811
    return hf_greedy(tiny_folder)


@pytest.fixture(scope="module")
def folder_backend(tiny_folder):  # noqa: F811
    return lmq.HFBackend(str(tiny_folder), device="cpu", dtype="float32", cache_budget="4GB")


def test_hfbackend_loads_the_folder_as_given(folder_backend, tiny_folder):  # noqa: F811
    model = folder_backend.model
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
    saved = load_file(str(tiny_folder / "model.safetensors"))
    state = model.state_dict()
    assert saved.keys() <= state.keys()
    assert all(torch.equal(state[k], v) for k, v in saved.items())  # the folder's weights, unchanged


def test_the_folder_loads_without_hub_kernels(folder_backend):
    """transformers 5.25 kernelizes every model `from_pretrained` loads (on a GPU: Hub code for RMSNorm, SiLU,
    RoPE; engine/compat.py): lmq's models keep transformers' own ops, their reference."""
    assert getattr(folder_backend.model, "use_kernels", False) is False


async def test_a_query_on_the_folder_is_what_transformers_gives(folder_backend, expected):
    first = await lmq.compile(QUERY, model=folder_backend)()
    again = await lmq.compile(QUERY, model=folder_backend)()  # from the prefix cache
    assert first["X"] == again["X"] == expected
    assert folder_backend.stats().tokens_reused > 0


async def test_cache_budget_zero_turns_reuse_off(tiny_folder, expected):  # noqa: F811
    backend = lmq.HFBackend(tiny_folder, device="cpu", dtype="float32", cache_budget=0)
    for _ in range(2):
        assert (await lmq.compile(QUERY, model=backend)())["X"] == expected
    s = backend.stats()
    assert s.tokens_reused == 0 and s.tokens_prefilled == s.tokens_requested > 0 and s.nodes == 0


async def test_register_backend_and_from_hf_dir(folder_backend, tiny_folder, expected):  # noqa: F811
    lmq.register_backend("my-model", folder_backend)
    try:
        r = await lmq.compile(QUERY + '\nfrom "my-model"')()
        assert r["X"] == expected
    finally:
        registry._REGISTRY.pop("my-model", None)
    name = f"hf:{tiny_folder}"
    try:
        r = await lmq.compile(QUERY + f'\nfrom "{name}"')()
        assert r["X"] == expected
        backend = lmq.get_backend(name)
        assert backend is not folder_backend and backend.stats().calls == 1  # loaded from the folder once
    finally:
        registry._REGISTRY.pop(name, None)


def test_cli_model_option_overrides_from(tiny_folder, expected, tmp_path, capsys):  # noqa: F811
    """`lmq run --model hf:<dir>` runs a query written `from "default"` on the folder instead."""
    query = tmp_path / "q.lmq"
    query.write_text(f'argmax\n    {QUERY}\nfrom "default"\n')
    name = f"hf:{tiny_folder}"
    try:
        assert main(["run", str(query), "--model", name, "--json"]) == 0
        [result] = json.loads(capsys.readouterr().out)
        assert result["variables"] == {"X": expected} and result["prompt"] == PROMPT + expected
        assert lmq.get_backend(name).stats().calls == 1
    finally:
        registry._REGISTRY.pop(name, None)
