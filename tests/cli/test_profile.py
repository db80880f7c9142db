"""Cache hit-rate profiling: the counters against hand-computed values, per-template sums, reset, the
JSON/table/plot of `lmq profile`, the step log, and bad inputs files."""
from __future__ import annotations

import io
import json
import re

import pytest

import lmq_backend as lmq
from lmq_backend.backend import protocol, registry
from lmq_backend.cache import stats as stats_module
from lmq_backend.cache.stats import CacheStats, StepInfo, TemplateStats, format_table, percentile
from lmq_backend.cli import main
from lmq_backend.profile import format_step, log_steps, profile_query, query_inputs, read_inputs

SRC = '"{shots}Review: {review}\\nSentiment:[CLS]" where CLS in [" positive", " negative"]'
SHOTS = "Review: fine.\nSentiment: positive\n\n" * 8
COUNTERS = ("calls", "lookups", "hits", "tokens_requested", "tokens_reused", "tokens_prefilled", "tokens_decoded")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def prompt_tokens(backend, text: str) -> int:
    """Tokens of a prompt that is one segment: the tokenizer's start tokens and the text."""
    return len(backend.sequence("t").ids) + len(backend.vocab.encode(text))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def counters(s) -> tuple:
    return (s.lookups, s.hits, s.tokens_requested, s.tokens_reused, s.tokens_prefilled)


# ----- the counters -----------------------------------------------------------------------------------

async def test_counters_match_hand_computed_values(make_backend):
    backend = make_backend("llama")
    q = lmq.compile(SRC, model=backend, name="cls")
    text1 = SHOTS + "Review: great\nSentiment:"
    text3 = SHOTS + "Review: awful, cold and slow\nSentiment:"
    n1, n3 = prompt_tokens(backend, text1), prompt_tokens(backend, text3)
    start = backend.sequence("t").ids

    await q(shots=SHOTS, review="great")
    assert counters(backend.stats()) == (1, 0, n1, 0, n1)  # a cold cache computes every prompt token

    await q(shots=SHOTS, review="great")
    s = backend.stats()
    # the identical call reuses every prompt token but the last (its logits pick the next token)
    assert counters(s) == (2, 1, 2 * n1, n1 - 1, n1 + 1)
    assert s.token_hit_rate == pytest.approx((n1 - 1) / (2 * n1))

    await q(shots=SHOTS, review="awful, cold and slow")
    s = backend.stats()
    shared = common_prefix(start + backend.vocab.encode(text1), start + backend.vocab.encode(text3))
    assert shared > len(backend.vocab.encode(SHOTS)) - 2  # the few-shot block is served from the trie
    assert counters(s) == (3, 2, 2 * n1 + n3, n1 - 1 + shared, n1 + 1 + n3 - shared)

    t = s.per_template["cls"]
    assert t.calls == 3 and len(t.latencies) == 3 and all(x > 0 for x in t.latencies)
    assert counters(t) == counters(s) and t.tokens_decoded == s.tokens_decoded
    assert s.calls == 3 and s.nodes >= 2 and s.bytes_in_use > 0 and s.evictions == 0
    assert t.p50 == pytest.approx(sorted(t.latencies)[1]) and t.p50 <= t.p95 <= max(t.latencies)


async def test_per_template_sums_equal_totals_and_reset_zeroes(make_backend):
    backend = make_backend("llama")
    a = lmq.compile(SRC, model=backend, name="classify")
    b = lmq.compile('"Q: {question}\\nA:[ANSWER]" where len(TOKENS(ANSWER)) < 4', model=backend, name="qa")
    inputs_a = [{"shots": SHOTS, "review": r} for r in ["good", "bad", "good", "meh"]]
    inputs_b = [{"question": q} for q in ["why?", "how?", "why?"]]
    ra = await profile_query(a, inputs_a, backend=backend, concurrency=3, progress=False)
    rb = await profile_query(b, inputs_b, backend=backend, concurrency=2, progress=False, on_error="skip")
    assert rb.stats.calls == 3 and set(rb.stats.per_template) == {"qa"}  # each run resets
    assert ra.stats.calls == 4 and all(r.ok for r in ra.records + rb.records)

    # both templates in one accounting period
    backend.reset_stats()
    await a.map(inputs_a, concurrency=3)
    await b.map(inputs_b, concurrency=2)
    s = backend.stats()
    assert set(s.per_template) == {"classify", "qa"}
    for f in COUNTERS:
        assert sum(getattr(t, f) for t in s.per_template.values()) == getattr(s, f), f
    assert s.per_template["classify"].calls == 4 and s.per_template["qa"].calls == 3
    assert s.tokens_decoded > 0  # the qa holes generate more than one token
    assert s.tokens_requested == s.tokens_reused + s.tokens_prefilled
    assert len(s.latencies) == 7

    bytes_before, nodes_before = s.bytes_in_use, s.nodes
    backend.reset_stats()
    z = backend.stats()
    assert all(getattr(z, f) == 0 for f in (*COUNTERS, "evictions")) and z.per_template == {}
    assert (z.bytes_in_use, z.nodes) == (bytes_before, nodes_before)  # gauges: the trie is still there
    assert z.token_hit_rate == 0.0 and z.p50 is None
    json.dumps(z.as_dict())


def test_a_templates_latencies_keep_the_latest_calls(monkeypatch):
    """A backend keeps a template's last LATENCY_WINDOW latencies (a server's statistics stay one size); a
    snapshot holds a list of its own, and `since` takes the latencies of the calls after the earlier one."""
    monkeypatch.setattr(stats_module, "LATENCY_WINDOW", 3)
    t = TemplateStats.live()
    for x in (5.0, 1.0, 2.0):
        t.record_call(x)
    earlier = CacheStats(per_template={"q": t.copy()})
    for x in (3.0, 4.0):
        t.record_call(x)
    assert t.calls == 5 and list(t.latencies) == [2.0, 3.0, 4.0] and t.p50 == 3.0
    snap = t.copy()
    assert type(snap.latencies) is list and snap.latencies == [2.0, 3.0, 4.0]
    t.record_call(9.0)
    assert snap.latencies == [2.0, 3.0, 4.0]                    # the snapshot does not move
    later = CacheStats(per_template={"q": snap})
    assert later.since(earlier).per_template["q"].latencies == [3.0, 4.0]
    assert later.since(CacheStats()).per_template["q"].latencies == [2.0, 3.0, 4.0]  # (as many as are kept)


def test_since_as_dict_percentiles_and_table():
    t = TemplateStats(calls=4, latencies=[0.4, 0.1, 0.3, 0.2])
    t.record_prefill(10, 0)
    t.record_prefill(10, 9)
    assert (t.lookups, t.hits, t.tokens_reused, t.tokens_prefilled, t.token_hit_rate) == (2, 1, 9, 11, 0.45)
    assert t.p50 == pytest.approx(0.25) and t.p95 == pytest.approx(0.385)
    assert percentile([], 50) is None and percentile([2.0], 95) == 2.0
    later = CacheStats(lookups=5, hits=3, tokens_requested=40, tokens_reused=20, tokens_prefilled=20,
                       evictions=2, bytes_in_use=1000, nodes=7,
                       per_template={"x": t, "y": TemplateStats(calls=1, latencies=[1.0])})
    earlier = CacheStats(lookups=1, tokens_requested=10, tokens_prefilled=10, evictions=1, bytes_in_use=99,
                         per_template={"x": TemplateStats(calls=1, latencies=[0.4])})
    d = later.since(earlier)
    assert (d.lookups, d.tokens_requested, d.tokens_reused, d.evictions, d.bytes_in_use, d.nodes) == (4, 30, 20, 1, 1000, 7)
    assert d.per_template["x"].calls == 3 and d.per_template["x"].latencies == [0.1, 0.3, 0.2]
    as_dict = later.as_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["token_hit_rate"] == 0.5 and as_dict["calls"] == 5
    assert as_dict["per_template"]["x"]["p95_seconds"] == pytest.approx(0.385)
    assert "latencies" not in as_dict["per_template"]["x"]
    assert later.as_dict(latencies=True)["per_template"]["y"]["latencies"] == [1.0]
    table = format_table(later)
    assert "total" in table and "45.0%" in table and "50.0%" in table and "1.0 kB in use in 7 nodes" in table
    assert table.splitlines()[0].split()[:3] == ["template", "calls", "prompt"]


# ----- the step log -----------------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.callback = "unset"

    def on_step(self, callback):
        self.callback = callback


def test_step_log_format():
    info = StepInfo(kind="prefill", batch_size=3, new_tokens=75, cached_tokens=3210, seconds=0.0123)
    assert format_step(info) == "[lmq] prefill batch=3 #new-token=75 #cached-token=3210 12.3 ms"
    backend, out = _Recorder(), io.StringIO()
    callback = log_steps(backend, file=out)
    assert backend.callback is callback
    callback(StepInfo("decode", 8, 8, 512, 0.0021))
    callback(info)
    assert out.getvalue().splitlines() == [
        "[lmq] decode batch=8 #new-token=8 #cached-token=512 2.1 ms",
        "[lmq] prefill batch=3 #new-token=75 #cached-token=3210 12.3 ms",
    ]


async def test_step_log_on_a_backend(make_backend):
    backend, out = make_backend("llama"), io.StringIO()
    log_steps(backend, file=out)
    try:
        await lmq.compile(SRC, model=backend)(shots=SHOTS, review="good")
    finally:
        backend.on_step(None)
    assert type(backend).on_step is not protocol.Backend.on_step  # (the protocol's no-op reports nothing)
    lines = out.getvalue().splitlines()
    assert lines and lines[0].startswith("[lmq] prefill batch=1 #new-token=") and lines[0].endswith(" ms")


# ----- lmq profile --------------------------------------------------------------------------------------

@pytest.fixture
def tiny_cli(make_backend, tmp_path):
    """A registered tiny backend "tiny-test", a query file for it and a helper to write inputs files."""
    backend = make_backend("llama")
    lmq.register_backend("tiny-test", backend)
    query = tmp_path / "cls.lmq"
    query.write_text("argmax\n    " + SRC.replace("{shots}", SHOTS.replace("\n", "\\n")) + '\nfrom "tiny-test"\n')

    def inputs(*lines: str):
        path = tmp_path / "inputs.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        return str(path)

    yield backend, str(query), inputs
    registry._REGISTRY.pop("tiny-test", None)


def review(text: str) -> str:
    return json.dumps({"review": text})


def test_cli_json_agrees_with_stats_and_plots(tiny_cli, tmp_path, capsys):
    import matplotlib  # noqa: F401  (the `plot` extra: the README's install has it)
    backend, query, inputs = tiny_cli
    data = inputs(review("good"), review("bad"), "", review("good"), review("so-so"), review("good"))
    png = tmp_path / "out.png"
    rc = main(["profile", query, "--inputs", data, "--json", "--model", "tiny-test", "--concurrency", "2",
               "--no-progress", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out)
    s = backend.stats()
    assert doc["stats"] == json.loads(json.dumps(s.as_dict()))
    assert doc["stats"]["per_template"][query]["calls"] == 5 == s.calls
    assert s.tokens_reused > 0 and doc["stats"]["token_hit_rate"] == pytest.approx(s.token_hit_rate)
    assert [c["index"] for c in doc["calls"]] == [0, 1, 2, 3, 4]
    assert [c["line"] for c in doc["calls"]] == [1, 2, 4, 5, 6]  # the blank line 3 is no call
    assert all(c["ok"] and c["error"] is None and c["latency"] > 0 for c in doc["calls"])
    last = max(doc["calls"], key=lambda c: c["finished"])
    assert (last["tokens_requested"], last["tokens_reused"]) == (s.tokens_requested, s.tokens_reused)
    assert doc["calls_ok"] == 5 and doc["lines_skipped"] == 0 and doc["stopped"] is None

    blob = png.read_bytes()
    assert blob[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_cli_plot_where_it_cannot_be_written(tiny_cli, tmp_path, capsys):
    """--plot into a folder that does not exist stops before any call; a plot that fails to write after the run
    (a folder in its place) leaves the report printed, and says why."""
    import matplotlib  # noqa: F401
    backend, query, inputs = tiny_cli
    data = inputs(review("good"), review("bad"))
    rc = main(["profile", query, "--inputs", data, "--model", "tiny-test", "--no-progress",
               "--plot", str(tmp_path / "no-such-folder" / "out.png")])
    assert rc != 0 and "no folder" in capsys.readouterr().err and backend.stats().lookups == 0
    (tmp_path / "taken.png").mkdir()
    rc = main(["profile", query, "--inputs", data, "--model", "tiny-test", "--no-progress", "--json",
               "--plot", str(tmp_path / "taken.png")])
    captured = capsys.readouterr()
    assert rc == 0 and json.loads(captured.out)["calls_ok"] == 2 and "--plot" in captured.err


def test_cli_table_and_progress_bar(tiny_cli, capsys):
    backend, query, inputs = tiny_cli
    rc = main(["profile", query, "--inputs", inputs(review("good"), review("good"))])
    captured = capsys.readouterr()
    assert rc == 0
    lines = captured.out.splitlines()
    assert lines[0].split()[:2] == ["template", "calls"]
    assert any(line.startswith("…") and "/cls.lmq " in line for line in lines)  # a long path keeps its end
    assert any(line.startswith("total") for line in lines)
    assert f"{100 * backend.stats().token_hit_rate:.1f}%" in captured.out
    assert "evictions" in captured.out and "nodes" in captured.out
    assert "2/2" in captured.err  # tqdm writes to stderr


def test_cli_missing_inputs_file(tiny_cli, tmp_path, capsys):
    _, query, _ = tiny_cli
    missing = tmp_path / "nope.jsonl"
    assert main(["profile", query, "--inputs", str(missing), "--model", "tiny-test"]) == 2
    err = capsys.readouterr().err
    assert "cannot read inputs file" in err and str(missing) in err


def test_cli_malformed_line_stops_after_printing_what_it_has(tiny_cli, capsys):
    backend, query, inputs = tiny_cli
    data = inputs(review("good"), review("bad"), '{"review": "unterminated', review("never run"))
    rc = main(["profile", query, "--inputs", data, "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 2
    assert f"{data}, line 3: not valid JSON" in captured.err
    doc = json.loads(captured.out)
    assert doc["calls_ok"] == 2 and "line 3" in doc["stopped"] and backend.stats().calls == 2


@pytest.mark.parametrize("line, message", [
    (json.dumps({"review": "x", "mood": "happy"}), "line 2: the query does not take variable 'mood' (it takes: review)"),
    (json.dumps({"text": "x"}), "line 2: the query does not take variable 'text'"),
    ("{}", "line 2: missing input variable 'review'"),
    ('["not", "an", "object"]', "line 2: expected a JSON object of inputs, got list"),
])
def test_cli_bad_line_is_named(tiny_cli, capsys, line, message):
    _, query, inputs = tiny_cli
    rc = main(["profile", query, "--inputs", inputs(review("ok"), line), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 2 and message in captured.err
    assert "stopped early" in captured.out and "1 calls" in captured.out  # the table of what ran


def test_cli_on_error_skip_continues_and_counts(tiny_cli, capsys):
    backend, query, inputs = tiny_cli
    data = inputs(review("good"), "{oops", review("bad"), json.dumps({"review": "x", "extra": 1}), review("good"))
    rc = main(["profile", query, "--inputs", data, "--json", "--no-progress", "--on-error", "skip"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "line 2: not valid JSON" in captured.err and "line 4: the query does not take variable 'extra'" in captured.err
    doc = json.loads(captured.out)
    assert doc["lines_skipped"] == 2 and [x["line"] for x in doc["skipped"]] == [2, 4]
    assert doc["calls_ok"] == 3 and [c["line"] for c in doc["calls"]] == [1, 3, 5] and backend.stats().calls == 3


def test_cli_failed_call_skip_and_stop(tiny_cli, tmp_path, capsys):
    _, _, inputs = tiny_cli
    query = tmp_path / "n.lmq"
    query.write_text('"Number {int(n) + 1}:[X]" where len(TOKENS(X)) < 3\nfrom "tiny-test"\n')
    data = inputs(json.dumps({"n": "1"}), json.dumps({"n": "one"}), json.dumps({"n": "3"}))
    assert main(["profile", str(query), "--inputs", data, "--json", "--no-progress", "--on-error", "skip"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [c["ok"] for c in doc["calls"]] == [True, False, True] and doc["calls_failed"] == 1
    assert "LMQRuntimeError" in doc["calls"][1]["error"] and "line 2: LMQRuntimeError" in captured.err
    assert main(["profile", str(query), "--inputs", data, "--json", "--no-progress"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert [c["ok"] for c in doc["calls"]] == [True, False] and doc["stopped"].startswith("line 2")


def test_query_inputs_of_a_compiled_file():
    q = lmq.Query('"{prefix} {len(items)} {x}[Y]" where Y in [" a"]\nfrom "tiny-test"', name="f")
    assert q.signature is None
    required, accepted = query_inputs(q)
    assert required == accepted == {"prefix", "items", "x"}  # `len` is Python's, `Y` a hole


def test_read_inputs_reports_each_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2, "b": 3}\nnot json\n')
    rows = read_inputs(path, {"a"}, {"a"})
    assert [line for line, _ in rows] == [1, 3, 4]
    assert rows[0][1] == {"a": 1}
    assert rows[1][1].line == 3 and "'b'" in str(rows[1][1]) and str(rows[2][1]).endswith("line 4: not valid JSON (Expecting value at column 1)")


# ----- `lmq profile -` and --log-steps ---------------------------------------------------------------------

STEP_LINE = r"^\[lmq\] (prefill|decode) batch=(\d+) #new-token=(\d+) #cached-token=(\d+) \d+\.\d ms$"


def test_cli_profile_reads_the_query_from_stdin(tiny_cli, monkeypatch, capsys):
    backend, query, inputs = tiny_cli
    data = inputs(review("good"), review("bad"), review("good"))
    monkeypatch.setattr("sys.stdin", io.StringIO(open(query).read()))
    assert main(["profile", "-", "--inputs", data, "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["stats"]["per_template"]) == ["stdin"] and doc["calls_ok"] == 3
    assert doc["stats"]["per_template"]["stdin"]["calls"] == 3 == backend.stats().calls
    assert doc["stats"]["tokens_reused"] > 0  # the query ran on "tiny-test", as its `from` says


def test_cli_log_steps_lines_add_up_to_the_counters(tiny_cli, tmp_path, capsys):
    backend, _, inputs = tiny_cli
    query = tmp_path / "qa.lmq"
    query.write_text('"' + SHOTS.replace("\n", "\\n") + 'Q: {review}\\nA:[X]" where len(TOKENS(X)) < 4\n'
                     'from "tiny-test"\n')
    data = inputs(review("good"), review("bad"), review("so-so"), review("good"))
    assert main(["profile", str(query), "--inputs", data, "--json", "--no-progress", "--log-steps",
                 "--concurrency", "2"]) == 0
    captured = capsys.readouterr()
    s = backend.stats()
    steps = [(kind, int(b), int(n), int(c)) for kind, b, n, c in re.findall(STEP_LINE, captured.err, flags=re.M)]
    assert len(steps) == len(captured.err.strip().splitlines())  # nothing else on stderr
    prefill = [x for x in steps if x[0] == "prefill"]
    decode = [x for x in steps if x[0] == "decode"]
    assert sum(b for _, b, _, _ in prefill) == s.lookups == 4  # a row per lookup
    assert sum(n for _, _, n, _ in prefill) == s.tokens_prefilled
    assert sum(c for _, _, _, c in prefill) == s.tokens_reused > 0
    assert decode and sum(n for _, _, n, _ in decode) == s.tokens_decoded > 0
    assert all(n == b for _, b, n, _ in decode)  # a decode step feeds one token a row
    # the log stops with the run
    after = lmq.compile('"More[X]" where len(TOKENS(X)) < 3', model=backend)
    after.run_sync()
    assert "[lmq]" not in capsys.readouterr().err
