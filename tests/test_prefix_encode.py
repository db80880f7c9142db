"""Exact tokenization with prefix reuse (`runtime/prefix_encode.py`): the ids are the tokenizer's own for
every text, whatever follows a shared prefix; tokenizers the rule does not describe are tokenized whole."""
from __future__ import annotations

import random

import pytest

from lmq_backend.runtime import prefix_encode
from lmq_backend.runtime.prefix_encode import PrefixEncoder
from lmq_backend.runtime.vocab import VocabIndex

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
    from conftest import llama_style_tokenizer  # SentencePiece style: a normalizer adds "▁"

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
