"""Byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2 style): text <-> token ids.

Encoding runs four steps, each visible below:
  1. special tokens: text such as "<|im_start|>" is cut out first and becomes its one id (allow_special=False
     turns this off for control tokens, so user text can never forge one);
  2. pre-tokenization: a regex, chosen per model, splits the rest into words (SmolLM2: "Hi  42!" -> "Hi", "  ",
     "4", "2", "!"), or several regexes in stages (Falcon, DeepSeek); BPE never merges across two words;
  3. bytes: each word becomes its UTF-8 bytes, and each byte its single-byte token;
  4. BPE merges: repeatedly merge the adjacent pair whose merge was learned first (lowest rank), until no
     adjacent pair has a merge. The result for each word is cached, as text repeats words a lot.
Decoding concatenates the tokens' bytes and decodes them as UTF-8 (see `Tokenizer.decode` for the repair rule).

Unencodable bytes: a vocabulary may lack a token for some byte values (SmolLM2 lacks 21: the controls 0x04 0x06
0x13 0x14 0x16 0x1D, the lead bytes 0xF1 0xF2 of Unicode planes 4-11, and 0xC0 0xC1 0xF5-0xFF that valid UTF-8
never contains). Like HF tokenizers and llama.cpp, tinyllm drops such bytes silently before merging, so ids match
the reference; `Tokenizer.unencodable_bytes` lists them, and decode(encode(s)) == s holds exactly when s contains
none of them.

The GGUF pre-tokenizers known (`GGUF_PRETOKENIZERS`) are those of every byte-level BPE vocab in llama.cpp's
tokenizer suite, which tests/test_tokenizer_suite.py runs case by case.

Not here: SentencePiece and WordPiece tokenizers (Llama 2, Phi-3, BERT), normalizers (HF applies NFC for some of
these models; llama.cpp does not, nor does tinyllm), byte fallback, BPE dropout; training is in bpe_train.py.
"""
from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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

# GGUF token types (llama.cpp's llama_token_type). Control and user-defined tokens are matched in text as a whole.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The per-word cache is cleared when it holds more words than this (about 20-30 MB), so memory stays bounded.
WORD_CACHE_LIMIT = 200_000


# --- GPT-2's byte <-> character table ----------------------------------------------------------------------
def byte_level_alphabet() -> list[str]:
    """GPT-2's table of 256 printable characters, one per byte value: `alphabet[byte] -> char`.

    Vocab files (tokenizer.json, GGUF) store tokens as text, so GPT-2 gives every byte a visible character: the
    188 printable Latin-1 bytes stand for themselves, the other 68 (controls, space, 0x7F-0xA0, 0xAD) become
    chr(256), chr(257), ... in byte order. That is why a leading space shows as 'Ġ' (chr(256 + 32)) and a
    newline as 'Ċ' in vocab files. tinyllm undoes the table when loading and works on raw bytes after that.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, n_moved = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + n_moved))
            n_moved += 1
    return alphabet


def _byte_level_decoder() -> dict[str, int]:
    """The inverse table: char -> byte."""
    return {char: byte for byte, char in enumerate(byte_level_alphabet())}


def _byte_level_to_bytes(token: str, char_to_byte: Mapping[str, int]) -> bytes:
    """'Ġthe' -> b' the'. ValueError if `token` has a character outside GPT-2's table (not a byte-level vocab)."""
    try:
        return bytes(char_to_byte[char] for char in token)
    except KeyError as e:
        raise ValueError(f"token {token!r} has the character {e.args[0]!r}, which is not in GPT-2's byte-level "
                         f"alphabet: this vocab is not byte-level BPE") from None


# --- the BPE core (shared with bpe_train.py) ---------------------------------------------------------------
def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, scanning left to right.

    >>> merge_pair([5, 6, 6, 6], (6, 6), 9)      # leftmost occurrence first; occurrences never overlap
    [5, 9, 6]
    """
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def bpe(ids: list[int], ranks: Mapping[tuple[int, int], int], merged: Mapping[tuple[int, int], int]) -> list[int]:
    """Byte-pair encode one word: while some adjacent pair has a merge, apply the one with the lowest rank.

    `ranks[pair]` is the merge's position in the merges list (0 = learned first); `merged[pair]` the id it makes.
    Merging every occurrence of the best pair at once gives the same result as HF tokenizers' one-at-a-time
    priority queue (equal ranks mean the same pair, which both take leftmost first).
    """
    no_merge = float("inf")
    while len(ids) >= 2:
        pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, no_merge))   # lowest-rank adjacent pair
        if pair not in ranks:
            break                                                              # nothing left to merge
        ids = merge_pair(ids, pair, merged[pair])
    return ids


# --- the tokenizer -----------------------------------------------------------------------------------------
class Tokenizer:
    """Byte-level BPE tokenizer: `encode(text) -> ids`, `decode(ids) -> text`, built from data.

    Build it with `from_gguf_metadata`, `from_tokenizer_json` or `from_merges` (a trained BPE). The constructor
    takes the vocab as raw bytes, the file formats' GPT-2 byte-to-character encoding already undone:
      token_bytes:  token_bytes[id] is the bytes of token `id` (for added tokens: the UTF-8 of their text).
      merges:       (left_id, right_id, merged_id) in rank order: merges[0] is applied first.
      pattern:      the pre-tokenizer: one regex (see the *_PATTERN constants), or a tuple of regexes applied in
                    stages (the *_FUSED constants, see `split_in_stages`).
      added_tokens: text -> id of tokens matched as a whole in the input text before pre-tokenization.
      special_ids:  control tokens: decode(skip_special=True) drops them, and encode(allow_special=False) reads
                    their text as plain text. Added tokens that are not control tokens (user-defined: MPT's runs
                    of spaces) are always matched, as in llama.cpp and HF tokenizers.
      ignore_merges: a word that is itself a token is taken whole (Llama 3); otherwise merges decide.
      unreachable_ids: tokens that encode never produces (text that is not byte-level); decode still gives them.
    """

    def __init__(self, token_bytes: Sequence[bytes], merges: Iterable[tuple[int, int, int]],
                 pattern: str | tuple[str, ...], *,
                 added_tokens: Mapping[str, int] | None = None, special_ids: Iterable[int] = (),
                 bos_id: int | None = None, eos_id: int | None = None, chat_template: str | None = None,
                 ignore_merges: bool = False, unreachable_ids: Iterable[int] = ()):
        self._token_bytes = [bytes(b) for b in token_bytes]   # id -> bytes
        self._added = dict(added_tokens or {})                 # text -> id, matched whole in the input
        special_ids = frozenset(special_ids)
        vocab_size = len(self._token_bytes)
        for token_id in [*self._added.values(), *special_ids, bos_id, eos_id]:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocab (size {vocab_size})")
        self.special_ids = special_ids
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.ignore_merges = ignore_merges
        self.pattern = pattern
        if isinstance(pattern, str):
            self._words = regex.compile(pattern)
        else:   # stages: each regex in a capture group, so that split() keeps its matches as pieces
            self._words = None
            self._first_stage, *self._later_stages = [regex.compile(f"({stage})") for stage in pattern]

        # bytes -> id of ordinary tokens (used for the single-byte tokens and by ignore_merges).
        not_ordinary = set(self._added.values()).union(unreachable_ids)
        self._bytes_to_id: dict[bytes, int] = {}
        for token_id, data in enumerate(self._token_bytes):
            if token_id not in not_ordinary:
                self._bytes_to_id.setdefault(data, token_id)
        self._byte_ids = [self._bytes_to_id.get(bytes([b])) for b in range(256)]   # byte -> id, or None

        self._ranks: dict[tuple[int, int], int] = {}    # (left, right) -> rank (0 = merged first)
        self._merged: dict[tuple[int, int], int] = {}   # (left, right) -> id of the merged token
        for rank, (left, right, new) in enumerate(merges):
            if not all(0 <= t < vocab_size for t in (left, right, new)):
                raise ValueError(f"merge {rank} ({left}, {right}) -> {new} uses an id outside the vocab")
            self._ranks.setdefault((left, right), rank)
            self._merged.setdefault((left, right), new)

        # One regex for all added tokens, one for the user-defined ones alone (allow_special=False).
        self._added_re = _alternation(self._added)
        self._user_defined_re = _alternation(t for t, i in self._added.items() if i not in special_ids)
        self._cache: dict[str, tuple[int, ...]] = {}    # word -> its ids

    # --- constructors from files ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's metadata (`tokenizer.ggml.*` keys, `tokenizer.chat_template`)."""
        def get(key: str) -> Any:
            if key not in metadata:
                raise ValueError(f"GGUF metadata has no {key!r}: the file carries no (complete) tokenizer")
            return metadata[key]

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}: tinyllm implements only byte-level BPE ('gpt2'), "
                             f"not SentencePiece ('llama'), WordPiece ('bert') or others")
        pre = get("tokenizer.ggml.pre")
        if pre not in GGUF_PRETOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer tinyllm does not know; known: "
                             f"{', '.join(sorted(GGUF_PRETOKENIZERS))}")
        pattern, ignore_merges = GGUF_PRETOKENIZERS[pre]
        tokens: list[str] = get("tokenizer.ggml.tokens")
        types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"GGUF metadata has {len(tokens)} tokens but {len(types)} token types")

        char_to_byte = _byte_level_decoder()
        token_bytes, added, special, plain_text = [], {}, [], set()
        for token_id, (token, token_type) in enumerate(zip(tokens, types)):
            if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
                token_bytes.append(token.encode("utf-8"))   # stored as plain text, not byte-level
                added[token] = token_id
                if token_type == TOKEN_TYPE_CONTROL:
                    special.append(token_id)
            elif char_to_byte.keys() >= set(token):
                token_bytes.append(_byte_level_to_bytes(token, char_to_byte))
            else:
                # Not byte-level text (Command R has 1,403 such emoji and symbols): BPE over bytes can never build
                # it, so it is unreachable by encode; decode gives its text, as HF's ByteLevel decoder does.
                token_bytes.append(token.encode("utf-8"))
                plain_text.add(token_id)
        vocab = {token: token_id for token_id, token in enumerate(tokens)}
        merges = _merge_ids((m.split(" ") for m in get("tokenizer.ggml.merges")), vocab)
        merged_plain_text = plain_text.intersection(chain.from_iterable(merges))
        if merged_plain_text:   # byte-level merges only ever join byte-level tokens: this is another scheme
            _byte_level_to_bytes(tokens[min(merged_plain_text)], char_to_byte)   # raises, naming the character
        return cls(token_bytes, merges, pattern, added_tokens=added, special_ids=special, unreachable_ids=plain_text,
                   bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
                   chat_template=metadata.get("tokenizer.chat_template"), ignore_merges=ignore_merges)

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> "Tokenizer":
        """Build from an HF tokenizer.json (ByteLevel BPE: GPT-2, SmolLM, Llama 3 style); `path` may be its folder.

        bos/eos tokens and the chat template come from tokenizer_config.json beside it, when present.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: model type {model.get('type')!r} is not supported (only BPE)")
        if spec.get("normalizer"):
            raise ValueError(f"{path}: a normalizer ({spec['normalizer'].get('type')}) is not supported")
        for key in ("byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise ValueError(f"{path}: BPE option {key}={model[key]!r} is not supported")
        if spec.get("decoder") and spec["decoder"].get("type") != "ByteLevel":
            raise ValueError(f"{path}: decoder {spec['decoder'].get('type')!r} is not supported (only ByteLevel)")
        pattern = _pattern_from_hf_pre_tokenizer(spec.get("pre_tokenizer"), path)

        vocab: dict[str, int] = model["vocab"]
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        id_to_text = {**{i: t for t, i in vocab.items()}, **{i: t for t, i in added.items()}}
        if sorted(id_to_text) != list(range(len(id_to_text))):
            raise ValueError(f"{path}: token ids are not contiguous from 0")
        char_to_byte = _byte_level_decoder()
        token_bytes = [text.encode("utf-8") if token_id in special or text in added
                       else _byte_level_to_bytes(text, char_to_byte)
                       for token_id, text in sorted(id_to_text.items())]
        merges = _merge_ids((m.split(" ") if isinstance(m, str) else m for m in model["merges"]), vocab)

        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        text_to_id = {**vocab, **added}

        def token_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return text_to_id.get(token) if token is not None else None

        template = config.get("chat_template")
        if isinstance(template, list):   # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tokenizer = cls(token_bytes, merges, pattern, added_tokens=added, special_ids=special,
                        bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), chat_template=template,
                        ignore_merges=bool(model.get("ignore_merges", False)))
        if model.get("unk_token") and tokenizer.unencodable_bytes:   # HF would emit unk where tinyllm drops
            raise ValueError(f"{path}: an unk_token with bytes that have no token is not supported")
        return tokenizer

    @classmethod
    def from_merges(cls, merges: Sequence[tuple[int, int]], pattern: str = GPT2_PATTERN) -> "Tokenizer":
        """Build from trained merges (see bpe_train.train_bpe): ids 0-255 are the bytes, merge k makes id 256 + k."""
        token_bytes = [bytes([b]) for b in range(256)]
        for left, right in merges:
            if not (0 <= left < len(token_bytes) and 0 <= right < len(token_bytes)):
                raise ValueError(f"merge ({left}, {right}) uses a token that does not exist yet")
            token_bytes.append(token_bytes[left] + token_bytes[right])
        return cls(token_bytes, [(left, right, 256 + k) for k, (left, right) in enumerate(merges)], pattern)

    # --- facts ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def unencodable_bytes(self) -> frozenset[int]:
        """Byte values that have no single-byte token: encode drops them (see the module docstring)."""
        return frozenset(b for b in range(256) if self._byte_ids[b] is None)

    def clear_cache(self) -> None:
        """Forget the per-word BPE results (for cold-start benchmarks; results never change)."""
        self._cache.clear()

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character: b'\\xf0\\x9f')."""
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} is out of range: the vocab has ids 0..{len(self._token_bytes) - 1}")
        return self._token_bytes[token_id]

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self._ranks)}, "
                f"special={len(self.special_ids)}, bos_id={self.bos_id}, eos_id={self.eos_id})")

    # --- encode ---------------------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> token ids. No BOS is added.

        allow_special=True: text of an added/special token ("<|im_end|>") becomes that token's id.
        allow_special=False: control-token text is encoded as plain text (use this for untrusted user input);
        user-defined added tokens are still matched, as llama.cpp (parse_special=false) and HF do.
        """
        _check_text(text)
        added_re = self._added_re if allow_special else self._user_defined_re
        if added_re is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        # split() with a capture group alternates: ordinary text, added token, ordinary text, ...
        for i, part in enumerate(added_re.split(text)):
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids += self._encode_ordinary(part)
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        """Pre-tokenize with the regex, BPE each word not seen before, then look every word up in the cache."""
        cache = self._cache
        # With stages, the "words" cached here are the first stage's pieces; _encode_piece runs the later stages.
        words = self._words.findall(text) if self._words else list(filter(None, self._first_stage.split(text)))
        new_words = set(words).difference(cache)
        if len(cache) + len(new_words) > WORD_CACHE_LIMIT:
            cache.clear()
            new_words = set(words)
        for word in new_words:
            cache[word] = self._encode_word(word) if self._words else self._encode_piece(word)
        return list(chain.from_iterable(map(cache.__getitem__, words)))   # the hot loop, run in C

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """One piece of a staged pre-tokenizer's first stage -> ids: the later stages cut it into words."""
        return tuple(chain.from_iterable(map(self._encode_word, split_in_stages(piece, self._later_stages))))

    def _encode_word(self, word: str) -> tuple[int, ...]:
        """One pre-tokenized word -> ids: its bytes as single-byte tokens, then BPE merges."""
        data = word.encode("utf-8")
        # Taking a word that is itself a token as one token is only right when merges are ignored (Llama 3):
        # otherwise the merges decide, and nothing guarantees they rebuild every vocab entry (SmolLM2's do, all
        # 49,135 of them). The word cache already makes repeated words free, so no shortcut is needed.
        if self.ignore_merges and data in self._bytes_to_id:
            return (self._bytes_to_id[data],)
        byte_ids = self._byte_ids
        ids = [byte_ids[b] for b in data if byte_ids[b] is not None]   # unencodable bytes are dropped here
        return tuple(bpe(ids, self._ranks, self._merged))

    # --- decode ---------------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Token ids -> text: concatenate the tokens' bytes, then decode them as UTF-8.

        Repair rule: bytes that are not valid UTF-8 (a character cut off by a max-token limit, or ids a model
        made up) become U+FFFD '�', one per maximal invalid sequence: Python's errors="replace", which gives the
        same text as HF tokenizers (Rust's from_utf8_lossy). skip_special=True drops control tokens.
        """
        ids = [i for i in ids if i not in self.special_ids] if skip_special else ids
        return b"".join(self.id_to_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A decoder for ids that arrive one at a time (generation): see StreamDecoder."""
        return StreamDecoder(self, skip_special)

    # --- chat ------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation as the prompt text the model was trained on (ChatML, written in Python).

        Every message becomes "<|im_start|>{role}\\n{content}<|im_end|>\\n". If the first message is not a system
        message, the template's default system message (if it has one) goes first. add_generation_prompt ends
        the text with "<|im_start|>assistant\\n", so the model writes the answer next. Encode the result with
        allow_special=True. Only the plain ChatML of SmolLM2-style templates is supported (no tools).
        """
        default_system = _chatml_default_system(self.chat_template)
        out = []
        for k, message in enumerate(messages):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"message {k} must be a dict with str 'role' and 'content', got {message!r}")
            if k == 0 and message["role"] != "system" and default_system is not None:
                out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
            out.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)


class StreamDecoder:
    """Decodes ids one at a time, never emitting half a UTF-8 character.

    One token can end inside a character: an emoji is 4 bytes and often spread over 2-3 tokens. Decoding each
    token alone would print '�' garbage, so `feed` keeps the unfinished bytes at the end and emits them once the
    character is complete. Joining every `feed` result and the final `flush` gives exactly `decode(ids)`;
    invalid bytes become '�' as in `decode`, never an exception.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._pending = b""   # bytes of a character that is not complete yet (0-3 bytes)

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (may be "")."""
        if token_id in self._skip:
            return ""
        data = self._pending + self._tokenizer.id_to_bytes(token_id)
        cut = len(data) - _unfinished_utf8_tail(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: return what is left (an unfinished character becomes '�')."""
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text


def _unfinished_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character whose remaining bytes have not arrived (0-3).

    A character is a lead byte (0xxxxxxx: 1 byte, 110xxxxx: 2, 1110xxxx: 3, 11110xxx: 4) followed by
    continuation bytes (10xxxxxx). Holding back from a lead byte is always safe: the UTF-8 decoder restarts at
    any byte that is not a continuation byte, so the split cannot change how the text decodes.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0b1100_0000 != 0b1000_0000:   # not a continuation byte: a character starts here
            length = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            return back if back < length else 0
    return 0   # only continuation bytes: invalid whatever comes next, so nothing to wait for


# --- helpers -----------------------------------------------------------------------------------------------
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


def _alternation(texts: Iterable[str]) -> regex.Pattern | None:
    """One regex matching any of `texts`, the longest where several match (so "<|im_start|>" wins over a prefix of
    it); None if `texts` is empty.

    Written as a trie ("ab", "abc", "ad" -> "a(?:b(?:c)?|d)"): a plain alternation of MPT's 178 runs of spaces
    would try every one of them at every space of the text; the trie reads each character once.
    """
    trie: dict[str, dict] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}   # a token ends here

    def pattern(node: dict[str, dict]) -> str:
        branches = [regex.escape(char) + pattern(child) for char, child in node.items() if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body   # greedy: the longer token first, then the one ending here

    return regex.compile(f"({pattern(trie)})") if trie else None


def _check_text(text: Any) -> None:
    """ValueError with a one-line fix for input that is not (valid) text, instead of an error from deep inside."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise ValueError("encode() takes str, not bytes: decode it first, e.g. data.decode('utf-8', errors='replace')")
    if not isinstance(text, str):
        raise ValueError(f"encode() takes str, not {type(text).__name__}")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text has a lone surrogate {text[e.start]!r} at index {e.start}, which has no UTF-8 form "
                         f"(text decoded with errors='surrogateescape'?); repair it first, e.g. "
                         f"text.encode('utf-8', 'replace').decode('utf-8')") from None


def _merge_ids(merges: Iterable[Sequence[str]], vocab: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """Merges as token text pairs ("Ġ", "t") -> (left_id, right_id, merged_id), via the vocab (text -> id)."""
    out = []
    for rank, pair in enumerate(merges):
        if len(pair) != 2:
            raise ValueError(f"merge {rank} is {' '.join(pair)!r}: expected two tokens separated by one space")
        left, right = pair
        try:
            out.append((vocab[left], vocab[right], vocab[left + right]))
        except KeyError as e:
            raise ValueError(f"merge {rank} ({left!r}, {right!r}) uses {e.args[0]!r}, "
                             f"which is not in the vocab") from None
    return out


def _pattern_from_hf_pre_tokenizer(pre: Mapping[str, Any] | None, path: Path) -> str:
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


def _chatml_default_system(template: str | None) -> str | None:
    """The default system message of a ChatML template, or None; ValueError if the template is not ChatML."""
    if template is None:
        raise ValueError("this model has no chat template; build the prompt text yourself")
    if "<|im_start|>" not in template:
        raise ValueError("this model's chat template is not ChatML, the only format tinyllm renders")
    # The default message is a string constant in the template: '<|im_start|>system\n...<|im_end|>' (with \n a
    # newline or written as backslash-n). Quotes or braces inside mean template code, not a constant: skip those.
    found = regex.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>", template)
    return found.group(1) if found else None
