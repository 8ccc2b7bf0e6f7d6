"""The OpenAI API as tinyllm speaks it: request bodies checked and turned into engine jobs, errors in
OpenAI's shape, response bodies (choices, logprobs, usage)."""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

import numpy as np
from starlette.responses import JSONResponse

from ..engine import RequestOutput
from ..requests import check_prompt_ids
from ..sampling import SamplingParams

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "abort": "abort"}
CHAT_ROLES = ("system", "user", "assistant", "developer")
MAX_LOGPROBS = 20
# Caps on what one request may ask for (docs/serving.md, "Exposing the server"): each keeps one request's cost,
# before and during generation, small next to everyone else's.
MAX_BODY_BYTES = 1 << 20          # the default of --max-body-bytes (413 beyond it)
MAX_DEPTH = 16                    # JSON nesting (an OpenAI body needs 4)
MAX_STOP, MAX_STOP_CHARS = 16, 256
MAX_MESSAGES = 1024               # chat messages, and content parts over all messages
REPETITION_PENALTY = (0.01, 100.0)
MAX_ECHO = 64                     # characters of a client's value quoted back in an error


@dataclass
class ServerOptions:
    model_name: str = "SmolLM2-135M-Instruct"
    max_model_len: int | None = None      # prompt + max_tokens per request; None: context or KV pool, the smaller
    max_waiting: int = 64                 # requests queued beyond this get 429
    request_timeout: float = 600.0        # seconds from arrival to the last token, else the request is aborted
    drain_timeout: float = 30.0           # on SIGTERM: how long running requests may take to finish
    api_key: str | None = None            # if set, every endpoint but /health needs "Authorization: Bearer KEY"
    metrics_public: bool = False          # /metrics answers without the key
    lab: bool = True                      # serve the inference lab page at /lab (lab.py)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413 before they are read
    allowed_hosts: tuple = ()             # Host / Origin names answered besides the loopback ones ("*": any)


class APIError(Exception):
    """An error answered with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_unavailable",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, None if param is None else param[:MAX_ECHO]

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        # 408 / 413: the body was left unread, so the connection cannot carry another request
        close = {"Connection": "close"} if self.status in (408, 413) else None
        return JSONResponse(self.body(), status_code=self.status, headers=close)


def echo(value) -> str:
    """A client's value quoted in an error message, cut to MAX_ECHO characters (a 50 MB name is not sent back)."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + f"... ({len(text):,} characters)"


# --- bodies ----------------------------------------------------------------------------------------------------------
def parse_body(raw: bytes) -> dict:
    """A request body -> its JSON object, or APIError(400) saying what is wrong: not JSON, not an object, nested
    deeper than MAX_DEPTH, a number that is not finite or does not fit 64 bits, a string with a lone surrogate
    (JSON's "\\ud800" escape: no UTF-8 for it, so no tokenizer and no response could carry it)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:                  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    todo = [(body, 1)]                       # an explicit stack: no recursion on what a client sent
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            items = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)")
        for v in items:
            if isinstance(v, str):
                if not v.isascii():
                    try:
                        v.encode("utf-8")
                    except UnicodeEncodeError:
                        raise APIError(400, "the request body holds a lone UTF-16 surrogate (such as \\ud800) in "
                                            "a string: send valid Unicode text") from None
            elif isinstance(v, float) and not math.isfinite(v):
                raise APIError(400, "the request body holds a number that is not finite (NaN, Infinity or beyond "
                                    "1.8e308): send finite numbers")
            elif isinstance(v, int) and not isinstance(v, bool) and not -2 ** 63 <= v < 2 ** 64:
                raise APIError(400, "the request body holds an integer that does not fit in 64 bits")
            elif isinstance(v, (dict, list)):
                todo.append((v, depth + 1))
    return body


# --- request bodies -> what the engine needs -----------------------------------------------------------------------
# OpenAI parameters tinyllm does not implement: accepted only at the value that means "off".
NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
           "echo": (False, None), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
           "functions": (None, []), "function_call": (None, "none")}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
          "n", "stream", "stream_options", "ignore_eos", "user", "best_of"}
KNOWN = {"completions": COMMON | {"prompt", "logprobs"},
         "chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}}


@dataclass
class Job:
    """One HTTP request turned into engine arguments (validated)."""
    kind: str                        # "completions" or "chat"
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    n: int
    stop: list[str]
    ignore_eos: bool
    logprobs: int | None             # alternatives per token, or None for no logprobs
    stream: bool
    include_usage: bool
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def _typed(body: dict, name: str, kinds, default, rule: str):
    """body[name] if it has one of `kinds` (bool never counts as a number), else 400. Missing or null: default."""
    value, kinds = body.get(name), kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(400, f"invalid {name}={echo(value)}: must be {rule}", name)
    return value


def parse_job(kind: str, body, tokenizer, options: ServerOptions, max_model_len: int) -> Job:
    """Validate an OpenAI request body (kind "completions" or "chat") -> Job, or raise APIError(400). It tokenizes:
    the server calls it off the event loop."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in body:
        if name in NEUTRAL:
            if body[name] not in NEUTRAL[name]:
                hint = "; repetition_penalty is the penalty it has" if name.endswith("_penalty") else ""
                raise APIError(400, f"{name} is not supported by tinyllm{hint} (supported: "
                                    f"{', '.join(sorted(KNOWN[kind]))})", name)
        elif name not in KNOWN[kind]:
            raise APIError(400, f"unknown parameter {echo(name)} (supported: {', '.join(sorted(KNOWN[kind]))})", name)
    model = body.get("model")
    if model is not None and model != options.model_name:
        raise APIError(404, f"model {echo(model)} is not served here; this server serves {options.model_name!r}",
                       "model")
    if kind == "chat":
        prompt_ids = chat_prompt_ids(tokenizer, body.get("messages"), max_model_len)
    else:
        prompt_ids = completion_prompt_ids(tokenizer, body.get("prompt"), max_model_len)
    n = _typed(body, "n", int, 1, "an integer >= 1")
    best_of = _typed(body, "best_of", int, n, "an integer equal to n")
    if n < 1 or best_of != n:
        raise APIError(400, f"invalid n={n} / best_of={best_of}: n must be >= 1, best_of (if given) equal to n", "n")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but this server's max_model_len is "
                            f"{max_model_len}: shorten it", "messages" if kind == "chat" else "prompt")
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    default = room if kind == "chat" else min(16, room)           # OpenAI's defaults: to the end; legacy: 16
    max_tokens = _typed(body, name, int, default, "an integer >= 1")
    if max_tokens < 1:
        raise APIError(400, f"invalid {name}={max_tokens}: must be >= 1", name)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + {name} ({max_tokens}) = "
                            f"{len(prompt_ids) + max_tokens} exceeds this server's max_model_len {max_model_len}: "
                            f"ask for at most {room} tokens", name)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "invalid stop: must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"invalid stop: at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters "
                            f"each", "stop")
    penalty = _typed(body, "repetition_penalty", (int, float), 1.0, "a number > 0")
    if not REPETITION_PENALTY[0] <= penalty <= REPETITION_PENALTY[1]:
        raise APIError(400, f"invalid repetition_penalty={penalty!r}: must be in {REPETITION_PENALTY[0]:g} .. "
                            f"{REPETITION_PENALTY[1]:g} (1 = off)", "repetition_penalty")
    try:
        params = SamplingParams(
            temperature=_typed(body, "temperature", (int, float), 1.0, "a number >= 0"),
            top_p=_typed(body, "top_p", (int, float), 1.0, "a number in (0, 1]"),
            top_k=max(0, _typed(body, "top_k", int, 0, "an integer (0 or -1 = off)")),
            min_p=_typed(body, "min_p", (int, float), 0.0, "a number in [0, 1]"),
            repetition_penalty=penalty,
            seed=_typed(body, "seed", int, None, "a non-negative integer"))
    except ValueError as e:
        raise APIError(400, str(e)) from None
    if kind == "chat":
        want = _typed(body, "logprobs", bool, False, "true or false")
        top = _typed(body, "top_logprobs", int, 0, f"an integer in 0 .. {MAX_LOGPROBS}")
        if body.get("top_logprobs") is not None and not want:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = top if want else None
    else:
        logprobs = _typed(body, "logprobs", int, None, f"an integer in 0 .. {MAX_LOGPROBS}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"invalid logprobs {logprobs}: at most {MAX_LOGPROBS} alternatives per token", "logprobs")
    stream = _typed(body, "stream", bool, False, "true or false")
    stream_options = _typed(body, "stream_options", dict, {}, "an object")
    if stream_options and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    if set(stream_options) - {"include_usage"}:
        raise APIError(400, f"unknown stream_options {sorted(set(stream_options) - {'include_usage'})}: "
                            f"only include_usage is supported", "stream_options")
    include_usage = _typed(stream_options, "include_usage", bool, False, "true or false")
    ignore_eos = _typed(body, "ignore_eos", bool, False, "true or false")
    return Job(kind, prompt_ids, params, max_tokens, n, stop, ignore_eos, logprobs, stream, include_usage)


def check_text_length(tokenizer, texts, max_tokens: int | None, param: str) -> None:
    """Refuse text whose byte length alone proves it cannot fit `max_tokens` tokens, before tokenizing it
    (tokenizing costs seconds per MB; Tokenizer.min_tokens is one pass of C)."""
    if max_tokens is None:
        return
    try:
        at_least = sum(tokenizer.min_tokens(t) for t in texts)
    except ValueError as e:                  # not valid text: one line from the tokenizer
        raise APIError(400, str(e), param) from None
    if at_least > max_tokens:
        raise APIError(400, f"the prompt has at least {at_least:,} tokens (at most {tokenizer.max_token_bytes} "
                            f"bytes per token) but this server's max_model_len is {max_tokens}: shorten it", param)


def completion_prompt_ids(tokenizer, prompt, max_tokens: int | None = None) -> list[int]:
    """A completions prompt: text (special-token text counts, as in tinyllm.generate and vLLM) or token ids.
    max_tokens: refuse longer prompts before tokenizing (the server's max_model_len)."""
    if isinstance(prompt, str) and prompt:
        check_text_length(tokenizer, [prompt], max_tokens, "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and max_tokens is not None and len(prompt) > max_tokens:
        raise APIError(400, f"the prompt has {len(prompt):,} token ids, more than this server's max_model_len "
                            f"{max_tokens}: shorten it", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        try:
            return check_prompt_ids(list(prompt), tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "one prompt per request: send a string or a list of token ids (batches of prompts are "
                            "not supported; send them as separate requests)", "prompt")
    raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def chat_prompt_ids(tokenizer, messages, max_tokens: int | None = None) -> list[int]:
    """Chat messages -> ids through the model's template. The template's own text (role markers, the default
    system message) may hold control tokens; every message's content is encoded as plain text, so a user who
    types "<|im_end|>" gets those characters, not the control token. max_tokens: as for completion_prompt_ids."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    parts = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), list) else 1
                for m in messages)
    if parts > MAX_MESSAGES:
        raise APIError(400, f"at most {MAX_MESSAGES} messages and content parts in all", "messages")
    contents = []
    for k, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)          # OpenAI's content parts, text only
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(content, str):
            raise APIError(400, f"messages[{k}] must be an object with role in {', '.join(CHAT_ROLES)} and a string "
                                f"content", "messages")
        contents.append(content)
    check_text_length(tokenizer, contents, max_tokens, "messages")
    # the model's own template, contents kept as text whatever the template does with them (chat_template.py)
    chat = [{"role": "system" if m["role"] == "developer" else m["role"], "content": c}
            for m, c in zip(messages, contents)]
    try:
        return tokenizer.encode_chat(chat)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None


# --- responses ---------------------------------------------------------------------------------------------------
def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.id_to_bytes(token_id).decode("utf-8", errors="replace")


class Choice:
    """One sample's text, tokens, logprobs and finish reason, accumulated from events."""

    def __init__(self, index: int):
        self.index, self.text, self.tokens, self.finish_reason = index, "", 0, None
        self.logprobs: list[tuple[int, float, list]] = []

    def add(self, e: RequestOutput) -> None:
        self.text += e.text
        if e.token_id is not None:
            self.tokens += 1
            if e.logprob is not None:
                self.logprobs.append((e.token_id, e.logprob, e.top_logprobs))
        if e.finished:
            self.finish_reason = FINISH_REASONS.get(e.finish_reason, e.finish_reason)


def logprobs_body(kind: str, tokenizer, entries, text_offset: int = 0):
    """OpenAI's logprobs object for [(token id, logprob, [(id, logprob)] top)]: the chat or the legacy shape."""
    if kind == "chat":
        def item(i, lp):
            t = tokenizer.id_to_bytes(i)
            return {"token": t.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(t)}
        return {"content": [{**item(i, lp), "top_logprobs": [item(j, lq) for j, lq in top]} for i, lp, top in entries]}
    tokens = [_token_text(tokenizer, i) for i, _, _ in entries]
    offsets = list(np.cumsum([text_offset] + [len(t) for t in tokens[:-1]])) if tokens else []
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{_token_text(tokenizer, j): lq for j, lq in top} for _, _, top in entries],
            "text_offset": [int(o) for o in offsets]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


