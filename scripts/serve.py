#!/usr/bin/env python
"""Serve a model over an OpenAI-compatible HTTP API (needs the serve extra: pip install -e ".[serve]").

    python scripts/serve.py                                   # SmolLM2-135M-Instruct on http://127.0.0.1:8000
    python scripts/serve.py --kv-memory 512MiB --max-num-seqs 32 --policy continuous --api-key secret
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions (stream: true for server-sent events), /v1/models, /tokenize,
/detokenize, /health (alive), /ready (kernels compiled, not draining), /metrics (Prometheus), and the inference
lab page at /lab (on a loopback address by default; --lab / --no-lab). Before exposing it beyond this machine,
read docs/serving.md, "Exposing the server": --api-key, --allowed-hosts, and the limits under "admission".
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tinyllm  # noqa: E402
from tinyllm.cli import DefaultsHelpFormatter  # noqa: E402
from tinyllm.engine import POLICIES  # noqa: E402
from tinyllm.hub import FetchError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the file's name)")
    p.add_argument("--quant", default=None, choices=["fp32", "int8", "int8-block", "q4_1", "q4_k", "native"],
                   help="weight format (see scripts/generate.py --help)")
    p.add_argument("--activations", default="float32", choices=["float32", "int8"])
    p.add_argument("--threads", type=int, default=None,
                   help="threads for BLAS and Numba at most (default: every core; each step takes fewer while other "
                        "work keeps the cores busy)")
    g = p.add_argument_group("engine")
    g.add_argument("--kv-memory", default="256MiB", help="KV cache pool size")
    g.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    g.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "int8"],
                   help="how the pool stores K and V (float16: 2x the sequences in the same memory, int8: ~3.8x)")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    g.add_argument("--policy", default="continuous", choices=POLICIES)
    g.add_argument("--long-prefill-tokens", type=int, default=None, help="most prompt tokens of one request per step")
    g.add_argument("--no-prefix-caching", action="store_true")
    g = p.add_argument_group("admission")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="most prompt + max_tokens per request (default: the context or the KV pool, the smaller)")
    g.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond this get HTTP 429")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests get to finish before they are aborted")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413")
    g.add_argument("--max-connections", type=int, default=256, help="open connections beyond this get HTTP 503")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection gets to send a request's headers before it is closed")
    g = p.add_argument_group("access")
    g.add_argument("--api-key", default=None,     # not the environment's value: --help would print it
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$TINYLLM_API_KEY, else no key; the variable keeps the key out of `ps`)")
    g.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names (Host and Origin headers) answered besides the loopback ones, "
                        "e.g. myserver.lan,10.0.0.5; '*' answers any (behind a proxy that checks them)")
    g.add_argument("--lab", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the inference lab page at /lab (default: only on a loopback --host)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def is_loopback(host: str) -> bool:
    """Whether --host listens on this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False                               # a host name: it may resolve anywhere


def exposure_warnings(loopback: bool, api_key: str | None, lab: bool, allowed: tuple) -> list[str]:
    """What the operator of a server reachable from other machines should hear at start (docs/serving.md)."""
    if loopback:
        return []
    out = []
    if api_key is None:
        out.append("listening beyond this machine with no API key: anyone who reaches the port can generate "
                   "(set --api-key or $TINYLLM_API_KEY)")
    if lab:
        out.append("the lab is on beyond this machine: it shows the engine's state and replays requests; every "
                   "client with the key can see which requests run (texts only to their own page)")
    if not allowed:
        out.append("only loopback Host names are answered: clients of other machines get 403 until "
                   "--allowed-hosts names this server as they reach it")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.max_connections < 1 or not args.header_timeout > 0:
        print("error: --max-connections must be >= 1 and --header-timeout > 0", file=sys.stderr)
        return 2
    try:
        from tinyllm.server import ServerOptions, build_app, serve
    except ImportError as e:
        print(f"error: the server needs the serve extra ({e.name} is missing): pip install -e \".[serve]\"",
              file=sys.stderr)
        return 2
    try:
        if args.threads is not None:          # (else every core: the steps' governors take fewer on a busy machine)
            tinyllm.set_threads(args.threads)
        t0 = time.perf_counter()
        model = tinyllm.load(args.model, quant=args.quant, activations=args.activations)
        default_name = Path(args.model).name.split(".")[0] if args.model else "SmolLM2-135M-Instruct"
        name = args.served_model_name or default_name
        api_key = args.api_key if args.api_key is not None else os.environ.get("TINYLLM_API_KEY")
        loopback = is_loopback(args.host)
        lab = loopback if args.lab is None else args.lab
        allowed = tuple(h for h in args.allowed_hosts.split(",") if h.strip())
        if not loopback and args.host.strip("[]") not in ("0.0.0.0", "::"):
            allowed += (args.host,)                                   # its own address, as clients will name it
        options = ServerOptions(model_name=name, max_model_len=args.max_model_len, max_waiting=args.max_waiting,
                                request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                                api_key=api_key, metrics_public=args.metrics_public, lab=lab,
                                max_body_bytes=args.max_body_bytes, allowed_hosts=allowed)
        server = build_app(model, options, kv_memory=args.kv_memory, block_size=args.block_size,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           policy=args.policy, prefix_caching=not args.no_prefix_caching, kv_dtype=args.kv_dtype,
                           long_prefill_tokens=args.long_prefill_tokens)
    except (ValueError, FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"loaded {name} in {time.perf_counter() - t0:.1f} s | KV pool {server.engine.pool.num_blocks} blocks of "
          f"{args.block_size} | max_model_len {server.max_model_len} | http://{args.host}:{args.port}"
          + (" (the lab: /lab)" if lab else ""), file=sys.stderr)
    for warning in exposure_warnings(loopback, api_key, lab, allowed):
        print(f"warning: {warning}", file=sys.stderr)
    serve(server, args.host, args.port, log_level=args.log_level, max_connections=args.max_connections,
          header_timeout=args.header_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
