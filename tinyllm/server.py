"""An OpenAI-compatible HTTP server over one Engine: completions and chat completions (plain and streamed as
server-sent events), tokenize / detokenize, health and readiness, and Prometheus metrics.

    server = build_app(model, ServerOptions(max_waiting=64), kv_memory="256MiB", max_num_seqs=16)
    serve(server, host="127.0.0.1", port=8000)     # or: python scripts/serve.py; server.app is the ASGI app

One thread owns the engine (`EngineLoop`): it takes requests and aborts from a queue, steps while anything is
unfinished, sleeps on the queue when idle, and hands each step's events to the waiting HTTP handlers on the
asyncio loop. Handlers never touch the engine, so a slow client never stalls a step; a client that goes away
aborts its request at once (its blocks are freed before the next step). Admission: a request must fit
`max_model_len` (prompt + max_tokens, else 400), at most `max_waiting` may wait (else 429), and each has a
deadline (`request_timeout`). On SIGTERM the server stops admitting (503), lets running requests finish for up
to `drain_timeout` seconds, then aborts what is left. Left out: tools, JSON mode, embeddings, batch prompts.
Needs the `serve` extra (starlette, uvicorn, prometheus-client).
"""
from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import prometheus_client as prom
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, RequestOutput
from .sampling import SamplingParams

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "abort": "abort"}
CHAT_ROLES = ("system", "user", "assistant", "developer")
MAX_LOGPROBS = 20


@dataclass
class ServerOptions:
    model_name: str = "SmolLM2-135M-Instruct"
    max_model_len: int | None = None      # prompt + max_tokens per request; None: context or KV pool, the smaller
    max_waiting: int = 64                 # requests queued beyond this get 429
    request_timeout: float = 600.0        # seconds from arrival to the last token, else the request is aborted
    drain_timeout: float = 30.0           # on SIGTERM: how long running requests may take to finish
    api_key: str | None = None            # if set, /v1/*, /tokenize and /detokenize need "Authorization: Bearer KEY"


class APIError(Exception):
    """An error answered with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_unavailable", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
        raise APIError(400, f"invalid {name}={value!r}: must be {rule}", name)
    return value


def parse_job(kind: str, body, tokenizer, options: ServerOptions, max_model_len: int) -> Job:
    """Validate an OpenAI request body (kind "completions" or "chat") -> Job, or raise APIError(400)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in body:
        if name in NEUTRAL:
            if body[name] not in NEUTRAL[name]:
                hint = "; repetition_penalty is the penalty it has" if name.endswith("_penalty") else ""
                raise APIError(400, f"{name} is not supported by tinyllm{hint} (supported: "
                                    f"{', '.join(sorted(KNOWN[kind]))})", name)
        elif name not in KNOWN[kind]:
            raise APIError(400, f"unknown parameter {name!r} (supported: {', '.join(sorted(KNOWN[kind]))})", name)
    model = body.get("model")
    if model is not None and model != options.model_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {options.model_name!r}", "model")
    if kind == "chat":
        prompt_ids = chat_prompt_ids(tokenizer, body.get("messages"))
    else:
        prompt_ids = completion_prompt_ids(tokenizer, body.get("prompt"))
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
    try:
        params = SamplingParams(
            temperature=_typed(body, "temperature", (int, float), 1.0, "a number >= 0"),
            top_p=_typed(body, "top_p", (int, float), 1.0, "a number in (0, 1]"),
            top_k=max(0, _typed(body, "top_k", int, 0, "an integer (0 or -1 = off)")),
            min_p=_typed(body, "min_p", (int, float), 0.0, "a number in [0, 1]"),
            repetition_penalty=_typed(body, "repetition_penalty", (int, float), 1.0, "a number > 0"),
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


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """A completions prompt: text (special-token text counts, as in tinyllm.generate and vLLM) or token ids."""
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i < tokenizer.vocab_size for i in prompt):
            raise APIError(400, f"prompt has token ids outside the vocabulary (0 .. {tokenizer.vocab_size - 1})",
                           "prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "one prompt per request: send a string or a list of token ids (batches of prompts are "
                            "not supported; send them as separate requests)", "prompt")
    raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Chat messages -> ids through the model's template. The template's own text (role markers, the default
    system message) may hold control tokens; every message's content is encoded as plain text, so a user who
    types "<|im_end|>" gets those characters, not the control token."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
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
    # Render the template around placeholders that cannot occur in it, then encode piece by piece.
    roles = ["system" if m["role"] == "developer" else m["role"] for m in messages]
    try:
        text = tokenizer.apply_chat_template([{"role": r, "content": f"\x00{k}\x00"} for k, r in enumerate(roles)])
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    ids = []
    for i, piece in enumerate(re.split(r"\x00(\d+)\x00", text)):
        if i % 2 == 0:
            ids += tokenizer.encode(piece, allow_special=True)     # the template's own text
        else:
            ids += tokenizer.encode(contents[int(piece)], allow_special=False)
    return ids


# --- Prometheus metrics ---------------------------------------------------------------------------------------------
class ServerMetrics:
    """The engine's state as Prometheus metrics, named as vLLM names them (prefix tinyllm: for vllm:)."""

    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return prom.Histogram(f"tinyllm:{name}", doc, label, registry=r, buckets=buckets).labels(model_name)

        def gauge(name, doc):
            return prom.Gauge(f"tinyllm:{name}", doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return prom.Counter(f"tinyllm:{name}", doc, label, registry=r).labels(model_name)

        latency = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80]
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).", latency)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", latency)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", latency[6:] + [160, 320])
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", latency)
        self.running = gauge("num_requests_running", "Requests holding KV and running steps.")
        self.waiting = gauge("num_requests_waiting", "Requests queued (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache blocks in use, fraction of the pool (0..1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV dropped, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = prom.Counter("tinyllm:request_success", "Finished requests by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self._seen: dict[str, float] = {}           # cumulative values already added to the counters

    def _advance(self, counter, key: str, total: float) -> None:
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total

    def update(self, engine: Engine) -> None:
        """After a step (engine thread): gauges to the current state, counters up to the engine's totals."""
        sched, alloc = engine.scheduler, engine.pool.allocator
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(alloc.num_used / alloc.num_blocks)
        self._advance(self.prefix_queries, "queries", alloc.query_tokens)
        self._advance(self.prefix_hits, "hits", alloc.hit_tokens)
        self._advance(self.preemptions, "preemptions", sched.num_preemptions)
        self._advance(self.prompt_tokens, "prompt", engine.counters["prompt_tokens"])
        self._advance(self.generation_tokens, "generation", engine.counters["generation_tokens"])

    def finished(self, req, reason: str) -> None:
        """Observe one finished sample's latencies (engine thread)."""
        m = req.metrics
        self.success.labels(self.model_name, FINISH_REASONS.get(reason, reason)).inc()
        if m.first_scheduled is not None:
            self.queue.observe(m.queue_time)
        if m.first_token is not None:
            self.ttft.observe(m.ttft)
            self.e2e.observe(m.finished - m.arrival)
            for gap in np.diff(m.token_times):
                self.itl.observe(float(gap))

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


# --- the engine thread ---------------------------------------------------------------------------------------------
@dataclass
class _Active:
    """A request the engine thread is serving, and where its events go."""
    request: object                  # engine.Request (its samples are request.children)
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    deadline: float
    remaining: int                   # samples not finished yet


class EngineLoop:
    """The one thread that owns the engine. Handlers call `submit` / `abort` (thread-safe: they only put commands
    on a queue); events come back on each request's asyncio.Queue as ("events", [RequestOutput]) or
    ("error", status, message)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, request_timeout: float = 600.0):
        self.engine, self.metrics, self.request_timeout = engine, metrics, request_timeout
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, _Active] = {}        # engine thread only
        self.ready = threading.Event()              # set once the kernels are compiled
        self.num_waiting = 0                        # published after each step, read by the handlers
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tinyllm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> None:
        self.commands.put(("add", job, loop, inbox))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running and end the thread."""
        self.commands.put(("stop",))
        self.thread.join(timeout)

    @property
    def queued(self) -> int:
        """Requests waiting for the engine: its queue plus commands not yet taken (approximate, for 429)."""
        return self.num_waiting + self.commands.qsize()

    # ---- inside the thread
    def _run(self) -> None:
        try:
            self._warm_up()
        except BaseException as e:                  # a model that cannot run: report it, never mark ready
            self.error = e
            return
        self.ready.set()
        try:
            self._serve()
        except BaseException as e:                  # a bug in the loop: fail what is pending, /health turns 500
            self.error = e
            for rid in list(self.active):
                self._end(rid, ("error", 500, f"the engine thread failed: {type(e).__name__}: {e}"))

    def _serve(self) -> None:
        while True:
            # Idle: block on the queue (no spinning). Busy: take whatever arrived, then step.
            block = not self.engine.has_unfinished()
            while True:
                try:
                    command = self.commands.get(block=block)
                except queue.Empty:
                    break
                if command[0] == "stop":
                    for rid in list(self.active):
                        self._end(rid, ("error", 503, "the server is shutting down"))
                    return
                self._handle(command)
                block = False
            if self.engine.has_unfinished():
                self._step()

    def _warm_up(self) -> None:
        """Compile prefill, batched decode and sampling on a throwaway pool before the first request."""
        pool = self.engine.pool
        warm = Engine(self.engine.model, num_blocks=8, block_size=pool.block_size, max_num_seqs=2)
        warm.add_request("a", [1, 2, 3], max_tokens=3, stop_token_ids=())
        warm.add_request("b", [1, 2], max_tokens=3, stop_token_ids=())
        list(warm.run())

    def _handle(self, command) -> None:
        if command[0] == "abort":
            if command[1] in self.active:
                self.engine.abort(command[1])
                self._observe_finished(self.active.pop(command[1]).request)
            return
        _, job, loop, inbox = command
        stop_ids = () if job.ignore_eos else None
        try:
            req = self.engine.add_request(job.request_id, job.prompt_ids, job.params, job.max_tokens,
                                          stop_token_ids=stop_ids, stop=job.stop, n=job.n, logprobs=job.logprobs)
        except ValueError as e:
            loop.call_soon_threadsafe(inbox.put_nowait, ("error", 400, str(e)))
            return
        self.active[job.request_id] = _Active(req, loop, inbox, req.metrics.arrival + self.request_timeout, job.n)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:                      # a bug, not bad input: fail the running requests, keep serving
            for rid in [r for r in self.active]:
                self.engine.abort(rid)
                self._end(rid, ("error", 500, f"the engine failed: {type(e).__name__}: {e}"))
            return
        by_request: dict[str, list[RequestOutput]] = {}
        for e in events:
            by_request.setdefault(e.request_id, []).append(e)
        for rid, evs in by_request.items():
            a = self.active.get(rid)
            if a is None:
                continue
            a.loop.call_soon_threadsafe(a.inbox.put_nowait, ("events", evs))
            a.remaining -= sum(e.finished for e in evs)
            if a.remaining == 0:
                del self.active[rid]
                self._observe_finished(a.request)
        now = self.engine.clock()
        for rid in [rid for rid, a in self.active.items() if now > a.deadline]:
            self.engine.abort(rid)
            self._end(rid, ("error", 504, f"the request took longer than the server's timeout "
                                          f"({self.request_timeout:g} s) and was aborted"))
        self.num_waiting = len(self.engine.scheduler.waiting)
        if self.metrics is not None:
            self.metrics.update(self.engine)

    def _end(self, rid: str, item) -> None:
        a = self.active.pop(rid)
        a.loop.call_soon_threadsafe(a.inbox.put_nowait, item)
        self._observe_finished(a.request)

    def _observe_finished(self, req) -> None:
        if self.metrics is not None:
            for r in [req, *req.children]:
                self.metrics.finished(r, r.finish_reason or "abort")
            self.metrics.update(self.engine)


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


# --- the app -------------------------------------------------------------------------------------------------------
class Server:
    """The HTTP side: routes, admission, streaming. Holds the EngineLoop; `app` is the ASGI application."""

    def __init__(self, model, options: ServerOptions, **engine_kwargs):
        if model.tokenizer is None:
            raise ValueError("serving needs a model with a tokenizer")
        self.model, self.options, self.tokenizer = model, options, model.tokenizer
        # The server reads cumulative counters, not the engine's history: keep little of it (a finished request
        # holds its ids and token times).
        self.engine = Engine(model, **{"history": 1000, **engine_kwargs})
        pool = self.engine.pool
        limit = min(model.config.context_length, pool.num_blocks * pool.block_size)
        if options.max_model_len is not None and not 1 < options.max_model_len <= limit:
            raise ValueError(f"max_model_len {options.max_model_len} must be in 2 .. {limit} (the model's context "
                             f"and the KV pool's {pool.num_blocks * pool.block_size} positions)")
        self.max_model_len = options.max_model_len or limit
        self.metrics = ServerMetrics(options.model_name)
        self.loop = EngineLoop(self.engine, self.metrics, options.request_timeout)
        self.draining = False
        self.created = int(time.time())
        routes = [Route("/health", self.health), Route("/ready", self.ready), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models), Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={APIError: _api_error})

    @asynccontextmanager
    async def _lifespan(self, app):
        self.loop.start()
        yield
        self.loop.stop()

    # ---- plain endpoints
    async def health(self, request: HTTPRequest) -> Response:
        """Liveness: the process answers and the engine thread runs (or is still compiling)."""
        if self.loop.error is not None or (self.loop.thread.ident and not self.loop.thread.is_alive()):
            return JSONResponse({"status": "error", "error": repr(self.loop.error)}, status_code=500)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: HTTPRequest) -> Response:
        """Readiness: kernels compiled and not draining (a load balancer sends traffic only then)."""
        ok = self.loop.ready.is_set() and not self.draining
        return JSONResponse({"ready": ok, "draining": self.draining}, status_code=200 if ok else 503)

    async def prometheus(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    async def models(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "tinyllm",
            "max_model_len": self.max_model_len}]})

    async def tokenize(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        body = await self._json(request)
        if "messages" in body:
            ids = chat_prompt_ids(self.tokenizer, body["messages"])
        else:
            ids = completion_prompt_ids(self.tokenizer, body.get("prompt"))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        ids = (await self._json(request)).get("tokens")
        V = self.tokenizer.vocab_size
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V
                                              for i in ids)):
            raise APIError(400, f"tokens must be a list of token ids in 0 .. {V - 1}", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    # ---- generation
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: HTTPRequest, kind: str) -> Response:
        self._authorize(request)
        body = await self._json(request)
        job = parse_job(kind, body, self.tokenizer, self.options, self.max_model_len)
        if job.n > self.engine.scheduler.max_num_seqs:           # checked here, before a stream's 200 goes out
            raise APIError(400, f"n={job.n} is more than this server runs at once (--max-num-seqs "
                                f"{self.engine.scheduler.max_num_seqs})", "n")
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests")
        if self.loop.error is not None:
            raise APIError(500, f"the engine could not start: {self.loop.error!r}")
        if self.loop.queued >= self.options.max_waiting:
            raise APIError(429, f"the server is overloaded: {self.loop.queued} requests are already waiting "
                                f"(--max-waiting {self.options.max_waiting}); retry later")
        inbox: asyncio.Queue = asyncio.Queue()
        self.loop.submit(job, asyncio.get_running_loop(), inbox)
        if job.stream:
            return StreamingResponse(self._stream(job, inbox), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(job, inbox, request)

    async def _events(self, job: Job, inbox: asyncio.Queue, request: HTTPRequest | None = None):
        """Yield the request's events as they come; abort it if the consumer stops early (client gone)."""
        finished = 0
        try:
            while finished < job.n:
                if request is None:
                    item = await inbox.get()
                else:                                                  # no stream to notice a disconnect: poll
                    try:
                        item = await asyncio.wait_for(inbox.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                if item[0] == "error":
                    finished = job.n
                    raise APIError(item[1], item[2])
                for e in item[1]:
                    finished += e.finished
                    yield e
        finally:
            if finished < job.n:
                self.loop.abort(job.request_id)

    async def _collect(self, job: Job, inbox: asyncio.Queue, request: HTTPRequest) -> Response:
        choices = [Choice(i) for i in range(job.n)]
        async for e in self._events(job, inbox, request):
            choices[e.index].add(e)
        out = []
        for c in choices:
            lp = logprobs_body(job.kind, self.tokenizer, c.logprobs) if job.logprobs is not None else None
            if job.kind == "chat":
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({**self._head(job, stream=False), "choices": out,
                             "usage": usage(len(job.prompt_ids), sum(c.tokens for c in choices))})

    async def _stream(self, job: Job, inbox: asyncio.Queue):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        head, tokens = self._head(job, stream=True), 0
        offsets = [0] * job.n

        def chunk(choices, usage_=None):
            body = {**head, "choices": choices}
            if job.include_usage:
                body["usage"] = usage_
            return f"data: {json.dumps(body)}\n\n"

        if job.kind == "chat":                     # OpenAI's first chunk names the role
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(job.n)])
        try:
            async for e in self._events(job, inbox):
                tokens += e.token_id is not None
                entries = [(e.token_id, e.logprob, e.top_logprobs)] if (
                    job.logprobs is not None and e.token_id is not None) else []
                lp = logprobs_body(job.kind, self.tokenizer, entries, offsets[e.index]) if entries else None
                offsets[e.index] += len(e.text)
                reason = FINISH_REASONS.get(e.finish_reason, e.finish_reason) if e.finished else None
                if job.kind == "chat":
                    choice = {"index": e.index, "delta": {"content": e.text} if e.text else {}, "logprobs": lp,
                              "finish_reason": reason}
                else:
                    choice = {"index": e.index, "text": e.text, "logprobs": lp, "finish_reason": reason}
                yield chunk([choice])
        except APIError as err:                    # the stream has begun: report in-band, as vLLM does
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if job.include_usage:
            yield chunk([], usage(len(job.prompt_ids), tokens))
        yield "data: [DONE]\n\n"

    # ---- helpers
    def _head(self, job: Job, stream: bool) -> dict:
        if job.kind == "chat":
            return {"id": f"chatcmpl-{job.request_id}", "object": "chat.completion.chunk" if stream
                    else "chat.completion", "created": int(time.time()), "model": self.options.model_name}
        return {"id": f"cmpl-{job.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.options.model_name}

    def _authorize(self, request: HTTPRequest) -> None:
        key = self.options.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    @staticmethod
    async def _json(request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body


async def _api_error(request: HTTPRequest, e: APIError) -> Response:
    return e.response()


def build_app(model, options: ServerOptions | None = None, **engine_kwargs) -> Server:
    """A Server (its ASGI app is `.app`) over a new Engine(model, **engine_kwargs)."""
    return Server(model, options or ServerOptions(), **engine_kwargs)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, sockets=None, log_level: str = "info") -> None:
    """Run the server until SIGINT / SIGTERM; on the signal, drain (see the module docstring)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            server.draining = True                 # answer 503 to new requests from here on
            super().handle_exit(sig, frame)

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=server.options.drain_timeout)
    Draining(config).run(sockets=sockets)
