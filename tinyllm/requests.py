"""What generate and the engine share about one request: prompt checks, end tokens, stop strings, text emission.

    ids = prompt_ids(model, "Hello")                      # text, chat messages or ids -> checked ids
    out = TextOutput(model.tokenizer, StopStrings(["###"]))
    for token in tokens:                                  # one sampled id at a time
        if token in end_token_ids(model.tokenizer): break
        if out.add(token): break                          # a stop string: the text is cut before it
        send(out.take())                                  # the text that can be shown now
    send(out.close())                                     # the rest, when the request ends

generate.py runs one request and engine.py many; both check a request and turn its tokens into text here, so
the two cannot drift apart. Left out: sampling (sampling.py), KV caches, timing, and the HTTP server's own
checks (server/protocol.py answers in OpenAI's shape; it shares the vocabulary check).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import SamplingParams


# --- checks of what a request asks for -----------------------------------------------------------------------------
def positive_int(value, name: str) -> int:
    """`value` if it is an integer >= 1 (a count of tokens or drafts); a bool or float is a mistake."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"invalid {name}={value!r}: must be an integer >= 1")
    return value


def as_sampling_params(params) -> SamplingParams:
    """None -> the defaults (greedy); a SamplingParams as it is; anything else (a dict, say) is refused."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def as_token_ids(values, what: str = "prompt") -> list[int]:
    """Token ids given as a list / tuple / range / 1-D array of integers: never text, floats, bools or a bare
    number (`42` or `[5.9]` is a mistake, not a prompt). -> list[int]; ValueError naming `what` otherwise."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return values.tolist()
    if isinstance(values, (list, tuple, range)) and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in values):
        return [int(i) for i in values]
    raise ValueError(f"{what} must be text, a list of chat messages, or a list of integer token ids; got "
                     f"{type(values).__name__} {str(values)[:40]!r}" if what == "prompt" else
                     f"{what} must be a list of integer token ids; got {type(values).__name__} {str(values)[:40]!r}")


def check_prompt_ids(ids: list[int], vocab_size: int) -> list[int]:
    """`ids` if there is at least one and every one is in the vocabulary (0 .. vocab_size - 1)."""
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if any(not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"prompt has token ids outside the vocabulary (0 .. {vocab_size - 1})")
    return ids


def prompt_ids(model, prompt, chat: bool = False) -> list[int]:
    """Token ids for a prompt given as text, chat messages, or ids (checked against the vocabulary).
    chat: wrap text in the model's chat template (chat messages always are)."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        _check_fits(model, [prompt])
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        _check_fits(model, [m.get("content") for m in prompt if isinstance(m.get("content"), str)])
        ids = tok.encode_chat(list(prompt))
    else:
        ids = as_token_ids(prompt)
    return check_prompt_ids(ids, model.config.vocab_size)


def _check_fits(model, texts: list[str]) -> None:
    """Refuse, before encoding, text whose byte length alone proves it cannot fit the context (encoding a
    long text costs seconds; see Tokenizer.min_tokens)."""
    ctx = model.config.context_length
    at_least = sum(model.tokenizer.min_tokens(t) for t in texts)
    if at_least >= ctx:
        raise ValueError(f"the prompt has at least {at_least} tokens ({sum(len(t.encode()) for t in texts):,} bytes, "
                         f"at most {model.tokenizer.max_token_bytes} per token) but the model's context is {ctx}: "
                         f"shorten it")


def check_room(ids: list[int], context_length: int) -> None:
    """Refuse a prompt that leaves no position of the context to generate into."""
    if len(ids) >= context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {context_length}: shorten it "
                         f"(at least one position must be left to generate into)")


# --- when a request ends -------------------------------------------------------------------------------------------
def end_token_ids(tokenizer) -> set[int]:
    """Ids that end a generation: the eos token, the file's other end tokens (GGUF eot / eom ids, HF
    generation_config's eos ids), the token the chat template ends a turn with (<|eot_id|>, <|im_end|>...), and
    `<|endoftext|>` when the vocabulary has it as a control token."""
    ends = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    ends |= {i for i in tokenizer.special_ids if tokenizer.id_to_bytes(i) == b"<|endoftext|>"}
    ends |= set(getattr(tokenizer, "end_ids", ()))
    turn_end = tokenizer.chat_end_of_turn_id() if hasattr(tokenizer, "chat_end_of_turn_id") else None
    return ends | {turn_end} if turn_end is not None else ends


class StopStrings:
    """Stop strings, checked against a growing text: where to cut it, and how much of it may be shown yet."""

    def __init__(self, stop: str | Sequence[str] = ()):
        stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.strings = tuple(stop)

    def find(self, text: str) -> int:
        """Where the earliest stop string in `text` begins (the text is cut there), or -1."""
        return min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=-1)

    def safe_length(self, text: str) -> int:
        """How much of `text` can be shown: all but the trailing characters that could still grow into a stop
        string."""
        hold = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return len(text) - hold


# --- text emission -------------------------------------------------------------------------------------------------
class TextOutput:
    """One request's text as its tokens arrive: decoded without half characters (stream_decoder.py), cut before
    the first stop string, and handed out in pieces that never show what could still become one.

    Joining every `take()` and the final `close()` gives `text`. tokenizer None (a model without one): no text.
    """

    def __init__(self, tokenizer, stops: StopStrings | None = None):
        self.stops = stops if stops is not None else StopStrings()
        if self.stops.strings and tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        self.text = ""               # all text so far; once a stop string is hit, the text before it
        self.shown = 0               # characters of text already handed out
        self.stopped = False         # a stop string was hit
        self._decoder = tokenizer.stream_decoder() if tokenizer is not None else None

    def add(self, token_id: int) -> bool:
        """Decode one more token. -> True if a stop string is now complete (the text is cut where it begins)."""
        if self._decoder is not None:
            self.text += self._decoder.feed(token_id)
            hit = self.stops.find(self.text)
            if hit >= 0:
                self.text, self.stopped = self.text[:hit], True
        return self.stopped

    def take(self) -> str:
        """The new text that can be shown: up to a tail that could still grow into a stop string (maybe "")."""
        safe = self.stops.safe_length(self.text)
        piece, self.shown = self.text[self.shown:safe], max(self.shown, safe)
        return piece

    def close(self) -> str:
        """The request ended: the text not shown yet, with the decoder's held-back bytes unless a stop string
        cut the text before them."""
        if self._decoder is not None and not self.stopped:
            self.text += self._decoder.flush()
        piece, self.shown = self.text[self.shown:], len(self.text)
        return piece
