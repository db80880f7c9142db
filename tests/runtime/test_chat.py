"""Chat roles: `{:system}`, `{:user}`, `{:assistant}` rendered by the model's own chat template.

At every hole the model reads exactly what `tokenizer.apply_chat_template` renders for the conversation so
far (the generation prompt before an assistant hole), token for token where the text before the hole is
the template's alone; each turn prefills only what it adds, as the same chat written by hand in the
template's markup does; a template that renders an earlier turn differently once a later one exists gets the
whole rendering again (counted in `Result.rerenders`), never a prompt the template would not write."""
from __future__ import annotations

import asyncio

import pytest

import lmq_backend as lmq
from lmq_backend.backend.hf import HFBackend
from support.tiny import llama_style_tokenizer, tiny_llama

CHAT = '''
argmax
    "{:system} You are a helpful assistant. Answer briefly."
    for question in questions:
        "{:user} {question}"
        "{:assistant} [ANSWER]" where len(TOKENS(ANSWER)) < 6
'''
BY_HAND = '''
argmax
    "<|im_start|>system\\nYou are a helpful assistant. Answer briefly.<|im_end|>\\n"
    for question in questions:
        "<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n"
        "[ANSWER]" where len(TOKENS(ANSWER)) < 6
        "<|im_end|>\\n"
'''
QUESTIONS = ["Hi! Who are you?", "What can you do?", "Name a colour.", "And a fruit?"]
SYSTEM = "You are a helpful assistant. Answer briefly."

# A Qwen-2.5-like template (a default system message when there is none), and one that renders the last
# user message differently from earlier ones: an earlier turn changes once a later one exists.
QWEN_STYLE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAST_USER_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m['role'] == 'user' and loop.last %} (latest){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama-3-like: the template writes the BOS token itself, and trims each message
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n\n{{ m['content'] | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n\n{% endif %}")


def spy(backend):
    """Record (ids, text, tokens prefilled so far) at every hole the backend fills."""
    seen = []
    generate = backend.generate

    async def recording(seq, state, sampler):
        seen.append((list(seq.ids), seq.text))
        value = await generate(seq, state, sampler)
        seen[-1] += (backend.stats().tokens_prefilled,)
        return value

    backend.generate = recording
    return seen


def with_template(tokenizer, template):
    """A tokenizer like `tokenizer` (the default one, or one built here) whose chat template is `template`."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        from lmq_backend.backend.default_model import default_model_dir

        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.chat_template = template
    return tokenizer


def messages_before(r_variables_answers, questions, k, system=SYSTEM):
    msgs = [{"role": "system", "content": system}] if system is not None else []
    for q, a in zip(questions[:k], r_variables_answers[:k]):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": questions[k]}]


async def answers_of(query, backend, questions):
    seen = spy(backend)
    r = await query.run({"questions": questions}, backend)
    prompts = [text for _, text, _ in seen]
    # each answer: what the prompt at the next hole (or the end) holds after this hole's prompt
    ends = prompts[1:] + [r.prompt]
    answers = []
    for before, after in zip(prompts, ends):
        assert after.startswith(before)
        rest = after[len(before):]
        answers.append(rest[: rest.index("<|im_end|>")] if "<|im_end|>" in rest else rest)
    return r, seen, answers


async def test_roles_render_the_models_template_token_for_token(make_backend, tokenizer):
    backend = make_backend("llama")
    r, seen, answers = await answers_of(lmq.compile(CHAT), backend, QUESTIONS)
    assert r.rerenders == 0 and len(seen) == len(QUESTIONS)
    for k, (ids, text, _) in enumerate(seen):
        msgs = messages_before(answers, QUESTIONS, k)
        assert text == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # the first hole's prompt is the template's text alone: its tokens are apply_chat_template's
    first = messages_before(answers, QUESTIONS, 0)
    assert seen[0][0] == tokenizer.apply_chat_template(first, tokenize=True, add_generation_prompt=True)["input_ids"]
    full = messages_before(answers, QUESTIONS + ["-"], len(QUESTIONS))[:-1]
    assert r.prompt == tokenizer.apply_chat_template(full, tokenize=False)


async def test_each_turn_prefills_what_it_adds_as_the_hand_written_chat(make_backend):
    """The same chat with roles and in the template's markup by hand: the same prompts, the same tokens, the
    same prefilled tokens per turn; a turn prefills fewer tokens than its prompt holds."""
    per_query = []
    for source in (CHAT, BY_HAND):
        backend = make_backend("llama")
        seen = spy(backend)
        r = await lmq.compile(source).run({"questions": QUESTIONS}, backend)
        prefilled = [b - a for a, b in zip([0] + [p for *_, p in seen], [p for *_, p in seen])]
        per_query.append((r.prompt, [ids for ids, *_ in seen], prefilled))
    (chat_prompt, chat_ids, chat_prefilled), (hand_prompt, hand_ids, hand_prefilled) = per_query
    assert chat_prompt == hand_prompt and chat_ids == hand_ids and chat_prefilled == hand_prefilled
    for k in range(1, len(QUESTIONS)):
        assert chat_prefilled[k] < len(chat_ids[k]) - len(chat_ids[k - 1])  # the answer's tokens were cached


async def test_a_later_call_reuses_the_earlier_turns(make_backend):
    """Turn k as its own call (the history passed in): only turn k's text is prefilled."""
    history_query = lmq.compile('''
argmax
    "{:system} Be brief."
    for q, a in history:
        "{:user} {q}"
        "{:assistant} {a}"
    "{:user} {question}"
    "{:assistant} [ANSWER]" where len(TOKENS(ANSWER)) < 5
''')
    backend = make_backend("llama")
    seen = spy(backend)
    history = []
    for question in QUESTIONS[:3]:
        r = await history_query.run({"history": history, "question": question}, backend)
        history.append((question, r["ANSWER"]))
    ids = [i for i, *_ in seen]
    prefilled = [b - a for a, b in zip([0] + [p for *_, p in seen], [p for *_, p in seen])]
    for k in range(1, 3):
        assert ids[k][: len(ids[k - 1])] == ids[k - 1]
        new = len(ids[k]) - len(ids[k - 1])
        # the new turn's text, and the earlier answer: decoded, its K/V is cached but for the last token
        assert prefilled[k] <= new - len(backend.vocab.encode(history[k - 1][1])) + 1


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA3_STYLE])
async def test_other_templates(tiny_models, tokenizer, template):
    """A Qwen-like template on the default tokenizer, and a Llama-3-like one (the template writes the BOS token)
    on a SentencePiece-style tokenizer: the first hole's ids are apply_chat_template's."""
    if template is LLAMA3_STYLE:
        tok = with_template(llama_style_tokenizer(), template)
        model = tiny_llama(vocab_size=len(tok))
        questions = ["hello there", "the world"]
    else:
        tok, model, questions = with_template(None, template), tiny_models["llama"], QUESTIONS[:2]
    backend = HFBackend.from_model(model, tok, cache_budget="16MB", name="tiny-templated")
    seen = spy(backend)
    q = lmq.compile('''
argmax
    for question in questions:
        "{:user} {question}"
        "{:assistant} [ANSWER]" where len(TOKENS(ANSWER)) < 4
''')
    r = await q.run({"questions": questions}, backend)
    first = [{"role": "user", "content": questions[0]}]
    assert seen[0][0] == tok.apply_chat_template(first, tokenize=True, add_generation_prompt=True)["input_ids"]
    if template is LLAMA3_STYLE:
        assert seen[0][0].count(tok.bos_token_id) == 1
    assert r.prompt.startswith(seen[1][1]) and seen[1][1].startswith(seen[0][1])


async def test_a_template_that_rewrites_earlier_turns_is_rendered_again(tiny_models, tokenizer):
    tok = with_template(None, LAST_USER_MARKED)
    backend = HFBackend.from_model(tiny_models["llama"], tok, cache_budget="16MB", name="tiny-rewrites")
    seen = spy(backend)
    r = await lmq.compile(CHAT).run({"questions": QUESTIONS[:3]}, backend)
    assert r.rerenders == 3  # at the second and third holes, and at the end (the last user turn is earlier then)
    answers = [r["ANSWER"]]  # (the last); the others from the prompts
    texts = [t for _, t, _ in seen]
    for k, text in enumerate(texts):
        assert text.endswith("(latest)<|im_end|>\n<|im_start|>assistant\n")
        assert text.count("(latest)") == 1  # never an earlier turn as it was rendered before
        assert text == tok.apply_chat_template(_parse(text), tokenize=False, add_generation_prompt=True)
    assert r.prompt == tok.apply_chat_template(_parse(r.prompt), tokenize=False)
    assert answers[0] in r.prompt


def _parse(text: str) -> list[dict[str, str]]:
    """The messages of a rendering in the `<|im_start|>role\\ncontent<|im_end|>\\n` markup (without a marker)."""
    out = []
    for part in text.split("<|im_start|>")[1:]:
        role, _, rest = part.partition("\n")
        if not rest:
            continue  # the generation prompt
        content = rest[: rest.rindex("<|im_end|>")].removesuffix(" (latest)")
        out.append({"role": role, "content": content})
    return out


async def test_a_hole_inside_a_user_message(make_backend, tokenizer):
    backend = make_backend("llama")
    seen = spy(backend)
    r = await lmq.compile('''
"{:system} Write a question."
"{:user} Question:[Q]" where len(TOKENS(Q)) < 4
"{:assistant} [A]" where len(TOKENS(A)) < 4
''').run({}, backend)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Write a question."},
                                          {"role": "user", "content": "Question:X"}], tokenize=False)
    assert seen[0][1] == text[: text.index("X")]
    msgs = [{"role": "system", "content": "Write a question."}, {"role": "user", "content": "Question:" + r["Q"]},
            {"role": "assistant", "content": r["A"]}]
    assert r.prompt == tokenizer.apply_chat_template(msgs, tokenize=False) and r.rerenders == 0


async def test_batched_and_uncached_chats_are_identical(make_backend):
    q = lmq.compile(CHAT)
    inputs = [{"questions": QUESTIONS[i:i + 2]} for i in range(3)]
    alone = [(await q.run(x, make_backend("llama", cache_budget=0))).prompt for x in inputs]
    backend = make_backend("llama")
    batched = await asyncio.gather(*(q.run(x, backend) for x in inputs))
    assert [r.prompt for r in batched] == alone


async def test_a_model_without_a_template_is_named(tiny_models, tokenizer):
    backend = HFBackend.from_model(tiny_models["llama"], with_template(None, None), name="tiny-no-template")
    with pytest.raises(lmq.LMQCompileError, match="tiny-no-template.*no chat template"):
        await lmq.compile(CHAT).run({"questions": ["hi"]}, backend)


async def test_text_before_any_role_fails_that_call_only(make_backend):
    backend = make_backend("llama")
    bad = lmq.compile('"Preamble"\n"{:user} hi"\n"{:assistant} [A]" where len(TOKENS(A)) < 3')
    good = lmq.compile(CHAT)
    results = await asyncio.gather(bad.run({}, backend), good.run({"questions": ["hi"]}, backend),
                                   return_exceptions=True)
    assert isinstance(results[0], lmq.LMQRuntimeError) and "line 1" in str(results[0])
    assert isinstance(results[1], lmq.Result)


async def test_a_template_that_refuses_the_conversation_fails_that_call(tiny_models):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    backend = HFBackend.from_model(tiny_models["llama"], with_template(None, strict), name="tiny-strict")
    with pytest.raises(lmq.LMQRuntimeError, match=r"chat template refuses the conversation \(system, user\).*"
                                                  r"no system role"):
        await lmq.compile(CHAT).run({"questions": ["hi"]}, backend)
    assert backend.stats().pinned_nodes == 0


@pytest.mark.parametrize("source,message", [
    ('"{:robot} hi"', "unknown role"),
    ('"{:user} hi {:assistant} [A]"', "must start its prompt string"),
    ('"hi " "{:user} there"', "must start its prompt string"),
])
def test_bad_role_tags(source, message):
    with pytest.raises(lmq.LMQSyntaxError, match=message) as e:
        lmq.compile(source)
    assert e.value.line == 1 and e.value.column > 1


async def test_beam_over_a_chat(make_backend):
    backend = make_backend("llama")
    results = await lmq.compile('''
beam(n=2)
    "{:user} Say hi."
    "{:assistant} [A]" where len(TOKENS(A)) < 3
''').run({}, backend)
    assert len(results) == 2
    assert all(r.prompt.startswith("<|im_start|>system\n") and r.prompt.endswith("<|im_end|>\n") for r in results)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_a_chat_against_an_independent_reference(zoo, tokenizer, family):
    """A context-sensitive model's chat with roles, against transformers alone: each turn's template text
    (what the rendering adds) encoded, then greedy tokens to the first special token."""
    from support.models import greedy, special_ids

    r = await lmq.compile(CHAT).run({"questions": QUESTIONS[:3]}, zoo.backend(family))
    model, stop = zoo.reference(family), special_ids(tokenizer)
    ids, text, answer = [], "", ""
    messages = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith(text)
        ids += tokenizer.encode(rendered[len(text):], add_special_tokens=False)
        out = greedy(model, ids, 5, stop)
        ids += out
        answer = tokenizer.decode(out)
        text = rendered + answer
        messages.append({"role": "assistant", "content": answer})
    assert r["ANSWER"] == answer
    assert r.prompt == tokenizer.apply_chat_template(messages, tokenize=False)
