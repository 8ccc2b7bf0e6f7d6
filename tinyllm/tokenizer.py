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

Chat: `encode_chat` renders the model's own template (chat_template.py) and encodes it so that message contents
stay text: only the control tokens the template writes become control tokens.

Not here: reading the vocab from a file (vocab_files.py), rendering templates (chat_template.py), SentencePiece and
WordPiece tokenizers (Llama 2, Phi-3, BERT), normalizers (HF applies NFC for some of these models; llama.cpp does
not, nor does tinyllm), byte fallback, BPE dropout; training is in bpe_train.py.
"""
from __future__ import annotations

import gc
import heapq
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import regex

from .chat_template import CHATML_MARKERS, CHATML_TEMPLATE, end_of_turn, literal_text, mark, render, split_rendered
from .pretokenize import (DEEPSEEK_CODER_FUSED, DEEPSEEK_CODER_STAGES, DEEPSEEK_LLM_FUSED,  # noqa: F401
                          DEEPSEEK_LLM_STAGES, FALCON_FUSED, FALCON_STAGES, GGUF_PRETOKENIZERS, GPT2_PATTERN,
                          LLAMA3_PATTERN, QWEN2_PATTERN, QWEN35_PATTERN, SMOLLM_PATTERN, split_in_stages)
from .stream_decoder import StreamDecoder
from .vocab_files import gguf_vocab, tokenizer_json_vocab

# The per-word cache is cleared when it holds more words than this (about 20-30 MB), so memory stays bounded.
WORD_CACHE_LIMIT = 200_000


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for a while: building 100,000 small tuples and lists sets it off
    dozens of times, and its full passes walk every object numpy and Numba made. (The tables hold no cycles.)"""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


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
    """Byte-pair encode one word: while some adjacent pair has a merge, apply the one with the lowest rank
    (among equal ranks, i.e. the same pair, the leftmost first). `ranks[pair]` is the merge's position in the
    merges list (0 = learned first); `merged[pair]` the id it makes.

    O(n log n), as HF tokenizers does it, not the O(n^2) of rescanning every pair after each merge (a 100 KB
    run without spaces is one word): the symbols form a linked list and a heap holds every candidate merge as
    (rank, position of its left symbol). A merge rewrites its left symbol, unlinks the right one and pushes the
    two pairs it creates; entries a merge made stale stay in the heap and are skipped when popped (their
    position is dead, or the pair there now has another rank).
    """
    n = len(ids)
    symbol = list(ids)                       # [n] token id at each position; -1 once merged into its left
    nxt = list(range(1, n)) + [-1]           # [n] position of the next live symbol, -1 at the end
    prev = list(range(-1, n - 1))            # [n] position of the previous live symbol, -1 at the start
    heap = [(ranks[pair], i) for i, pair in enumerate(zip(ids, ids[1:])) if pair in ranks]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i]
        if symbol[i] < 0 or j < 0 or ranks.get((symbol[i], symbol[j])) != rank:
            continue                                                           # stale entry
        symbol[i], symbol[j] = merged[symbol[i], symbol[j]], -1
        k = nxt[j]
        nxt[i] = k
        if k >= 0:
            prev[k] = i
            if (symbol[i], symbol[k]) in ranks:
                heapq.heappush(heap, (ranks[symbol[i], symbol[k]], i))
        p = prev[i]
        if p >= 0 and (symbol[p], symbol[i]) in ranks:
            heapq.heappush(heap, (ranks[symbol[p], symbol[i]], p))
    return [s for s in symbol if s >= 0]


# --- the tokenizer -----------------------------------------------------------------------------------------
class Tokenizer:
    """Byte-level BPE tokenizer: `encode(text) -> ids`, `decode(ids) -> text`, built from data.

    Build it with `from_gguf_metadata`, `from_tokenizer_json` or `from_merges` (a trained BPE). The constructor
    takes the vocab as raw bytes, the file formats' GPT-2 byte-to-character encoding already undone:
      token_bytes:  token_bytes[id] is the bytes of token `id` (for added tokens: the UTF-8 of their text).
      merges:       (left_id, right_id, merged_id) in rank order: merges[0] is applied first (triples, or an
                    int array [M, 3]).
      pattern:      the pre-tokenizer: one regex (see the *_PATTERN constants), or a tuple of regexes applied in
                    stages (the *_FUSED constants, see `split_in_stages`).
      added_tokens: text -> id of tokens matched as a whole in the input text before pre-tokenization.
      special_ids:  control tokens: decode(skip_special=True) drops them, and encode(allow_special=False) reads
                    their text as plain text. Added tokens that are not control tokens (user-defined: MPT's runs
                    of spaces) are always matched, as in llama.cpp and HF tokenizers.
      ignore_merges: a word that is itself a token is taken whole (Llama 3); otherwise merges decide.
      unreachable_ids: tokens that encode never produces (text that is not byte-level); decode still gives them.
      end_ids:      tokens besides eos that end a generation (GGUF eot / eom ids, HF generation_config eos ids).
    """

    def __init__(self, token_bytes: Sequence[bytes], merges: Iterable[tuple[int, int, int]] | np.ndarray,
                 pattern: str | tuple[str, ...], *,
                 added_tokens: Mapping[str, int] | None = None, special_ids: Iterable[int] = (),
                 bos_id: int | None = None, eos_id: int | None = None, chat_template: str | None = None,
                 ignore_merges: bool = False, unreachable_ids: Iterable[int] = (), end_ids: Iterable[int] = ()):
        self._token_bytes = list(map(bytes, token_bytes))      # id -> bytes
        self._added = dict(added_tokens or {})                 # text -> id, matched whole in the input
        special_ids, end_ids = frozenset(special_ids), frozenset(end_ids)
        vocab_size = len(self._token_bytes)
        for token_id in [*self._added.values(), *special_ids, *end_ids, bos_id, eos_id]:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocab (size {vocab_size})")
        self.special_ids = special_ids
        self.bos_id, self.eos_id, self.end_ids = bos_id, eos_id, end_ids
        self.chat_template = chat_template
        self._chat_control: dict[str, str | None] = {}   # template -> regex of its control tokens (see encode_chat)
        self.ignore_merges = ignore_merges
        self.pattern = pattern
        if isinstance(pattern, str):
            self._words = regex.compile(pattern)
        else:   # stages: each regex in a capture group, so that split() keeps its matches as pieces
            self._words = None
            self._first_stage, *self._later_stages = [regex.compile(f"({stage})") for stage in pattern]

        # bytes -> id of ordinary tokens (used for the single-byte tokens and by ignore_merges). The tables below
        # are built by C loops (zip, map, dict) over the ids reversed, so that where bytes or a pair repeat, the
        # first id or rank is the one kept: every run loads a vocab of some 50,000 tokens and merges.
        self.unreachable_ids = frozenset(unreachable_ids)
        not_ordinary = set(self._added.values()).union(self.unreachable_ids)
        with _collector_paused():
            ordinary = sorted(set(range(vocab_size)).difference(not_ordinary)) if not_ordinary else range(vocab_size)
            self._bytes_to_id: dict[bytes, int] = dict(zip(map(self._token_bytes.__getitem__, reversed(ordinary)),
                                                           reversed(ordinary)))
            self._byte_ids = [self._bytes_to_id.get(bytes([b])) for b in range(256)]   # byte -> id, or None

            if isinstance(merges, np.ndarray):                           # converted.py's [M, 3]
                lefts, rights, news = merges.reshape(-1, 3).T.tolist()
            else:
                merges = list(merges)
                lefts, rights, news = zip(*merges) if merges else ((), (), ())
            if len(lefts) and not 0 <= min(min(lefts), min(rights), min(news)) <= max(
                    max(lefts), max(rights), max(news)) < vocab_size:
                rank = next(r for r, m in enumerate(zip(lefts, rights, news)) if not 0 <= min(m) <= max(m) < vocab_size)
                raise ValueError(f"merge {rank} {(lefts[rank], rights[rank], news[rank])} (left, right -> merged) "
                                 f"uses an id outside the vocab")
            pairs = list(zip(reversed(lefts), reversed(rights)))         # (left, right), the last merge first
            self._ranks: dict[tuple[int, int], int] = dict(zip(pairs, range(len(pairs) - 1, -1, -1)))   # 0: first
            self._merged: dict[tuple[int, int], int] = dict(zip(pairs, reversed(news)))  # -> the merged token's id

        # One regex for all added tokens, one for the user-defined ones alone (allow_special=False).
        self._added_re = _alternation(self._added)
        self._user_defined_re = _alternation(t for t, i in self._added.items() if i not in special_ids)
        self._cache: dict[str, tuple[int, ...]] = {}    # word -> its ids
        self.max_token_bytes = max(map(len, self._token_bytes), default=1)
        self._unencodable = bytes(sorted(self.unencodable_bytes))

    # --- constructors from files ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's metadata (`tokenizer.ggml.*` keys, `tokenizer.chat_template`): vocab_files.py."""
        return cls(**gguf_vocab(metadata))

    def tables(self) -> dict[str, Any]:
        """What this tokenizer is built from, as plain values: `Tokenizer(**tok.tables())` rebuilds it (converted.py
        keeps them on disk, so that a load skips parsing the vocab and merges). The merges come out in rank order,
        a repeated pair once at its first rank: they merge exactly as the original list did."""
        pairs = sorted(self._ranks, key=self._ranks.__getitem__)
        return dict(token_bytes=list(self._token_bytes), merges=[(*pair, self._merged[pair]) for pair in pairs],
                    pattern=self.pattern, added_tokens=dict(self._added), special_ids=sorted(self.special_ids),
                    bos_id=self.bos_id, eos_id=self.eos_id, chat_template=self.chat_template,
                    ignore_merges=self.ignore_merges, unreachable_ids=sorted(self.unreachable_ids),
                    end_ids=sorted(self.end_ids))

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> "Tokenizer":
        """Build from an HF tokenizer.json (ByteLevel BPE: GPT-2, SmolLM, Llama 3 style); `path` may be its folder.

        bos/eos tokens and the chat template come from tokenizer_config.json beside it, when present.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        arguments, unk_token = tokenizer_json_vocab(path)
        tokenizer = cls(**arguments)
        if unk_token and tokenizer.unencodable_bytes:   # HF would emit unk where tinyllm drops
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

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from the bytes alone, in one pass of C: every token stands for at
        most `max_token_bytes` bytes of the text, and unencodable bytes for none. Lets a caller refuse a text
        that cannot fit a context before spending time encoding it."""
        _check_text(text)
        n = len(text.encode("utf-8").translate(None, self._unencodable))
        return -(-n // self.max_token_bytes)

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

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A decoder for ids that arrive one at a time (generation): see stream_decoder.py."""
        return StreamDecoder(self, skip_special)

    # --- chat ------------------------------------------------------------------------------------------------
    @property
    def effective_chat_template(self) -> str | None:
        """The template chats are rendered with: the model's own; else ChatML if the vocab has ChatML's markers as
        control tokens (what llama.cpp falls back to); else None."""
        if self.chat_template is not None:
            return self.chat_template
        chatml = all(self._added.get(marker) in self.special_ids for marker in CHATML_MARKERS)
        return CHATML_TEMPLATE if chatml else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, **variables: Any) -> str:
        """Render a conversation as the prompt text the model was trained on, with the model's own Jinja template
        as transformers renders it (chat_template.py). add_generation_prompt ends the text with the assistant's
        header, so the model writes the answer next; `tools` (JSON schemas) and `variables` (Qwen3's
        enable_thinking, Llama 3's date_string...) go to the template as they are. To get ids, use `encode_chat`:
        encode() of this text would also turn marker text inside a message into markers.
        """
        return render(self._template(), messages, add_generation_prompt=add_generation_prompt, tools=tools,
                      **{**self.template_tokens(), **variables})

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, **variables: Any) -> list[int]:
        """Ids of `apply_chat_template(...)`: control tokens only where the template wrote them. A message (or a
        role, a tool, a variable) holding "<|im_end|>" gets those characters as text, so it cannot end its turn
        early or forge another one (prompt injection). How: chat_template.mark / split_rendered."""
        source = self._template()
        control = self.chat_control_pattern(source)
        text = render(source, mark(messages, control), add_generation_prompt=add_generation_prompt,
                      tools=mark(tools, control), **{**self.template_tokens(), **mark(variables, control)})
        ids: list[int] = []
        for piece, is_caller_text in split_rendered(text, control):
            ids += self._encode_ordinary(piece) if is_caller_text else self.encode(piece)
        return ids

    def template_tokens(self) -> dict[str, str]:
        """bos_token and eos_token as templates see them (as transformers passes them); absent if the vocab has
        none."""
        named = (("bos_token", self.bos_id), ("eos_token", self.eos_id))
        return {name: self.decode([token_id]) for name, token_id in named if token_id is not None}

    def chat_control_pattern(self, template: str) -> str | None:
        """A regex of the tokens a chat treats as control tokens: every control token, and the added tokens the
        template writes in its own text (Qwen3's <think>), whitespace ones aside; None if there are none."""
        if template not in self._chat_control:
            literals = literal_text(template)
            texts = [text for text, token_id in self._added.items()
                     if token_id in self.special_ids or (text in literals and not text.isspace())]
            self._chat_control[template] = _alternation_pattern(texts)
        return self._chat_control[template]

    def chat_end_of_turn_id(self) -> int | None:
        """The token the chat template ends an assistant's turn with (Llama 3's <|eot_id|>, ChatML's <|im_end|>,
        Granite's <|end_of_text|>), or None: no template, none found, or a template that does not compile."""
        source = self.effective_chat_template
        try:
            text = end_of_turn(source, self.chat_control_pattern(source), **self.template_tokens()) if source else None
        except ValueError:
            return None
        return self._added.get(text) if text is not None else None

    def _template(self) -> str:
        source = self.effective_chat_template
        if source is None:
            raise ValueError("this model has no chat template (GGUF tokenizer.chat_template, HF tokenizer_config.json) "
                             "and no ChatML tokens: send the prompt as plain text, or set tokenizer.chat_template")
        return source


# --- helpers -----------------------------------------------------------------------------------------------
def _alternation(texts: Iterable[str]) -> regex.Pattern | None:
    """One regex matching any of `texts` in its one capture group, the longest where several match (so
    "<|im_start|>" wins over a prefix of it); None if `texts` is empty."""
    pattern = _alternation_pattern(texts)
    return regex.compile(f"({pattern})") if pattern is not None else None


def _alternation_pattern(texts: Iterable[str]) -> str | None:
    """The regex of `_alternation`, without a capture group: None if `texts` is empty.

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

    return pattern(trie) if trie else None


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
