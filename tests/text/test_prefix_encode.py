"""Exact tokenization with prefix reuse (`text/prefix_encode.py`): the ids are the tokenizer's own for
every text, whatever follows a shared prefix; tokenizers the rule does not describe are tokenized whole."""
from __future__ import annotations

import random

import pytest

from lmq_backend.text import prefix_encode
from lmq_backend.text.prefix_encode import PrefixEncoder
from lmq_backend.text.vocab import VocabIndex

ALPHABET = ["a", "b", "Review", " the", "'ll", "'s", " ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "7", "123456",
            "é", "e\u0301", "ß", "中文", ".", "!?", ":", "<|im_start|>", "<|im_end|>", "😀"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def check_exact(tokenizer, texts: list[str]) -> PrefixEncoder:
    vocab = VocabIndex(tokenizer, len(tokenizer))
    encoder = PrefixEncoder.for_tokenizer(tokenizer, vocab.n_bytes)
    assert encoder is not None
    for text in texts:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text[-80:])
    return encoder


def shared_prefix_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = "".join(f"Line {i}: {random_text(rng, 12)}\n" for i in range(60))
    texts = []
    for _ in range(150):
        # cut the shared prefix anywhere, then anything: right after a newline, inside a word, at a space
        cut = rng.choice([len(prefix), len(prefix) - 1, rng.randrange(prefix_encode.MIN_TEXT, len(prefix))])
        texts.append(prefix[:cut] + random_text(rng, rng.randint(0, 40)))
    return texts


def diverging_texts(seed: int) -> list[str]:
    """Texts sharing a whitespace-dense base up to a random point, then anything: stored cuts are hit by
    texts that diverge right after them (after a newline, before more whitespace)."""
    rng = random.Random(seed)
    base = random_text(rng, 1500)
    near = [c + d for c in prefix_encode._cuts(base) for d in (-1, 0, 1, 2) if c + d >= prefix_encode.MIN_TEXT]
    return [base[:rng.choice(near) if near and rng.random() < 0.7 else rng.randrange(prefix_encode.MIN_TEXT, len(base))]
            + random_text(rng, rng.randint(0, 30)) for _ in range(300)]


@pytest.mark.parametrize("seed", range(3))
def test_ids_identical_for_texts_diverging_anywhere(tokenizer, seed):
    check_exact(tokenizer, diverging_texts(seed))
    check_exact(llama3_style_tokenizer(), diverging_texts(seed))


@pytest.mark.parametrize("seed", range(3))
def test_smollm2_tokenizer_ids_identical_with_prefix_reuse(tokenizer, seed):
    encoder = check_exact(tokenizer, shared_prefix_texts(seed))
    assert encoder.hits > 100  # the prefix was reused, not tokenized again


@pytest.mark.parametrize("seed", range(2))
def test_cuts_found_past_a_recent_key_are_the_cuts_of_the_whole_text(tokenizer, seed):
    """The search resumes after a key found before; the cuts must be those of a search from the start."""
    encoder = check_exact(tokenizer, shared_prefix_texts(seed) + diverging_texts(seed))
    assert encoder._recent
    for text in shared_prefix_texts(seed + 10) + diverging_texts(seed):
        assert encoder._cuts_of(text) == prefix_encode._cuts(text)
        encoder.encode(text)


def llama3_style_tokenizer():
    """A byte-level BPE with Llama-3's split expression and digit groups, trained here on a small text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [random_text(rng, 200) for _ in range(300)]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|im_start|>", "<|im_end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.mark.parametrize("seed", range(2))
def test_llama3_style_split_tokenizer_ids_identical(seed):
    encoder = check_exact(llama3_style_tokenizer(), shared_prefix_texts(seed))
    assert encoder.hits > 100


def test_tokenizers_outside_the_rule_are_tokenized_whole():
    from support.tiny import llama_style_tokenizer  # SentencePiece style: a normalizer adds "▁"

    assert not PrefixEncoder.supports(llama_style_tokenizer())
    tok = llama3_style_tokenizer()
    from tokenizers import normalizers

    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert not PrefixEncoder.supports(tok)


def test_a_whitespace_run_before_an_added_token_is_no_cut(tokenizer):
    """"\\n\\n\\n" before an added token is one piece (the added token splits the text first) and before "<" two:
    a cut after such a run, stored from the first text, would give the second the wrong ids."""
    base = "".join(f"Line {i}: some words here.\n" for i in range(60)) + "a" * 300
    check_exact(tokenizer, [base + "\n\n\n<|im_start|>user\n" + "x" * 200, base + "\n\n\n< the rest " + "y" * 200])


WORDS = [" coffee", " week.", " (visit", " 5)", "Summary:", " (", " x", " é", " -", " --", " 'll", " s", " the", " 12",
         "\nSummary:", ")\n", " x\n", "\n", "y"]


def word_texts(seed: int, n: int = 400) -> list[str]:
    """Short texts (every one tokenized by its words) of words recurring in every context: mostly words a
    space apart, a fifth anything of ALPHABET (whitespace runs, digits, added tokens, other scripts)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS if rng.random() < 0.8 else ALPHABET) for _ in range(rng.randint(1, 40)))
            for _ in range(n)]


def counting(encoder: PrefixEncoder) -> list[str]:
    """The texts the encoder hands the tokenizer from now on."""
    seen, encode = [], encoder._encode
    encoder._encode = lambda text: (seen.append(text), encode(text))[1]
    return seen


@pytest.mark.parametrize("seed", range(3))
def test_words_kept_give_the_tokenizers_ids_in_any_context(tokenizer, seed):
    """A word's ids are kept by its text and reused wherever it recurs (after a letter, a digit, punctuation,
    an added token, at a text's start or end): every text's ids stay the tokenizer's own."""
    for tok in (tokenizer, llama3_style_tokenizer()):
        encoder = check_exact(tok, word_texts(seed))
        assert len(encoder._words) > 100
        sent = counting(encoder)
        texts = word_texts(seed + 100)
        check_exact_with(encoder, tok, texts)
        # words seen before are not tokenized again (a word cut needs ASCII on both sides: " é" joins the word
        # before it, " x\n the" is one word, so half the characters are still new)
        assert sum(map(len, sent)) < 0.6 * sum(map(len, texts))
        # new words go to the tokenizer joined where they meet at a word cut: whatever was sent splits into
        # words that are kept now (two joined where they do not meet would be one word, never kept)
        assert all(w in encoder._words for t in sent for w in encoder.split(t))


def check_exact_with(encoder: PrefixEncoder, tokenizer, texts: list[str]) -> None:
    for text in texts:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text[-80:])


def test_a_prompt_tail_after_a_stored_prefix_is_tokenized_by_its_words(tokenizer):
    """W1's calls: the few-shot block from the stored prefix, the new review by its words; the tokenizer
    sees only words it has not seen before."""
    shots = "".join(f"Review: review number {i} was fine.\nSentiment: positive\n\n" for i in range(40))
    calls = [f"{shots}Review: the coffee was cold (visit {i})\nSummary:" for i in range(20)]
    encoder = check_exact(tokenizer, calls)
    sent = counting(encoder)
    check_exact_with(encoder, tokenizer, calls[1:6])
    assert sent == []  # every word seen before


def test_a_new_long_prompt_of_seen_words_is_tokenized_by_its_words(tokenizer):
    """A long prompt with no stored prefix (a new document, the shots in another order) is put together from
    the words kept, the same ids as the tokenizer's, its prefixes stored for the next call."""
    rng = random.Random(0)
    shots = [f"Review: review number {i} was fine.\nSentiment: positive\n\n" for i in range(40)]
    first = "".join(shots)
    encoder = check_exact(tokenizer, [first])
    sent = counting(encoder)
    reordered = [f"Task {k}:\n" + "".join(rng.sample(shots, len(shots))) for k in range(3)]
    check_exact_with(encoder, tokenizer, reordered)
    assert encoder.misses == 4
    # only the new words of the first line went to the tokenizer: "Task" and ":\nReview:" (the numbers' digits were
    # seen: a number is cut into its digits, " 0" and then ":\nReview:")
    assert [w for t in sent for w in encoder.split(t)] == ["Task", ":\nReview:"]
    check_exact_with(encoder, tokenizer, [reordered[0] + "Review: again"])
    assert encoder.hits == 1  # the new prompt's prefix was stored


@pytest.mark.parametrize("token", [
    {"content": "New York"},                    # an added token holding a space spans a word cut
    {"content": "<x>", "rstrip": True},         # one taking the whitespace after it too
])
def test_added_tokens_spanning_a_word_cut_turn_words_off(tokenizer, token):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.add_tokens([AddedToken(token["content"], rstrip=token.get("rstrip", False), normalized=False)])
    texts = [f"I saw New York. <x> and <x>  y{i} New Yorker" for i in range(5)]
    assert tok.encode(texts[0], add_special_tokens=False) != [
        t for w in prefix_encode._WORD_CUT.split(texts[0]) for t in tok.encode(w, add_special_tokens=False)]
    encoder = check_exact(tok, texts + word_texts(0, 50))
    assert encoder._words is None


def test_words_kept_stay_bounded(tokenizer, monkeypatch):
    """Past MAX_WORDS the kept words are dropped and kept again as they recur, the ids unchanged."""
    monkeypatch.setattr(prefix_encode, "MAX_WORDS", 40)
    encoder = check_exact(tokenizer, word_texts(3, 200))
    assert 0 < len(encoder._words) <= 40


def test_new_words_ids_are_split_where_their_bytes_end():
    """The new words' ids, tokenized in one call, cut at the words' byte ends (`PrefixEncoder._split`): a word's
    ids are those whose bytes end within it; ids that overshoot a word's end, run short of the last, or trail
    past it are no split (then the text is tokenized whole)."""
    # token id -> bytes it spells: 0 none (as a special token in values), 1 one byte, 2 two, 3 three
    encoder = PrefixEncoder(lambda text: [], [0, 1, 2, 3])
    assert encoder._split([2, 1, 3], [3, 3]) == [(2, 1), (3,)]
    assert encoder._split([1, 1, 1], [1, 1, 1]) == [(1,), (1,), (1,)]
    assert encoder._split([2, 0, 1], [2, 1]) == [(2,), (0, 1)]        # a zero-byte id goes with the word it starts
    assert encoder._split([3, 3], [2, 4]) is None                     # overshoots the first word's end
    assert encoder._split([2, 1], [2, 2]) is None                     # short of the last word
    assert encoder._split([2, 2, 0], [2, 2]) is None                  # an id past the last word
    assert encoder._split([2, 2, 1], [2, 2]) is None
    assert encoder._split([], [1]) is None
    assert encoder._split([], []) == [] and encoder._split([0], []) is None


def test_numbers_are_tokenized_by_their_digits(tokenizer):
    """The default tokenizer spells each digit alone (`_digits_alone`): a number is cut into its digits, so the
    calls of a counter (a new number each) send nothing to the tokenizer once its digits were seen, and every
    text's ids stay the tokenizer's own, numbers anywhere (after letters, spaces, punctuation, other digits)."""
    assert prefix_encode._digits_alone(prefix_encode._spec(tokenizer))
    assert not prefix_encode._digits_alone(prefix_encode._spec(llama3_style_tokenizer()))  # (it merges digits)
    shots = "".join(f"Review: review number {i} was fine.\nSentiment: positive\n\n" for i in range(40))
    calls = [f"{shots}Review: the coffee was cold (visit {i:06d}, x{i}y, {i}.5%)\nSummary:" for i in range(100, 130)]
    encoder = check_exact(tokenizer, calls[:2])
    sent = counting(encoder)
    check_exact_with(encoder, tokenizer, calls[2:])
    assert sent == []
    rng = random.Random(4)
    pieces = ["7", "123", "0", " 0", "  1", "x9", "1st", "(", ")", ".", ",", "'s", " ", "\n", "é", "\u0301", "-", "a"]
    check_exact_with(encoder, tokenizer, ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
                                          for _ in range(2000)])
