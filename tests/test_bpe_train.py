"""BPE training: the incremental trainer equals a recount-everything trainer, and encoding replays training."""
from __future__ import annotations

from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.bpe_train import train_bpe, train_tokenizer
from tinyllm.tokenizer import GPT2_PATTERN, SMOLLM_PATTERN, Tokenizer, merge_pair

CORPUS = ("low low low low lower lower newest newest newest widest widest "
          "tokenization tokens tokenizer token")


def naive_train(text: str, vocab_size: int, pattern: str = GPT2_PATTERN):
    """The definition of BPE training, with no cleverness: recount every pair of every word at every step.

    Returns the merges and each distinct word's final tokens.
    """
    counts = Counter(regex.findall(pattern, text))
    words = {word: list(word.encode("utf-8")) for word in counts}
    merges = []
    while 256 + len(merges) < vocab_size:
        pairs = Counter()
        for word, ids in words.items():
            for pair in zip(ids, ids[1:]):
                pairs[pair] += counts[word]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))   # most frequent; ties: smallest pair
        if pairs[best] < 2:
            break
        merges.append(best)
        words = {word: merge_pair(ids, best, 255 + len(merges)) for word, ids in words.items()}
    return merges, words


def test_docstring_example():
    assert train_bpe("low low low lower", 256 + 3) == [(108, 111), (256, 119), (32, 257)]


def test_vocab_size_bounds():
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe("abc", 255)
    assert train_bpe("abc abc", 256) == []
    assert train_bpe("", 1000) == []


def test_stops_when_no_pair_repeats():
    merges = train_bpe(CORPUS, 256 + 1000)
    assert len(merges) == 22   # far fewer than asked: the toy corpus runs out of repeated pairs
    assert merges == naive_train(CORPUS, 256 + 1000)[0]


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab c\né1."), max_size=80), extra=st.integers(0, 40))
def test_incremental_trainer_equals_naive_trainer(text, extra):
    assert train_bpe(text, 256 + extra) == naive_train(text, 256 + extra)[0]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200), extra=st.integers(0, 30))
def test_incremental_trainer_equals_naive_trainer_on_any_text(text, extra):
    assert train_bpe(text, 256 + extra, SMOLLM_PATTERN) == naive_train(text, 256 + extra, SMOLLM_PATTERN)[0]


def test_merges_only_use_tokens_that_already_exist():
    merges = train_bpe(CORPUS * 3 + " the cat sat on the mat " * 5, 256 + 30)
    assert len(merges) == 30
    for k, (left, right) in enumerate(merges):
        assert left < 256 + k and right < 256 + k


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab c\né1.'s"), max_size=80), extra=st.integers(0, 40))
def test_encoding_a_training_word_replays_training(text, extra):
    """The encoder (tokenizer.bpe) applied to a training word gives exactly the tokens training ended with."""
    merges, final_words = naive_train(text, 256 + extra)
    tok = Tokenizer.from_merges(merges)
    for word, ids in final_words.items():
        assert tok.encode(word) == ids
    assert tok.decode(tok.encode(text)) == text


def test_frequent_words_become_one_token_rare_ones_shatter():
    tok = train_tokenizer(CORPUS, 256 + 100)
    assert len(tok.encode(" low")) == 1 and len(tok.encode(" newest")) == 1
    assert [tok.id_to_bytes(i) for i in tok.encode(" lowest")] == [b" low", b"est"]
    assert tok.encode(" xyzzy") == list(b" xyzzy")   # never seen: one token per byte
    assert tok.vocab_size == 256 + 22


def test_trained_tokenizer_handles_any_text():
    tok = train_tokenizer(CORPUS, 300)
    text = "naïve 日本 😀 low\x00\xff"
    assert tok.decode(tok.encode(text)) == text
    assert tok.unencodable_bytes == frozenset()
