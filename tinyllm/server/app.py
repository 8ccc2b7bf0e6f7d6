"""The Starlette app: routes, streaming, admission, draining, and running it on uvicorn."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

import prometheus_client as prom
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Engine
from .engine_loop import EngineLoop
from .guard import Guard, HeaderTimeout
from .metrics import ServerMetrics
from .protocol import (FINISH_REASONS, APIError, Choice, Job, ServerOptions, chat_prompt_ids, completion_prompt_ids,
                       logprobs_body, parse_body, parse_job, usage)

BODY_TIMEOUT = 30.0           # seconds a client may take to send a request's body (else 408)
PARSE_INLINE_BYTES = 1 << 16  # bodies above this are parsed off the event loop
GIL_SWITCH_S = 1e-4           # seconds a thread holds the GIL while another waits (Python's default: 5 ms)
CLIENT_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")   # the lab page's own token (X-Tinyllm-Client)


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
        if options.api_key is not None and not options.api_key:
            raise ValueError("the API key is empty: give a non-empty --api-key (or none)")
        if not (isinstance(options.max_body_bytes, int) and options.max_body_bytes >= 1024):
            raise ValueError(f"max_body_bytes {options.max_body_bytes!r} must be an integer >= 1024")
        self.metrics = ServerMetrics(options.model_name)
        self.loop = EngineLoop(self.engine, self.metrics, options.request_timeout)
        self.draining = False
        self.drain_timer: threading.Timer | None = None
        self.owners: OrderedDict[str, str] = OrderedDict()    # request id -> the client token that made it (lab)
        self.created = int(time.time())
        routes = [Route("/health", self.health), Route("/ready", self.ready), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models), Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        self.lab = None
        if options.lab:                            # the inference lab page at /lab (lab.py)
            from .lab import Lab
            self.lab = Lab(self)
            routes += self.lab.routes()
        public = ["/health", "/lab", "/lab/"] + (["/metrics"] if options.metrics_public else [])
        guard = Middleware(Guard, api_key=options.api_key, allowed_hosts=options.allowed_hosts, public_paths=public,
                           public_prefixes=("/lab/static/",))
        self.app = Starlette(routes=routes, lifespan=self._lifespan, middleware=[guard],
                             exception_handlers={APIError: _api_error})

    @asynccontextmanager
    async def _lifespan(self, app):
        self.loop.start()
        yield
        if self.drain_timer is not None:
            self.drain_timer.cancel()
        self.loop.stop()

    def drain(self) -> None:
        """SIGTERM: admit nothing more (503), and after drain_timeout seconds end what still runs with a 503
        (streams get an error event and [DONE]) while the connections are still open."""
        if self.draining:
            return
        self.draining = True
        self.drain_timer = threading.Timer(self.options.drain_timeout, self.loop.end_all,
                                           args=(503, "the server is shutting down: the request was stopped"))
        self.drain_timer.daemon = True
        self.drain_timer.start()

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

    async def prometheus(self, request: HTTPRequest) -> Response:          # the key: guard.py
        return Response(self.metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "tinyllm",
            "max_model_len": self.max_model_len}]})

    async def tokenize(self, request: HTTPRequest) -> Response:
        """Any text up to the body limit (a client may tokenize a corpus to cut prompts from), off the event loop."""
        body = await self._json(request)
        if "messages" in body:
            ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, body["messages"])
        else:
            ids = await asyncio.to_thread(completion_prompt_ids, self.tokenizer, body.get("prompt"))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request: HTTPRequest) -> Response:
        ids = (await self._json(request)).get("tokens")
        V = self.tokenizer.vocab_size
        if isinstance(ids, list) and len(ids) > self.max_model_len:
            raise APIError(400, f"at most {self.max_model_len} tokens (this server's max_model_len)", "tokens")
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
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests")
        body = await self._json(request)
        job = await asyncio.to_thread(parse_job, kind, body, self.tokenizer, self.options, self.max_model_len)
        if job.n > self.engine.scheduler.max_num_seqs:           # checked here, before a stream's 200 goes out
            raise APIError(400, f"n={job.n} is more than this server runs at once (--max-num-seqs "
                                f"{self.engine.scheduler.max_num_seqs})", "n")
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests")
        self._record_owner(request, job.request_id)
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
        async with on_disconnect(request, lambda: self.loop.abort(job.request_id)):
            return await self._collect(job, inbox)

    def _record_owner(self, request: HTTPRequest, request_id: str) -> None:
        """Remember which lab page (its X-Tinyllm-Client token) made a request: only it sees the text (lab.py)."""
        token = self.client_token(request)
        if token is not None:
            self.owners[request_id] = token
            while len(self.owners) > self.engine.history:         # as long as the engine remembers requests
                self.owners.popitem(last=False)

    @staticmethod
    def client_token(request: HTTPRequest) -> str | None:
        """The lab page's random token, sent with each of its requests (X-Tinyllm-Client), if well formed."""
        tokens = request.headers.getlist("x-tinyllm-client")
        return tokens[0] if len(tokens) == 1 and CLIENT_TOKEN.fullmatch(tokens[0]) else None

    async def _events(self, job: Job, inbox: asyncio.Queue):
        """Yield the request's events as they come; abort it if the consumer stops early (client gone)."""
        finished = 0
        try:
            while finished < job.n:
                item = await inbox.get()
                if item[0] == "error":
                    finished = job.n
                    raise APIError(item[1], item[2])
                for e in item[1]:
                    finished += e.finished
                    yield e
        finally:
            if finished < job.n:
                self.loop.abort(job.request_id)

    async def _collect(self, job: Job, inbox: asyncio.Queue) -> Response:
        choices = [Choice(i) for i in range(job.n)]
        async for e in self._events(job, inbox):
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

    async def _json(self, request: HTTPRequest) -> dict:
        """The body as a JSON object (protocol.parse_body): at most max_body_bytes (413, refused from its
        Content-Length before it is read), sent within BODY_TIMEOUT seconds (408)."""
        limit = self.options.max_body_bytes
        too_big = APIError(413, f"the request body is larger than this server takes ({limit:,} bytes, "
                                f"--max-body-bytes)")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the request body was cut short (the client went away)") from None
        except TimeoutError:
            raise APIError(408, f"the request body took longer than {BODY_TIMEOUT:g} s to arrive") from None
        raw = b"".join(chunks)
        return parse_body(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(parse_body, raw)


@asynccontextmanager
async def on_disconnect(request: HTTPRequest, callback):
    """Call callback() if the client goes away while the block runs (its body must have been read): a watcher
    task waits for the ASGI disconnect message, so a request that streams nothing still notices at once."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        callback()
    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


async def _api_error(request: HTTPRequest, e: APIError) -> Response:
    return e.response()


def build_app(model, options: ServerOptions | None = None, **engine_kwargs) -> Server:
    """A Server (its ASGI app is `.app`) over a new Engine(model, **engine_kwargs)."""
    return Server(model, options or ServerOptions(), **engine_kwargs)


def uvicorn_config(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   max_connections: int = 256, header_timeout: float = 10.0, keep_alive_timeout: int = 5,
                   graceful_timeout: float | None = None):
    """uvicorn's settings for `server`: at most max_connections open at once (uvicorn's limit_concurrency: 503
    beyond), header_timeout seconds to send a request's headers (guard.HeaderTimeout), keep_alive_timeout seconds
    idle between requests. graceful_timeout (default: the drain timeout + 5 s, so that requests ended by the
    drain still send their last bytes): how long uvicorn waits for open requests on shutdown."""
    import uvicorn
    protocol = type("Protocol", (HeaderTimeout,), {"header_timeout": header_timeout})
    return uvicorn.Config(server.app, host=host, port=port, log_level=log_level, http=protocol,
                          limit_concurrency=max_connections, timeout_keep_alive=keep_alive_timeout,
                          timeout_graceful_shutdown=server.options.drain_timeout + 5 if graceful_timeout is None
                          else graceful_timeout)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, sockets=None, log_level: str = "info",
          **limits) -> None:
    """Run the server until SIGINT / SIGTERM; on the signal, drain (see the module docstring). limits: the
    connection limits of uvicorn_config."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            server.drain()                         # 503 to new requests; running ones end by the drain timeout
            super().handle_exit(sig, frame)

    http = Draining(uvicorn_config(server, host, port, log_level, **limits))

    def run_http():
        try:
            http.run(sockets=sockets)
        finally:
            server.loop.stop()                     # (uvicorn failed to start, or has shut down: the engine stops)

    # The engine steps on this thread, the one that loaded the model (EngineLoop.run_here says why); uvicorn serves
    # from another, and this thread takes the signals it would have taken.
    server.loop.on_caller = True
    # A decode step takes the GIL back after each layer's kernel: a thread running Python must hand it over sooner.
    sys.setswitchinterval(GIL_SWITCH_S)
    thread = threading.Thread(target=run_http, name="tinyllm-http", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, http.handle_exit)
    thread.start()
    server.loop.run_here()
    thread.join()
    if not http.started:
        raise SystemExit(1)                        # uvicorn could not start (it said why)
