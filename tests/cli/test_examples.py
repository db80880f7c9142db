"""Every example in examples/ run as a user runs it (`lmq run FILE --var ...`, greedy on the default model),
checked by what it prints: the filled prompt, each variable's value under its constraints, what the
model answers where the answer is not in doubt, and a distribution against an independent forward.

The text output is parsed back: the prompt, a `---` line, `NAME = repr(value)` lines, and for a
`distribution` a `distribution:` line and one `  probability  'option'` line per option."""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

from lmq_backend.cli import main

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INT_RE = r" ?-?[0-9]+"


def lmq_run(capsys, name: str, *args: str) -> str:
    assert main(["run", str(EXAMPLES / name), *args]) == 0
    return capsys.readouterr().out


def parse(out: str) -> tuple[str, dict, dict]:
    """(prompt, variables, distribution) from `lmq run`'s text output of one result."""
    prompt, _, rest = out.rpartition("\n---\n")
    variables, distribution, lines = {}, {}, rest.splitlines()
    while lines and (m := re.fullmatch(r"(\w+) = (.*)", lines[0])):
        variables[m[1]] = ast.literal_eval(m[2])
        lines.pop(0)
    if lines and lines[0] == "distribution:":
        for line in lines[1:]:
            p, option = line.split(maxsplit=1)
            distribution[ast.literal_eval(option)] = float(p)
    else:
        assert not lines, f"unexpected output {lines}"
    return prompt, variables, distribution


def n_tokens(backend, value: str) -> int:
    return len(backend.vocab.encode_continuation(value))


SENTIMENT_PROMPT = (
    "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    "Review: The pasta was cold and the waiter ignored us.\nSentiment: negative\n\n"
    "Review: Lovely staff, great coffee, we will come back!\nSentiment: positive\n\n"
    "Review: It was okay, nothing special.\nSentiment: neutral\n\n"
    "Review: {}\nSentiment:")


@pytest.mark.parametrize("review,label", [
    ("The food was wonderful and the staff were friendly.", " positive"),
    ("Cold soup, rude waiter, and we waited an hour for the bill.", " negative"),
])
def test_sentiment(capsys, default_backend, review, label):
    prompt, variables, _ = parse(lmq_run(capsys, "sentiment.lmq", "--var", f"review={review}"))
    assert variables == {"CLS": label}
    assert prompt == SENTIMENT_PROMPT.format(review) + label


def test_number_prints_an_integer(capsys, default_backend):
    prompt, variables, _ = parse(lmq_run(capsys, "number.lmq"))
    assert set(variables) == {"N"}
    n = variables["N"]
    assert re.fullmatch(INT_RE, n) and n_tokens(default_backend, n) <= 3
    assert int(n) == 8  # a spider's legs: the model knows
    assert prompt == "Q: How many legs does a spider have?\nA: A spider has" + n


def test_date_matches_its_regex(capsys, default_backend):
    prompt, variables, _ = parse(lmq_run(capsys, "date.lmq"))
    assert set(variables) == {"DATE"}
    assert re.fullmatch(r"[0-9]{2}/[0-9]{2}/[0-9]{4}", variables["DATE"])
    assert prompt == ("Q: It is August 12th, 2020. What date was it 100 days ago? Answer in DD/MM/YYYY.\n"
                      "A: " + variables["DATE"])


def test_chat_answers_in_the_chat_format(capsys, default_backend):
    question = "What is the capital of France?"
    prompt, variables, _ = parse(lmq_run(capsys, "chat.lmq", "--var", f"question={question}"))
    answer = variables["ANSWER"]
    assert set(variables) == {"ANSWER"} and "Paris" in answer and n_tokens(default_backend, answer) <= 47
    assert "<|im_end|>" not in answer  # the end-of-turn token ends the hole
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant. Answer in one sentence.<|im_end|>\n"
                      f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")


def test_chat_multi_turn_answers_each_question(capsys, default_backend):
    questions = ["Hi! Who are you?", "What can you do?"]
    prompt, variables, _ = parse(lmq_run(capsys, "chat_multi_turn.lmq", "--var", f"questions:={questions!r}"))
    head = "<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n"
    turn = r"<\|im_start\|>user\n{}<\|im_end\|>\n<\|im_start\|>assistant\n(.*?)<\|im_end\|>\n"
    m = re.fullmatch(re.escape(head) + "".join(turn.format(re.escape(q)) for q in questions), prompt, flags=re.S)
    assert m, prompt
    answers = list(m.groups())
    assert all(a.strip() and n_tokens(default_backend, a) <= 39 for a in answers)
    assert variables == {"ANSWER": answers[-1]}  # the hole of the loop keeps its last value


def test_chat_multi_turn_prefills_as_the_hand_written_template():
    """The example with roles against the same chat in SmolLM2's markup by hand, each on a fresh backend of the
    default model: the same prompt, and per turn the same tokens prefilled (each turn only its own text; the
    history comes from the prefix cache)."""
    import lmq_backend as lmq

    by_hand = '''
argmax
    "<|im_start|>system\\nYou are a helpful assistant. Answer briefly.<|im_end|>\\n"
    for question in questions:
        "<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n"
        "[ANSWER]" where len(TOKENS(ANSWER)) < 40
        "<|im_end|>\\n"
'''
    questions = ["Hi! Who are you?", "What can you do?", "What is 2 + 2?", "Thanks!", "Name a colour.", "Bye!"]
    runs = []
    for source in ((EXAMPLES / "chat_multi_turn.lmq").read_text(), by_hand):
        backend = lmq.HFBackend("default")
        prefilled = []
        generate = backend.generate

        async def counting(seq, state, sampler, backend=backend, generate=generate, prefilled=prefilled):
            before = backend.stats().tokens_prefilled
            value = await generate(seq, state, sampler)
            prefilled.append(backend.stats().tokens_prefilled - before)
            return value

        backend.generate = counting
        runs.append((lmq.Query(source, model=backend).run_sync(questions=questions).prompt, prefilled))
        backend.close()
    (prompt, prefilled), hand = runs
    assert (prompt, prefilled) == hand and len(prefilled) == 6
    assert all(n < 40 for n in prefilled[1:])  # a turn's own text, never the history again


def test_packing_list_returns_its_items(capsys, default_backend):
    out = lmq_run(capsys, "packing_list.lmq", "--var", "n_items:=3")
    things = ast.literal_eval(out.strip())  # the query returns a list: printed as it is
    assert isinstance(things, list) and len(things) == 3
    for thing in things:
        assert thing and thing == thing.strip() and "\n" not in thing and n_tokens(default_backend, thing) <= 11


@pytest.fixture(scope="module")
def reference_model():
    """The default model loaded again by transformers alone (lmq never touches this instance)."""
    from transformers import AutoModelForCausalLM

    from lmq_backend.backend.default_model import default_model_dir

    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32, use_kernels=False).eval()


@pytest.mark.parametrize("review", ["Awful. Never again.", "Best meal of my life, lovely staff."])
def test_distribution_prints_the_model_probabilities(capsys, default_backend, reference_model, review):
    prompt, variables, distribution = parse(lmq_run(capsys, "distribution.lmq", "--var", f"review={review}"))
    head = f"Review: {review}\nQ: Is this review positive or negative?\nA:"
    assert set(distribution) == {" positive", " negative"} and abs(sum(distribution.values()) - 1) < 2e-4
    assert variables == {"CLS": max(distribution, key=distribution.get)} and prompt == head + variables["CLS"]
    # an independent forward: P(option) is proportional to the product of its tokens' probabilities
    vocab = default_backend.vocab
    ids = default_backend.sequence("t").ids + vocab.encode(head)
    scores = {}
    for option in distribution:
        cont = vocab.encode_continuation(option)
        with torch.no_grad():
            logp = torch.log_softmax(reference_model(torch.tensor([ids + cont])).logits[0].double(), -1)
        scores[option] = sum(logp[len(ids) - 1 + j, t].item() for j, t in enumerate(cont))
    top = max(scores.values())
    total = sum(math.exp(s - top) for s in scores.values())
    for option, s in scores.items():
        assert distribution[option] == pytest.approx(math.exp(s - top) / total, abs=2e-4), option


def test_typed_returns_python_values(capsys, default_backend):
    out = lmq_run(capsys, "typed.lmq").strip()
    assert out.startswith("(") and "City(name=" in out
    legs, in_france, day, city = _returned(out)
    assert legs == 8 and in_france is True  # the model knows
    assert re.fullmatch(r"[0-9]{2}/[0-9]{2}", day)
    assert city == {"name": "Paris", "country": "France"}


def _returned(out: str):
    """The printed tuple of typed.lmq, with its dataclass as a dict."""
    legs, rest = out[1:].split(", ", 1)
    in_france, rest = rest.split(", ", 1)
    day, rest = rest.split(", ", 1)
    fields = dict(re.findall(r"(\w+)='([^']*)'", rest))
    return int(legs), in_france == "True", ast.literal_eval(day), fields


def test_nested_hides_the_inner_prompt(capsys, default_backend):
    prompt, variables, _ = parse(lmq_run(capsys, "nested.lmq"))
    assert "Paris" in variables["FRANCE"] and "Answer in a few words" not in prompt
    assert prompt == (f"The capital of France: {variables['FRANCE']}\n"
                      f"The capital of Italy: {variables['ITALY']}\n")


def test_tools_awaits_its_lookup(capsys, default_backend):
    prompt, variables, _ = parse(lmq_run(capsys, "tools.lmq"))
    city = variables["CITY"]
    assert city in (" Paris", " Rome", " Berlin")
    assert f"City:{city}\nFact: {city.strip()} is the capital of " in prompt
    assert prompt.count("\nQ: ") == 2 and prompt.endswith(variables["ANSWER"] + "\n")


def test_chat_tutor_scores_the_topic_then_answers(capsys, default_backend):
    question = "What is 7 times 8?"
    prompt, variables, distribution = parse(lmq_run(capsys, "chat_tutor.lmq", "--var", f"question={question}"))
    assert set(distribution) == {" maths", " geography", " history"} and abs(sum(distribution.values()) - 1) < 2e-4
    assert variables["TOPIC"] == max(distribution, key=distribution.get) == " maths"
    assert prompt == ("<|im_start|>system\nYou are a helpful tutor. Answer in one sentence.<|im_end|>\n"
                      f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
                      f"Topic:{variables['TOPIC']}\n{variables['ANSWER']}<|im_end|>\n")


def test_chat_streams_as_it_goes(capsys, default_backend):
    question = "What is the capital of France?"
    out = lmq_run(capsys, "chat.lmq", "--var", f"question={question}", "--stream")
    shown, _, variables = out.partition("\n---\n")
    answer = ast.literal_eval(variables.strip().removeprefix("ANSWER = "))
    assert "Paris" in answer
    assert shown == (f"\nsystem: You are a helpful assistant. Answer in one sentence.\nuser: {question}\n"
                     f"assistant: {answer}")
