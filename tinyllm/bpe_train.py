"""Training a byte-level BPE vocabulary from text: a pure function that returns merges.

BPE training starts from the 256 byte values as tokens and repeats one step: count every adjacent pair of
tokens in the corpus, and merge the most frequent pair into a new token. The list of merges, in the order they
were learned, is the tokenizer: encoding replays them (lowest rank first, see tokenizer.bpe).

As in GPT-2, the text is first split into words with the pre-tokenizer regex, and pairs are counted inside words
only, so a token never spans " dog." or "cat dog". Each distinct word is stored once with its count.

Not here: special tokens, vocabulary pruning, the word-frequency cut-offs of production trainers.
"""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import regex

from tinyllm.tokenizer import GPT2_PATTERN, Tokenizer, merge_pair


def train_bpe(text: str, vocab_size: int, pattern: str = GPT2_PATTERN) -> list[tuple[int, int]]:
    """Learn `vocab_size - 256` merges from `text`. Merge k joins tokens (left, right) into the new token 256 + k.

    Ids 0-255 are the single bytes. The most frequent adjacent pair wins each step; ties go to the smaller
    pair (compared as (left, right)), so training is deterministic. Training stops early when no pair occurs
    twice: merging a pair seen once teaches nothing general. Build a tokenizer from the result with
    `Tokenizer.from_merges(merges, pattern)` (or call `train_tokenizer`).

    >>> train_bpe("low low low lower", 256 + 3)   # words "low" x1, " low" x2, " lower" x1
    [(108, 111), (256, 119), (32, 257)]

    That is 256 = b"l" + b"o" (4 times, tied with "ow" but smaller), 257 = b"lo" + b"w", 258 = b" " + b"low".

    Cost: each step only revisits the words that contain the merged pair (an index pair -> words), and the
    most frequent pair comes from a heap, so a step costs about the size of the words it changes rather than
    the whole corpus.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (one token per byte), got {vocab_size}")
    word_counts = Counter(regex.findall(pattern, text))
    words = [list(word.encode("utf-8")) for word in word_counts]   # each distinct word as a list of token ids
    freqs = list(word_counts.values())                              # how often each word occurs

    pair_counts: Counter[tuple[int, int]] = Counter()               # pair -> occurrences in the corpus
    words_with: defaultdict[tuple[int, int], set[int]] = defaultdict(set)   # pair -> indices of words having it
    for w, (ids, freq) in enumerate(zip(words, freqs)):
        for pair in zip(ids, ids[1:]):
            pair_counts[pair] += freq
            words_with[pair].add(w)

    # Max-heap of (-count, pair). Counts change as we merge; instead of updating entries in place we push a new
    # entry on every change and skip popped entries whose count is out of date ("lazy deletion").
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    while 256 + len(merges) < vocab_size and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue                                  # stale heap entry
        if -neg_count < 2:
            break                                     # every remaining pair occurs only once
        new_id = 256 + len(merges)
        merges.append(pair)

        # Only the words containing `pair` change: take their old pairs out of the counts, merge, put the new in.
        changed: set[tuple[int, int]] = set()
        for w in words_with.pop(pair):
            ids, freq = words[w], freqs[w]
            for old in zip(ids, ids[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            ids = words[w] = merge_pair(ids, pair, new_id)
            for new in zip(ids, ids[1:]):
                pair_counts[new] += freq
                words_with[new].add(w)   # stale members (pair no longer in the word) are harmless: net change 0
                changed.add(new)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
    return merges


def train_tokenizer(text: str, vocab_size: int, pattern: str = GPT2_PATTERN) -> Tokenizer:
    """Train merges on `text` and return a Tokenizer that encodes with them (the same BPE code as real models)."""
    return Tokenizer.from_merges(train_bpe(text, vocab_size, pattern), pattern)
