"""Pre-tokenization: how each vocab's text is cut into words before BPE, as regexes (one, or several in stages).

BPE never merges across two words, so this step decides what a token can span. Each pattern below matches every
character of any text, so no text is lost. The names of `GGUF_PRETOKENIZERS` are GGUF's `tokenizer.ggml.pre`
values (llama.cpp's llama-vocab.cpp groups them the same way); `pattern_from_hf_pre_tokenizer` reads the same
choice from a Hugging Face tokenizer.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import regex

# --- pre-tokenizer patterns --------------------------------------------------------------------------------
# Each pattern matches every character of any text (letters, numbers, whitespace and everything else each have
# an alternative), so `findall` loses nothing: the words it returns concatenate back to the text.

# GPT-2: contractions, letter runs, number runs and symbol runs (each with one optional leading space), then
# whitespace. `\s+(?!\S)` leaves the last space of a run to start the next word: "a   b" -> "a", "  ", " b".
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# SmolLM2 (GGUF pre "smollm", HF Digits(individual_digits=True) then ByteLevel): every number character is split
# off alone first, then the GPT-2 pattern runs on the pieces between them. Written here as one regex: `\p{N}`
# takes one number character; ` ?\p{N}+` is gone; and a whitespace run just before a number ends a piece in the
# two-step form, so it stays whole (`\s+(?=\p{N})`) instead of giving its last space away.
# Example: "a  2" -> "a", "  ", "2" (ids 81, 256, 34).
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""

# Llama 3 (GGUF pre "llama-bpe"): case-insensitive contractions, numbers in groups of up to 3 digits, newlines
# kept apart from other whitespace, any one non-letter may lead a letter run.
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2: Llama 3's pattern with every digit alone.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# Qwen3.5: Qwen2's pattern with combining marks (\p{M}) kept inside letter runs instead of standing alone, so
# "é" written as e + U+0301 stays one word.
QWEN35_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                  r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# --- pre-tokenizers made of several regexes ---------------------------------------------------------------
# Some models split in stages (HF tokenizers' Sequence of Split(behavior="Isolated") steps): the first regex
# cuts the text into its matches and the gaps between them, and every next regex cuts each of those pieces
# again. A later regex never sees across a cut made by an earlier one. See `split_in_stages`.
# The *_STAGES constants are the stages as the models publish them; the *_FUSED ones, which tinyllm runs, give
# the same words (tests/test_tokenizer.py checks it) with a first stage that cuts word-sized pieces: the
# tokenizer caches the result per first-stage piece, and pieces the size of words repeat.

# Falcon: runs of punctuation first (HF Punctuation: Unicode \p{P} plus the ASCII symbols $+<=>^`|~), then the
# GPT-2 regex, then every run of three ASCII digits alone ("3333" -> "333", "3"). HF also splits number runs
# off between those two steps; that changes nothing, because no Falcon merge joins a number character to any
# other character (tests/test_tokenizer_suite.py checks it), so it is left out, as llama.cpp does.
FALCON_PUNCTUATION = r"""\p{P}$+<=>^`|~"""
FALCON_STAGES = (rf"""[{FALCON_PUNCTUATION}]+""", GPT2_PATTERN, r"""[0-9]{3}""")
# Fused: GPT-2's regex with punctuation runs as one more alternative; its symbol runs exclude punctuation, and a
# whitespace run just before punctuation stays whole (in the staged form it ends a piece), as in SMOLLM_PATTERN.
FALCON_FUSED = (rf"""[{FALCON_PUNCTUATION}]+| ?\p{{L}}+| ?\p{{N}}+| ?[^\s\p{{L}}\p{{N}}{FALCON_PUNCTUATION}]+"""
                rf"""|\s+(?=[{FALCON_PUNCTUATION}])|\s+(?!\S)|\s+""", r"""[0-9]{3}""")

CJK_HANGUL_RUN = r"""[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"""   # as written in the models' tokenizer.json
DEEPSEEK_CODER_STAGES = (r"""[\r\n]""", r"""\s?\p{L}+""", r"""\s?\p{P}+""", CJK_HANGUL_RUN, r"""\p{N}""")
# Fused: the newline and letter stages in one regex; its optional leading whitespace may not be a newline, since
# the newline stage has cut those off already.
DEEPSEEK_CODER_FUSED = (r"""[\r\n]|[^\S\r\n]?\p{L}+""", *DEEPSEEK_CODER_STAGES[2:])

# DeepSeek LLM: as DeepSeek Coder, but "letters" are an explicit list of cased-alphabet ranges (Latin, Greek,
# Cyrillic, Armenian, Georgian, Cherokee, Glagolitic, Coptic, ... copied as code points from the model's
# tokenizer.json: written out as characters, several would change under Unicode normalization), "punctuation"
# is ASCII and full-width punctuation, trailing whitespace is cut off, and numbers are split off in runs.
DEEPSEEK_LLM_LETTERS = (
    r"A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    r"\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    r"\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    r"\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    r"\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    r"\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    r"\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    r"\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
DEEPSEEK_LLM_STAGES = (r"""[\r\n]""", rf"""\s?[{DEEPSEEK_LLM_LETTERS}]+""",
                       r"""\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+""", r"""\s+\Z""",
                       CJK_HANGUL_RUN, r"""\p{N}+""")
DEEPSEEK_LLM_FUSED = (rf"""[\r\n]|[^\S\r\n]?[{DEEPSEEK_LLM_LETTERS}]+""", *DEEPSEEK_LLM_STAGES[2:])   # as Coder's

# GGUF `tokenizer.ggml.pre` -> (pre-tokenizer, ignore_merges): one regex, or a tuple of regexes applied in
# stages. The names and groupings follow llama.cpp (llama-vocab.cpp).
# ignore_merges: a word that is itself in the vocab is taken whole, without running the merges (Llama 3 does).
GGUF_PRETOKENIZERS: dict[str, tuple[str | tuple[str, ...], bool]] = {
    "gpt2": (GPT2_PATTERN, False), "gpt-2": (GPT2_PATTERN, False), "mpt": (GPT2_PATTERN, False),
    "smollm": (SMOLLM_PATTERN, False), "starcoder": (SMOLLM_PATTERN, False), "refact": (SMOLLM_PATTERN, False),
    "command-r": (SMOLLM_PATTERN, False),
    "llama-bpe": (LLAMA3_PATTERN, True), "llama3": (LLAMA3_PATTERN, True),
    "qwen2": (QWEN2_PATTERN, False), "qwen35": (QWEN35_PATTERN, False),
    "falcon": (FALCON_FUSED, False),
    "deepseek-coder": (DEEPSEEK_CODER_FUSED, False), "deepseek-llm": (DEEPSEEK_LLM_FUSED, False),
}


def split_in_stages(text: str, stages: Sequence[regex.Pattern]) -> list[str]:
    r"""Pre-tokenize with regexes in stages: each stage cuts every piece into its matches and the gaps between.

    Each compiled stage must have one capture group around the whole regex, so that `split` keeps the matches.
    Example, DeepSeek Coder's stages on "ab12\ncd": "[\r\n]" -> "ab12", "\n", "cd"; "\s?\p{L}+" -> "ab", "12",
    "\n", "cd"; ...; "\p{N}" -> "ab", "1", "2", "\n", "cd". No text is lost: the pieces concatenate to `text`.
    """
    pieces = [text]
    for stage in stages:
        pieces = [part for piece in pieces for part in stage.split(piece) if part]
    return pieces


def pattern_from_hf_pre_tokenizer(pre: Mapping[str, Any] | None, path: Path) -> str:
    """The one regex equivalent to an HF tokenizer.json pre_tokenizer; ValueError naming what is unsupported.

    Supported: ByteLevel (GPT-2); Sequence[Digits(individual_digits), ByteLevel] (SmolLM2);
    Sequence[Split(Llama 3 or Qwen2 regex, Isolated), ByteLevel(use_regex=False)] (Llama 3, Qwen2).
    """
    steps = list(pre.get("pretokenizers", [])) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise ValueError(f"{path}: pre_tokenizer {[s.get('type') for s in steps]} is not supported: the last step "
                         f"must be ByteLevel")
    byte_level, rest = steps[-1], steps[:-1]
    if byte_level.get("add_prefix_space"):
        raise ValueError(f"{path}: ByteLevel(add_prefix_space=True) is not supported")
    use_regex = byte_level.get("use_regex", True)
    kinds = [s.get("type") for s in rest]
    if kinds == [] and use_regex:
        return GPT2_PATTERN
    if kinds == ["Digits"] and rest[0].get("individual_digits") and use_regex:
        return SMOLLM_PATTERN
    if kinds == ["Split"] and not use_regex:
        split = rest[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        known = {LLAMA3_PATTERN: "Llama 3", QWEN2_PATTERN: "Qwen2"}
        if pattern in known and split.get("behavior") == "Isolated" and not split.get("invert"):
            return pattern
        raise ValueError(f"{path}: Split pre-tokenizer with pattern {pattern!r} (behavior "
                         f"{split.get('behavior')}) is not supported; known patterns: Llama 3, Qwen2")
    raise ValueError(f"{path}: pre_tokenizer {kinds + ['ByteLevel']} (use_regex={use_regex}) is not supported")
