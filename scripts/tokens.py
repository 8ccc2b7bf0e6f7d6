#!/usr/bin/env python
"""How a text splits into tokens: each piece and its id, characters per token, and what a leading space or a
change of case does to a word's ids. Uses the default model's tokenizer (only the tokenizer is read: no
weights are loaded).

    python scripts/tokens.py --text "The capital of France is Paris."
    python scripts/tokens.py --text "The capital of France is Paris." --word Paris --json

(Named tokens.py, not tokenize.py: that name would shadow the standard library's `tokenize`, which pdb imports.)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyllm.tokenizer import Tokenizer  # noqa: E402


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of a GGUF file (from its metadata) or of a Hugging Face directory (tokenizer.json)."""
    from tinyllm.gguf import GGUFError, GGUFFile
    if path is None:
        from tinyllm import hub
        path = hub.ensure_default_model()
    path = Path(path)
    try:
        if path.is_dir():
            return Tokenizer.from_tokenizer_json(path / "tokenizer.json")
        return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    except (GGUFError, KeyError, ValueError, OSError) as e:
        print(f"tokens.py: error: cannot read a tokenizer from {path}: {e}", file=sys.stderr)
        sys.exit(2)


def piece(tok: Tokenizer, token_id: int) -> str:
    """A token's bytes as text: spaces as '␣', newlines as '\\n', bytes that are not whole UTF-8 as \\xNN."""
    text = tok.id_to_bytes(token_id).decode("utf-8", errors="backslashreplace")
    return text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")


def split(tok: Tokenizer, text: str) -> dict:
    ids = tok.encode(text)
    return dict(text=text, ids=ids, pieces=[piece(tok, i) for i in ids])


def word_variants(word: str) -> list[str]:
    """The word as written, after a space, and in other cases: each one a different input to the model."""
    forms = [word, word.lower(), word.capitalize(), word.upper()]
    return list(dict.fromkeys(f for w in dict.fromkeys(forms) for f in (w, " " + w)))


def report(tok: Tokenizer, text: str, word: str | None) -> dict:
    out = split(tok, text)
    out["characters"], out["tokens"] = len(text), len(out["ids"])
    out["characters_per_token"] = len(text) / len(out["ids"]) if out["ids"] else 0.0
    if word is None:                                   # the text's last word
        words = re.findall(r"\w+", text)
        word = words[-1] if words else None
    out["word"] = word
    out["variants"] = [split(tok, v) for v in word_variants(word)] if word else []
    return out


def show(rep: dict) -> str:
    lines = [f"text: {rep['text']!r}",
             f"{rep['characters']} characters, {rep['tokens']} tokens: {rep['characters_per_token']:.2f} characters "
             f"per token", "", f"{'#':>4}  {'id':>6}  piece"]
    lines += [f"{i:>4}  {tid:>6}  {p}" for i, (tid, p) in enumerate(zip(rep["ids"], rep["pieces"]))]
    if rep["variants"]:
        lines += ["", f"the same word, with and without a leading space, in other cases (␣ = space):"]
        width = max(len(repr(v["text"])) for v in rep["variants"])
        lines += [f"  {v['text']!r:<{width}}  ids {v['ids']}  pieces {' | '.join(v['pieces'])}"
                  for v in rep["variants"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="the text to tokenize")
    parser.add_argument("--word", help="the word whose variants to show (default: the text's last word)")
    parser.add_argument("--model", help="a .gguf file or Hugging Face directory (default: the default model)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    if not args.text:
        parser.error("--text is empty: give some text to tokenize")
    rep = report(load_tokenizer(args.model), args.text, args.word)
    print(json.dumps(rep, ensure_ascii=False, indent=1) if args.json else show(rep))


if __name__ == "__main__":
    main()
