"""A byte-level BPE vocabulary read from a model file: GGUF metadata (`tokenizer.ggml.*`) or an HF tokenizer.json.

Both store tokens as text in GPT-2's byte-level alphabet (a leading space shows as 'Ġ'); what comes out here is the
raw bytes of every token and the merges as ids: the arguments of tokenizer.Tokenizer, which holds the BPE itself.
Left out: the Tokenizer (its `from_gguf_metadata` and `from_tokenizer_json` call these), SentencePiece and
WordPiece vocabularies (refused with a message).
"""
from __future__ import annotations

import functools
import json
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .pretokenize import GGUF_PRETOKENIZERS, pattern_from_hf_pre_tokenizer

# GGUF token types (llama.cpp's llama_token_type). Control and user-defined tokens are matched in text as a whole.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


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
    as_bytes = _byte_level_bytes_or_none(token)
    if as_bytes is None:
        outside = next(char for char in token if char not in char_to_byte)
        raise ValueError(f"token {token!r} has the character {outside!r}, which is not in GPT-2's byte-level "
                         f"alphabet: this vocab is not byte-level BPE")
    return as_bytes


def _byte_level_bytes_or_none(token: str) -> bytes | None:
    """'Ġthe' -> b' the', or None if `token` is not byte-level text."""
    try:
        return token.translate(_byte_level_table()).encode("latin-1")
    except UnicodeEncodeError:
        return None


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, str]:
    """A str.translate table from GPT-2's alphabet to the latin-1 character of each byte (so a whole token converts
    in C, not char by char: a vocab has 50,000 of them). Characters below 256 that are not in the alphabet map to
    U+FFFF, so the latin-1 encoding fails exactly when a token is not byte-level text."""
    table = {code: "\uffff" for code in range(256)}
    table.update({ord(char): chr(byte) for byte, char in enumerate(byte_level_alphabet())})
    return table


# --- the two file formats ---------------------------------------------------------------------------------
def gguf_vocab(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A GGUF file's metadata (`tokenizer.ggml.*` keys, `tokenizer.chat_template`) -> Tokenizer's arguments. The
    end-of-turn and end-of-message tokens (`eot_token_id`, `eom_token_id`: Llama 3's <|eot_id|>, <|eom_id|>) end a
    generation as eos does."""
    def get(key: str, kind: type = str, default: Any = ..., of: type | None = None) -> Any:
        """metadata[key], checked to be a `kind` (a list: of `of` items); ValueError naming the key."""
        if key not in metadata:
            if default is not ...:
                return default
            raise ValueError(f"GGUF metadata has no {key!r}: the file carries no (complete) tokenizer")
        value = metadata[key]
        if not (type(value) is kind and (of is None or set(map(type, value)) <= {of})):
            want = f"a list of {of.__name__}" if of else kind.__name__
            raise ValueError(f"GGUF metadata {key!r} is not {want} (file corrupt?)")
        return value

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}: tinyllm implements only byte-level BPE ('gpt2'), "
                         f"not SentencePiece ('llama'), WordPiece ('bert') or others")
    pre = get("tokenizer.ggml.pre")
    if pre not in GGUF_PRETOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer tinyllm does not know; known: "
                         f"{', '.join(sorted(GGUF_PRETOKENIZERS))}")
    pattern, ignore_merges = GGUF_PRETOKENIZERS[pre]
    tokens: list[str] = get("tokenizer.ggml.tokens", list, of=str)
    types = get("tokenizer.ggml.token_type", list, [1] * len(tokens), of=int)
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
        elif (as_bytes := _byte_level_bytes_or_none(token)) is not None:
            token_bytes.append(as_bytes)
        else:
            # Not byte-level text (Command R has 1,403 such emoji and symbols): BPE over bytes can never build
            # it, so it is unreachable by encode; decode gives its text, as HF's ByteLevel decoder does.
            token_bytes.append(token.encode("utf-8"))
            plain_text.add(token_id)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = _merge_ids(_split_merges(get("tokenizer.ggml.merges", list, of=str)), vocab)
    merged_plain_text = plain_text.intersection(chain.from_iterable(merges))
    if merged_plain_text:   # byte-level merges only ever join byte-level tokens: this is another scheme
        _byte_level_to_bytes(tokens[min(merged_plain_text)], char_to_byte)   # raises, naming the character
    end_ids = [get(f"tokenizer.ggml.{name}_token_id", int, None) for name in ("eot", "eom")]
    return dict(token_bytes=token_bytes, merges=merges, pattern=pattern, added_tokens=added, special_ids=special,
                unreachable_ids=plain_text, end_ids=[i for i in end_ids if i is not None],
                bos_id=get("tokenizer.ggml.bos_token_id", int, None),
                eos_id=get("tokenizer.ggml.eos_token_id", int, None),
                chat_template=get("tokenizer.chat_template", str, None), ignore_merges=ignore_merges)


def tokenizer_json_vocab(path: Path) -> tuple[dict[str, Any], str | None]:
    """An HF tokenizer.json file (ByteLevel BPE: GPT-2, SmolLM, Llama 3 style) -> (Tokenizer's arguments, its
    unk_token or None). Beside it, when present: bos/eos tokens from tokenizer_config.json, the chat template from
    there or from chat_template.jinja (newer repos), the ids that end a generation from generation_config.json."""
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
    pattern = pattern_from_hf_pre_tokenizer(spec.get("pre_tokenizer"), path)

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
    merges = model["merges"]
    merges = _merge_ids(_split_merges(merges) if all(isinstance(m, str) for m in merges) else merges, vocab)

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
    if template is None and path.with_name("chat_template.jinja").exists():
        template = path.with_name("chat_template.jinja").read_text(encoding="utf-8")
    generation_path = path.with_name("generation_config.json")
    generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.exists() else {}
    end_ids = generation.get("eos_token_id")
    end_ids = [] if end_ids is None else [end_ids] if type(end_ids) is int else end_ids
    if not (isinstance(end_ids, list) and all(type(i) is int and i >= 0 for i in end_ids)):
        raise ValueError(f"{generation_path}: eos_token_id {end_ids} is not a token id (or a list of them)")
    end_ids = [i for i in end_ids if i < len(token_bytes)]    # one past the vocab is never generated (as HF warns)
    return dict(token_bytes=token_bytes, merges=merges, pattern=pattern, added_tokens=added, special_ids=special,
                end_ids=end_ids, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), chat_template=template,
                ignore_merges=bool(model.get("ignore_merges", False))), model.get("unk_token")


def _split_merges(merges: list[str]) -> list[Sequence[str]]:
    """["Ġ t", ...] -> [("Ġ", "t"), ...]: one split of them all joined (50,000 splits cost a load 25 ms)."""
    if all(m.count(" ") == 1 for m in merges):
        parts = " ".join(merges).split(" ")
        return list(zip(parts[0::2], parts[1::2]))
    return [m.split(" ") for m in merges]                          # _merge_ids names the one that is not a pair


def _merge_ids(merges: Iterable[Sequence[str]], vocab: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """Merges as token text pairs ("Ġ", "t") -> (left_id, right_id, merged_id), via the vocab (text -> id)."""
    merges = list(merges)
    if all(len(pair) == 2 for pair in merges):                    # the usual case, looked up at C speed
        lefts, rights = zip(*merges) if merges else ((), ())
        try:
            return list(zip(map(vocab.__getitem__, lefts), map(vocab.__getitem__, rights),
                            map(vocab.__getitem__, map(str.__add__, lefts, rights))))
        except KeyError:
            pass                                                  # the loop below names the merge
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
