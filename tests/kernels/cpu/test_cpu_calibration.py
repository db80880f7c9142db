"""The calibration that picks lmq's C kernel or torch's per op and shape class (`lmq_kernels.cpu.calibration`,
`cpu.choose`): it keeps the faster of the two as measured, caches the choice next to the library, never
trusts a corrupt, stale or forged file, obeys LMQ_CPU_KERNELS (0: torch, 1: lmq's kernels, auto: measured),
and whatever it chooses an engine query gives the same greedy tokens."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest
import torch

from lmq_kernels import cpu
from lmq_kernels.cpu import library
from lmq_kernels.cpu.calibration import Calibration


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The load average as on an idle machine (this shared one's would mark every choice unsettled)."""
    monkeypatch.setattr("lmq_kernels.cpu.calibration._load_average", lambda: 0.0)


def spin(seconds: float):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench(lmq_s: float, torch_s: float, calls: list | None = None):
    """A bench whose lmq side takes lmq_s and torch side torch_s; records that it was asked for."""
    def make():
        if calls is not None:
            calls.append(1)
        return (lambda: spin(lmq_s), lambda: spin(torch_s))
    return make


def test_keeps_the_faster_and_caches_it(tmp_path):
    path = tmp_path / "cal.json"
    cal = Calibration(path, key="k1")
    calls = []
    assert cal.choose("op", (2, 8), bench(0.0002, 0.002, calls), measure=True)        # lmq 10x faster: lmq
    assert not cal.choose("op", (2, 16), bench(0.002, 0.0002, calls), measure=True)   # torch 10x faster: torch
    assert not cal.choose("op", (2, 32), bench(0.001, 0.001, calls), measure=True)    # a tie: torch (the margin)
    assert len(calls) == 3
    assert cal.choose("op", (2, 8), bench(1, 1, calls)) and len(calls) == 3   # cached: not measured again
    data = json.loads(path.read_text())
    assert data["key"] == "k1" and data["torch"] == torch.__version__
    assert {name: e["use"] for name, e in data["choices"].items()} == {
        "op/2/8": "lmq", "op/2/16": "torch", "op/2/32": "torch"}
    again = Calibration(path, key="k1")                                    # another process: from the file
    assert again.choose("op", (2, 8), bench(1, 1, calls)) and not again.choose("op", (2, 16), bench(1, 1, calls))
    assert len(calls) == 3
    assert again.choices() == cal.choices()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "other torch", "other version",
                                    "forged choice", "bad timing", "not a dict"])
def test_a_corrupt_or_stale_file_is_measured_again(tmp_path, damage, caplog):
    path = tmp_path / "cal.json"
    Calibration(path, key="k1").choose("op", (1,), bench(0.002, 0.0002))    # torch, stored
    data = json.loads(path.read_text())
    entry = data["choices"]["op/1"]
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:-10])
    else:
        if damage == "other key":
            data["key"] = "k0"
        elif damage == "other torch":
            data["torch"] = "0.0"
        elif damage == "other version":
            data["version"] = 0
        elif damage == "forged choice":   # says lmq against its own timings
            entry["use"] = "lmq"
        elif damage == "bad timing":
            entry["lmq_us"] = -1
        else:
            data["choices"]["op/1"] = "lmq"
        path.write_text(json.dumps(data))
    calls = []
    with caplog.at_level(logging.WARNING, logger="lmq_kernels.cpu"):
        cal = Calibration(path, key="k1")
    assert any("not trusted" in r.getMessage() for r in caplog.records)
    assert not cal.choose("op", (1,), bench(0.002, 0.0002, calls)) and calls == [1]   # measured again
    assert json.loads(path.read_text())["choices"]["op/1"]["use"] == "torch"        # and rewritten
    assert json.loads(path.read_text())["key"] == "k1"


def test_the_file_is_keyed_like_the_library(tmp_path):
    """A calibration for another build (CPU, sources, flags, compiler: another key) is not reused."""
    path = tmp_path / "cal.json"
    Calibration(path, key="k1").choose("op", (1,), bench(0.0002, 0.002))
    calls = []
    assert not Calibration(path, key="k2").choose("op", (1,), bench(0.002, 0.0002, calls)) and calls


def test_a_choice_made_on_a_busy_machine_is_used_and_measured_again_by_a_quiet_warm_up(tmp_path, monkeypatch):
    """An entry whose timings never settled (`stable` false) serves later processes as it is; a warm-up
    (`measure`) measures it again, once the machine is quiet, and keeps the settled result."""
    path = tmp_path / "cal.json"
    data = {"version": 1, "key": "k", "torch": torch.__version__,
            "choices": {"op/1": {"use": "lmq", "lmq_us": 10.0, "torch_us": 90.0, "rounds": 9, "stable": False}}}
    path.write_text(json.dumps(data))
    calls = []
    assert Calibration(path, "k").choose("op", (1,), bench(0.002, 0.0002, calls)) and calls == []
    monkeypatch.setattr("lmq_kernels.cpu.calibration._load_average", lambda: 2.0 * (os.cpu_count() or 1) + 1)
    assert Calibration(path, "k").choose("op", (1,), bench(0.002, 0.0002, calls), measure=True) and calls == []
    monkeypatch.setattr("lmq_kernels.cpu.calibration._load_average", lambda: 0.0)
    cal = Calibration(path, "k")
    assert cal.choose("op", (1,), bench(1, 1), measure=False)          # a query's call: the entry, unmeasured
    assert not cal.choose("op", (1,), bench(0.002, 0.0002, calls), measure=True) and calls == [1]
    assert json.loads(path.read_text())["choices"]["op/1"]["stable"] is True
    assert not cal.choose("op", (1,), bench(1, 1), measure=True)       # settled: not measured again


def test_a_query_takes_the_nearest_measured_classs_choice(tmp_path):
    """A class first met by a query's call is not measured: it takes the choice of the nearest measured class
    of its op and thread count (sizes compared on a log scale), held in memory only; an op with no measured
    class at all is measured (so that there is one); a warm-up measures the class."""
    path = tmp_path / "cal.json"
    cal = Calibration(path, "k")
    calls = []
    assert cal.choose("op", (2, 8, 64), bench(0.0002, 0.002, calls)) and calls == [1]   # no class yet: measured
    assert not cal.choose("op", (2, 256, 64), bench(0.002, 0.0002, calls), measure=True) and len(calls) == 2
    assert cal.choose("op", (2, 16, 64), bench(1, 1, calls))            # 8 is nearer than 256: lmq
    assert not cal.choose("op", (2, 128, 64), bench(1, 1, calls))       # 256 is nearer: torch
    assert cal.choose("op", (4, 8, 64), bench(0.0002, 0.002, calls)) and len(calls) == 3   # other threads: measured
    assert len(calls) == 3 and cal.guesses() == {"op/2/16/64": "op/2/8/64", "op/2/128/64": "op/2/256/64"}
    assert set(json.loads(path.read_text())["choices"]) == {"op/2/8/64", "op/2/256/64", "op/4/8/64"}
    assert not cal.choose("op", (2, 16, 64), bench(0.002, 0.0002, calls), measure=True) and len(calls) == 4
    assert "op/2/16/64" not in cal.guesses() and "op/2/16/64" in json.loads(path.read_text())["choices"]


def test_a_choice_made_while_others_kept_every_cpu_busy_is_not_kept(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setattr("lmq_kernels.cpu.calibration._load_average", lambda: 2.0 * (os.cpu_count() or 1) + 1)
    calls = []
    assert Calibration(path, "k").choose("op", (1,), bench(0.0002, 0.002, calls))
    assert json.loads(path.read_text())["choices"]["op/1"]["stable"] is False
    monkeypatch.setattr("lmq_kernels.cpu.calibration._load_average", lambda: 0.0)
    assert Calibration(path, "k").choose("op", (1,), bench(0.0002, 0.002, calls), measure=True) and len(calls) == 2


def test_writes_merge_with_other_processes(tmp_path):
    path = tmp_path / "cal.json"
    a, b = Calibration(path, "k"), Calibration(path, "k")
    a.choose("op", (1,), bench(0.0002, 0.002))
    b.choose("op", (2,), bench(0.002, 0.0002))
    assert set(json.loads(path.read_text())["choices"]) == {"op/1", "op/2"}


def test_a_bench_that_fails_means_torch_unrecorded(tmp_path):
    def broken():
        raise MemoryError("no room for the ring")
    cal = Calibration(tmp_path / "cal.json", "k")
    assert not cal.choose("op", (1,), broken)
    assert "op/1" not in cal.choices()


def test_measurement_stays_short(tmp_path):
    """A class whose calls take 50 ms each is decided in a few rounds (counted, not timed: each call spins
    at least 50 ms, so at most 8 calls a side is well under a second of measuring on any machine)."""
    cal = Calibration(tmp_path / "cal.json", "k")
    calls = {"lmq": 0, "torch": 0}

    def make():
        def side(name):
            def call():
                calls[name] += 1
                spin(0.05)
            return call
        return side("lmq"), side("torch")

    cal.choose("op", (1,), make)
    assert 1 <= cal.choices()["op/1"]["rounds"] <= 7
    assert 2 <= calls["lmq"] <= 8 and 2 <= calls["torch"] <= 8, calls  # a warm-up call, then the rounds


def test_long_calls_far_apart_are_decided_in_two_rounds(tmp_path):
    """Calls of >= 20 ms whose best times are 2x apart after two rounds settle the choice (a settled one: kept
    in the file); shorter calls, or close ones, run the usual rounds whatever the ratio."""
    from lmq_kernels.cpu.calibration import MIN_ROUNDS

    cal = Calibration(tmp_path / "cal.json", "k")
    assert cal.choose("op", ("far",), bench(0.025, 0.075))
    assert not cal.choose("op", ("far, torch",), bench(0.075, 0.025))
    assert cal.choose("op", ("close",), bench(0.003, 0.004))
    assert cal.choose("op", ("short",), bench(0.002, 0.006))
    got = cal.choices()
    assert got["op/far"]["rounds"] == 2 and got["op/far"]["stable"]
    assert got["op/far, torch"]["rounds"] == 2 and got["op/far, torch"]["use"] == "torch"
    assert got["op/close"]["rounds"] >= MIN_ROUNDS and got["op/short"]["rounds"] >= MIN_ROUNDS


def test_a_short_call_stalled_in_its_first_rounds_is_measured_on(tmp_path):
    """A neighbour's stall in both of lmq's first two rounds of a ~1 ms call (each call 5 ms) does not settle
    the choice for torch: the rounds go on, and lmq's later calls at 1 ms win it."""
    cal = Calibration(tmp_path / "cal.json", "k")
    lmq_calls = []

    def make():
        def run_lmq():
            lmq_calls.append(1)
            spin(0.005 if len(lmq_calls) <= 3 else 0.001)   # the warm-up call and two rounds stalled
        return run_lmq, lambda: spin(0.002)

    assert cal.choose("op", ("stalled",), make)
    assert cal.choices()["op/stalled"]["rounds"] > 2


# ------------------------------------------------------------------------------------- through the ops

@pytest.fixture
def calibrated(monkeypatch, tmp_path):
    """cpu's functions calibrated into a fresh file (LMQ_CPU_KERNELS=auto); returns its Calibration."""
    assert cpu.available(), cpu.build_error()
    cal = Calibration(tmp_path / "cal.json", "test")
    monkeypatch.setattr(library, "_calibration", cal)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "auto")
    return cal


def k_major(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k).t().contiguous().t()


@pytest.mark.cpu_kernels
def test_ops_follow_the_choice(calibrated, monkeypatch):
    """Where torch was measured faster the op declines (out untouched) and the caller runs torch; where lmq
    was, it runs; LMQ_CPU_KERNELS=1 runs it whatever was measured, =0 never."""
    w, x = k_major(96, 64), torch.randn(4, 64)
    name = f"gemm/{torch.get_num_threads()}/4/64/128"
    calibrated._entries[name] = {"use": "torch", "lmq_us": 20.0, "torch_us": 10.0}
    out = torch.zeros(4, 96)
    assert not cpu.small_m_mm(x, w.t(), out) and out.eq(0).all()
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert cpu.small_m_mm(x, w.t(), out)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "0")
    assert not cpu.available() and not cpu.small_m_mm(x, w.t(), out)
    monkeypatch.setenv("LMQ_CPU_KERNELS", "auto")
    calibrated._entries[f"gemm/{torch.get_num_threads()}/2/64/128"] = {"use": "lmq", "lmq_us": 10.0, "torch_us": 20.0}
    assert cpu.small_m_mm(x[:2], w.t(), out[:2])


@pytest.mark.cpu_kernels
def test_every_op_is_calibrated_on_first_use(calibrated):
    """The GEMM, RMSNorm and SiLU-mul measure themselves against torch on their first call of a class (a
    real measurement, each side timed) and give torch's result either way."""
    w, x = k_major(192, 576), torch.randn(3, 576)
    out = torch.empty(3, 192)
    if not cpu.small_m_mm(x, w.t(), out):
        torch.mm(x, w.t(), out=out)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)
    h = torch.empty(3, 576)
    if not cpu.rmsnorm(x, torch.ones(576), 1e-5, h):
        h.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    gu, act = torch.randn(3, 400), torch.empty(3, 200)
    if not cpu.silu_mul(gu, act):
        act.copy_(torch.nn.functional.silu(gu[:, :200]) * gu[:, 200:])
    torch.testing.assert_close(act, torch.nn.functional.silu(gu[:, :200]) * gu[:, 200:], atol=1e-6, rtol=1e-5)
    t = torch.get_num_threads()
    made = calibrated.choices()
    assert {f"gemm/{t}/4/1024/256", f"rmsnorm/{t}/4/1024", f"silu_mul/{t}/4/256"} <= set(made)
    assert all(e["lmq_us"] > 0 and e["torch_us"] > 0 for e in made.values())
    assert json.loads(calibrated.path.read_text())["choices"] == made


@pytest.mark.cpu_kernels
def test_the_prefill_attention_class_follows_the_rows_not_the_end_column(calibrated):
    """The pool's end column moves on with every decode step: the same rows further right are the same class
    (one measurement, not one per end column a long-running process reaches)."""
    t = torch.get_num_threads()
    hq, hkv, d, b, n, cached = 9, 3, 64, 2, 5, 40
    k, v = torch.randn(6000, hkv, d), torch.randn(6000, hkv, d)
    for end in (60, 700, 5000):
        table = torch.randint(1, 6000, (b, end + 2), dtype=torch.int32)
        start = torch.full((b,), end - cached - n, dtype=torch.int32)
        q, out = torch.randn(b, n, hq, d), torch.empty(b, n, hq, d)
        cpu.prefill_attention(q, k, v, table, start, torch.full((b,), n, dtype=torch.int32), end, out, 0.125)
    made = [name for name in calibrated.choices() if name.startswith("prefill_attention/")]
    assert made == [f"prefill_attention/{t}/2/8/{hq}/{hkv}/{d}/64"], made


def test_modes(monkeypatch):
    for value, want in (("0", "0"), ("1", "1"), ("auto", "auto"), ("", "auto"), ("yes", "auto")):
        monkeypatch.setenv("LMQ_CPU_KERNELS", value)
        assert cpu.mode() == want
    monkeypatch.delenv("LMQ_CPU_KERNELS")
    assert cpu.mode() == "auto"
    monkeypatch.setenv("LMQ_CPU_KERNELS", "1")
    assert cpu.choose("anything", (1,), lambda: pytest.fail("no measurement when forced"))


# -------------------------------------------------------------------------------- an engine query, both ways

SRC = '''
"Some shared text to start with, {x}[A]" where len(TOKENS(A)) < 10
" and then[B]" where B in [" yes", " no"]
"{x} more[C]" where len(TOKENS(C)) < 12
'''


def head_dim_64_llama():
    """A tiny GQA Llama with head dim 64, so that lmq's C attention (64/128/256) serves its batched steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("model", ["tiny_llama", "head_dim_64"])
def test_both_choices_give_the_same_greedy_tokens(model, tokenizer, monkeypatch):
    """Whole engine queries (alone and 5 at once) with lmq's kernels forced on (LMQ_CPU_KERNELS=1) and forced
    off (0), the two ends of what calibration may choose: the same greedy tokens. The C kernels did run."""
    import lmq_backend as lmq
    from support.tiny import tiny_llama

    net = tiny_llama(seed=5) if model == "tiny_llama" else head_dim_64_llama()
    ran: dict[str, int] = {}
    for op in ("small_m_mm", "attention", "prefill_attention", "rmsnorm", "silu_mul", "rope_append"):
        real = getattr(cpu, op)

        def counted(*args, _real=real, _op=op, **kwargs):
            done = _real(*args, **kwargs)
            ran[_op] = ran.get(_op, 0) + bool(done)
            return done

        monkeypatch.setattr(cpu, op, counted)

    async def run(n):
        backend = lmq.HFBackend.from_model(net, tokenizer, name=f"calib-{model}")
        q = lmq.Query(SRC, model=backend)
        return [r.variables for r in await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))]

    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("LMQ_CPU_KERNELS", setting)
        ran.clear()
        results[setting] = (asyncio.run(run(1)), asyncio.run(run(5)))
        if setting == "1":
            assert ran.get("small_m_mm") and ran.get("rmsnorm") and ran.get("rope_append"), ran
            if model == "head_dim_64":
                assert ran.get("attention") and ran.get("prefill_attention"), ran
        else:
            assert not any(ran.values()), ran
    assert results["1"] == results["0"]
    assert results["1"][0][0] == results["1"][1][0]   # and alone as batched


# ------------------------------------------------------------------------------------------------- warm-up

@pytest.mark.cpu_kernels
def test_a_warm_up_measures_a_models_classes_once(calibrated):
    """`warm_up` measures the classes of a model shape's decode steps and prefills this machine has not
    measured; again, nothing. A call of a class between the grid's then takes a neighbour's choice."""
    shape = cpu.ModelShape(hidden=64, inter=128, hq=2, hkv=1, d=64, vocab=512)
    made = cpu.warm_up(shape, rows=4)
    t = torch.get_num_threads()
    names = set(calibrated.choices())
    assert made == len(names) > 0
    assert {f"gemm_panels/{t}/4/64/256", f"rmsnorm/{t}/1024/64", f"attention/{t}/2/2/1/64/2048",
            f"masked_argmax/{t}/4/512/1", f"prefill_attention/{t}/16/32/2/1/64/2048"} <= names, sorted(names)
    assert cpu.warm_up(shape, rows=4) == 0
    out = torch.empty(8, 256)
    cpu.small_m_mm(torch.randn(8, 64), torch.randn(64, 256), out, panels=torch.randn(4, 64, 64))
    assert set(calibrated.choices()) == names and f"gemm_panels/{t}/8/64/256" in cpu.guesses()


@pytest.mark.cpu_kernels
def test_a_backend_measures_its_classes_when_made_and_its_queries_none(calibrated, tokenizer):
    """A CPU backend measures its model's classes when it is made (the per-op kernels' and the C step's);
    its queries, alone and at once, measure none (each class they meet unmeasured takes a neighbour's
    choice), and a second backend of the model measures nothing."""
    import lmq_backend as lmq
    from lmq_backend.engine.fused.cpu_warm_up import warm_up

    net = head_dim_64_llama()
    backend = lmq.HFBackend.from_model(net, tokenizer, name="warm-up")
    made = set(calibrated.choices())
    assert any(n.startswith("decode_layers/") for n in made) and any(n.startswith("gemm_panels/") for n in made)
    q = lmq.Query(SRC, model=backend)

    async def run(n):
        return await asyncio.gather(*(q.run({"x": "word " * i}) for i in range(n)))

    for n in (1, 5, 12):
        asyncio.run(run(n))
    assert set(calibrated.choices()) == made
    assert warm_up(net) == 0


@pytest.mark.cpu_kernels
def test_a_quantized_models_warm_up_measures_its_quantized_gemms(calibrated):
    """int4 layers and an int8 LM head: the quantized GEMM's classes (up to 16 rows a call; past 64 rows the
    weight's panels in the float32 GEMM), not the float32 GEMM's of the same rows."""
    shape = cpu.ModelShape(hidden=64, inter=128, hq=2, hkv=1, d=64, vocab=512, weights="int4", head="int8",
                           panels=False, head_panels=False)
    cpu.warm_up(shape, rows=32)
    t = torch.get_num_threads()
    names = set(calibrated.choices())
    assert {f"qgemm_i4/{t}/16/64/256", f"qgemm_i4/{t}/1/64/256", f"qgemm_i8/{t}/16/64/512",
            f"gemm_panels/{t}/256/64/256"} <= names, sorted(names)
    assert not any(n.startswith(f"gemm_panels/{t}/32/") or n.startswith(f"gemm/{t}/") for n in names), sorted(names)
