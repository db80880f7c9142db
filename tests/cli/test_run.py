"""`lmq run`: the inputs it takes (a `--var` the query does not take is refused, as `lmq profile` refuses an
inputs line naming one) and the query it reads (no query in the file or on standard input is an error)."""
from __future__ import annotations

import io
import json

import pytest

import lmq_backend as lmq
from lmq_backend.backend import registry
from lmq_backend.cli import main

QUERY = '"Review: {review}\\nSentiment:[CLS]" where CLS in [" good", " bad"]\nfrom "tiny-run"\n'


@pytest.fixture
def tiny_run(make_backend, tmp_path):
    """A registered tiny backend "tiny-run" and a query file for it."""
    lmq.register_backend("tiny-run", make_backend("llama"))
    path = tmp_path / "cls.lmq"
    path.write_text(QUERY)
    yield str(path)
    registry._REGISTRY.pop("tiny-run", None)


def test_a_var_the_query_takes_runs(tiny_run, capsys):
    assert main(["run", tiny_run, "--var", "review=fine"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Review: fine\nSentiment:") and "CLS = " in out


@pytest.mark.parametrize("extra, message", [
    (["--var", "mood=happy"], "--var: the query does not take variable 'mood' (it takes: review)"),
    (["--var", "mood=happy", "--var", "n:=3"],
     "--var: the query does not take variables 'mood', 'n' (it takes: review)"),
    (["--var", "mood=happy", "--stream"], "--var: the query does not take variable 'mood' (it takes: review)"),
])
def test_a_var_the_query_does_not_take_is_refused(tiny_run, capsys, extra, message):
    assert main(["run", tiny_run, "--var", "review=fine", *extra]) == 2
    captured = capsys.readouterr()
    assert f"lmq: LMQInputError: {message}" in captured.err and captured.out == ""
    assert registry.get_backend("tiny-run").stats().calls == 0  # refused before any call


def test_a_query_without_inputs_refuses_any_var(tiny_run, tmp_path, capsys):
    path = tmp_path / "plain.lmq"
    path.write_text('"Hello[X]" where len(TOKENS(X)) < 2\nfrom "tiny-run"\n')
    assert main(["run", str(path), "--var", "review=fine"]) == 2
    assert "the query does not take variable 'review' (it takes: no inputs)" in capsys.readouterr().err


@pytest.mark.parametrize("text, what", [
    ("", "empty"), ("\n  \n\t\n", "empty"), ("# a comment\n\n  # another\n", "comments only"),
])
def test_no_query_on_stdin_or_in_a_file_is_an_error(tiny_run, tmp_path, monkeypatch, text, what):
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    with pytest.raises(SystemExit, match=f"^lmq: no query in standard input: it is {what}$") as e:
        main(["run", "-", "--model", "tiny-run"])
    assert e.value.code != 0
    path = tmp_path / "empty.lmq"
    path.write_text(text)
    with pytest.raises(SystemExit, match=f"^lmq: no query in {path}: it is {what}$"):
        main(["run", str(path), "--model", "tiny-run"])
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    with pytest.raises(SystemExit, match="no query in standard input"):
        main(["profile", "-", "--inputs", str(path), "--model", "tiny-run"])
    assert registry.get_backend("tiny-run").stats().calls == 0


def test_a_query_on_stdin_runs(tiny_run, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(QUERY))
    assert main(["run", "-", "--var", "review=awful"]) == 0
    assert capsys.readouterr().out.startswith("Review: awful\nSentiment:")


def test_json_gives_a_returned_tuple_and_dataclass_as_json(tiny_run, tmp_path, capsys):
    """`lmq run --json` of a query that returns a tuple holding a dataclass, an enum and a set: JSON arrays and
    objects, not one repr string."""
    path = tmp_path / "typed.lmq"
    path.write_text('import dataclasses, enum\n'
                    '@dataclasses.dataclass\n'
                    'class City:\n'
                    '    name: str\n'
                    '    rank: int\n'
                    'class Size(enum.Enum):\n'
                    '    BIG = "big"\n'
                    '"Review: {review}\\nSentiment:[CLS]" where CLS in [" good", " bad"]\n'
                    'return (CLS, City("Paris", 1), Size.BIG, {3})\n'
                    'from "tiny-run"\n')
    assert main(["run", str(path), "--var", "review=fine", "--json"]) == 0
    [value] = json.loads(capsys.readouterr().out)
    assert value[0] in (" good", " bad") and value[1:] == [{"name": "Paris", "rank": 1}, "big", [3]]
