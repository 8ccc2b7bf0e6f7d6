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
to `drain_timeout` seconds, then ends what is left with a 503 (streams: an error event and [DONE]). Before any
route, guard.py checks the Host / Origin allow-lists and the API key; protocol.py caps what one request may ask
for (docs/serving.md, "Exposing the server"). Left out: tools, JSON mode, embeddings, batch prompts.
Needs the `serve` extra (starlette, uvicorn, prometheus-client).
"""
from __future__ import annotations

from .app import Server, build_app, serve
from .protocol import APIError, Job, ServerOptions, chat_prompt_ids, completion_prompt_ids, parse_job

__all__ = ["Server", "build_app", "serve", "ServerOptions", "APIError", "Job", "parse_job", "chat_prompt_ids",
           "completion_prompt_ids"]
