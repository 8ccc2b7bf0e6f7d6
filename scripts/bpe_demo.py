"""Train a tiny byte-level BPE and watch what it learned: frequent words become one token, rare strings shatter.

    python scripts/bpe_demo.py                       # the built-in toy corpus
    python scripts/bpe_demo.py --vocab-size 300 --words " low" " lowest" " xyzzy"

Prints the merges in the order they were learned, then how a few words encode. A word seen often in training
("low", "newest") comes out as one token; a word that shares only pieces with the corpus ("lowest",
"tokenizing") reuses those pieces; a word never seen ("xyzzy") falls apart into single bytes.
"""
from __future__ import annotations

import argparse
from collections import Counter

import regex

from tinyllm.bpe_train import train_bpe
from tinyllm.tokenizer import GPT2_PATTERN, Tokenizer

CORPUS = ("low low low low lower lower newest newest newest widest widest "
          "tokenization tokens tokenizer token")
# Leading spaces matter: the GPT-2 pre-tokenizer keeps a word's space in front of it (" low"), and most words in
# running text follow a space, so that is the form the corpus teaches.
WORDS = [" low", " lower", " lowest", " newest", " widest", " token", " tokenizing", " xyzzy"]


def show(token: bytes) -> str:
    """A token as readable text: spaces shown as '␣', other bytes as Python would write them."""
    return repr(token)[2:-1].replace(" ", "␣")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=CORPUS, help="training text")
    parser.add_argument("--vocab-size", type=int, default=256 + 40, help="256 bytes + the number of merges")
    parser.add_argument("--words", nargs="+", default=WORDS, help="words to encode after training")
    args = parser.parse_args()

    merges = train_bpe(args.corpus, args.vocab_size)
    tok = Tokenizer.from_merges(merges)
    print(f"corpus: {args.corpus!r}")
    print(f"learned {len(merges)} merges (asked for up to {args.vocab_size - 256}; training stops when no pair "
          f"occurs twice):")
    for k, (left, right) in enumerate(merges):
        print(f"  {256 + k:4d} = {show(tok.id_to_bytes(left)):>10} + {show(tok.id_to_bytes(right)):<10}"
              f"-> {show(tok.id_to_bytes(256 + k))}")

    seen = Counter(regex.findall(GPT2_PATTERN, args.corpus))   # how often each word occurs in the corpus
    print(f"\n{'word':<14}{'in corpus':>10}{'tokens':>8}  pieces")
    for word in args.words:
        ids = tok.encode(word)
        pieces = " | ".join(show(tok.id_to_bytes(i)) for i in ids)
        print(f"{show(word.encode()):<14}{seen[word]:>10}{len(ids):>8}  {pieces}")


if __name__ == "__main__":
    main()
