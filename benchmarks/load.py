#!/usr/bin/env python
"""Load generator for the HTTP server (like `vllm bench serve`), and the serving benchmark built on it.

    python benchmarks/load.py run --url http://127.0.0.1:8000 --rate 4 --num-requests 64
    python benchmarks/load.py report             # starts servers itself; sweep, static vs continuous, overhead
    python benchmarks/load.py report --quick     # tiny settings, a smoke test (writes nothing but --out)
    python benchmarks/load.py overhead --threads 1 2 [--quant native --activations int8]   # (3) alone, a table

`run`: a fixed-seed workload (Poisson arrivals at --rate, prompts of --prompt-len tokens cut from real text,
outputs of --output-len tokens enforced with ignore_eos), streamed over HTTP with at most --max-concurrency
requests in flight and --num-requests in all, to 127.0.0.1 only. It reports TTFT, ITL, TPOT and end-to-end
latency (p50 / p95 / p99), throughput, errors, and its own CPU use: it shares the cores with the server, and a
client that eats a core distorts what it measures.

`report`: the benchmark of the issue. (1) A request-rate sweep through one server: throughput and p95 TTFT / ITL
as the rate rises, to find the knee where queueing dominates. (2) Static against continuous scheduling on the
same workload (two servers, --policy). (3) Server overhead: decode tok/s of one stream through HTTP against
tinyllm.generate in this process (target >= 0.9x), with 1 and with 2 threads on both sides (the sweep's --threads,
if a --server-arg gives one, does not apply to it). Writes benchmarks/serving.<cpu kind>.json and serving.png,
and regenerates RESULTS.md (report.py). Needs the serve extra and httpx; matplotlib for the plot.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from workload import make_workload  # noqa: E402

HERE = Path(__file__).resolve().parent
SERVE = HERE.parent / "scripts" / "serve.py"
LOCAL_HOSTS = ("127.0.0.1", "localhost")


# --- one run against a server ---------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None        # send -> first token chunk (s)
    itl: list[float] = field(default_factory=list)   # gaps between token chunks
    e2e: float | None = None
    error: str | None = None


class RemoteTokenizer:
    """The server's /tokenize, so prompts are real token ids of the served model without loading it here."""

    def __init__(self, url: str):
        self.url = url

    def encode(self, text: str) -> list[int]:
        import httpx
        r = httpx.post(self.url + "/tokenize", json={"prompt": text}, timeout=120)
        r.raise_for_status()
        return r.json()["tokens"]


def check_local(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"error: the load generator only targets 127.0.0.1 / localhost, not {host!r}")
    return url.rstrip("/")


async def _one(client, req, model: str | None) -> RequestResult:
    res = RequestResult(len(req.prompt_ids))
    body = {"prompt": req.prompt_ids, "max_tokens": req.output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:                               # one chunk per token
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
    except Exception as e:                                         # connection refused, reset, timeout
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_workload(url: str, workload, max_concurrency: int, model: str | None = None,
                       timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (at most max_concurrency in flight). -> (results, duration s)."""
    import httpx
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    sem = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def arrive(req):
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
            async with sem:
                return await _one(client, req, model)
        results = await asyncio.gather(*(arrive(r) for r in workload))
        return list(results), time.perf_counter() - t0


def summarize(results: list[RequestResult], duration: float, cpu_s: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.e2e for r in ok]

    def pct(xs):
        return {f"p{q}": float(np.percentile(xs, q)) if xs else float("nan") for q in (50, 95, 99)} | {
            "mean": float(np.mean(xs)) if xs else float("nan")}
    out_tokens = sum(r.output_tokens for r in ok)
    return dict(requests=len(results), completed=len(ok), errors=len(results) - len(ok),
                error_kinds=sorted({r.error for r in results if r.error})[:5], duration_s=duration,
                request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
                total_token_throughput=(out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
                ttft_s=pct(ttft), itl_s=pct(itl), tpot_s=pct(tpot), e2e_s=pct(e2e),
                client_cpu_share=cpu_s / duration)


def run_once(url: str, rate: float | None, num_requests: int, max_concurrency: int, prompt_len, output_len,
             seed: int = 0, model: str | None = None, tokenizer=None) -> dict:
    """One fixed-seed workload against a running server -> the summary dict."""
    tokenizer = tokenizer or RemoteTokenizer(url)
    workload = make_workload(tokenizer, num_requests, rate, prompt_len=tuple(prompt_len), output="uniform",
                             output_len=tuple(output_len), seed=seed)
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_workload(url, workload, max_concurrency, model))
    summary = summarize(results, duration, time.process_time() - cpu0)
    summary.update(rate=rate if rate is not None else math.inf, num_requests=num_requests,
                   max_concurrency=max_concurrency, prompt_len=list(prompt_len), output_len=list(output_len))
    return summary


def summary_line(s: dict) -> str:
    ms = 1e3
    return (f"rate {s['rate']:g}/s: {s['completed']}/{s['requests']} ok ({s['errors']} errors) in "
            f"{s['duration_s']:.1f} s | {s['output_throughput']:.1f} out tok/s | "
            f"TTFT p50 {s['ttft_s']['p50'] * ms:.0f} "
            f"p95 {s['ttft_s']['p95'] * ms:.0f} p99 {s['ttft_s']['p99'] * ms:.0f} ms | ITL p50 "
            f"{s['itl_s']['p50'] * ms:.1f} p95 {s['itl_s']['p95'] * ms:.1f} p99 {s['itl_s']['p99'] * ms:.1f} ms | "
            f"TPOT p50 {s['tpot_s']['p50'] * ms:.1f} ms | e2e p95 {s['e2e_s']['p95']:.2f} s | "
            f"client CPU {s['client_cpu_share']:.0%}")


# --- servers the report starts and stops ----------------------------------------------------------------------------
class ServerProcess:
    """scripts/serve.py in a subprocess on a free 127.0.0.1 port; stopped with SIGTERM (a graceful drain)."""

    def __init__(self, args: list[str], ready_timeout: float = 600.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, str(SERVE), "--port", str(port), "--log-level", "warning",
                                      *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        import httpx
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready within {ready_timeout:.0f} s")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def http_decode_rate(url: str, prompt_ids: list[int], tokens: int) -> float:
    """One stream's decode tok/s through HTTP: (chunks - 1) / (last chunk - first chunk), as generate measures."""
    results, _ = asyncio.run(run_workload(url, [type("R", (), dict(arrival_s=0.0, prompt_ids=prompt_ids,
                                                                    output_tokens=tokens))()], 1))
    r = results[0]
    if r.error or not r.itl:
        raise RuntimeError(f"the overhead stream failed: {r.error}")
    return len(r.itl) / sum(r.itl)


def engine_decode_rate(model, prompt_ids: list[int], tokens: int) -> float:
    """One stream's decode tok/s on the Engine in this process (no HTTP): what the server adds is the rest."""
    from tinyllm.engine import Engine
    engine = Engine(model, kv_memory="64MiB", max_num_seqs=1)
    engine.add_request("solo", prompt_ids, max_tokens=tokens, stop_token_ids=())
    list(engine.run())
    t = engine.requests["solo"].metrics.token_times
    return (len(t) - 1) / (t[-1] - t[0])


def overhead(model_path: str | None, server_args: list[str], tokens: int, rounds: int, threads: int | None = None,
             quant: str | None = None, activations: str = "float32") -> dict:
    """Decode tok/s of one greedy stream through the server vs tinyllm.generate in this process (and the Engine in
    this process, to tell the engine's cost from HTTP's), alternating; the server is stopped while the in-process
    runs go, so they never share the cores. threads / quant / activations: the same settings on both sides."""
    import tinyllm
    if threads is not None:
        tinyllm.set_threads(threads)
        server_args = server_args + ["--threads", str(threads)]
    if quant is not None or activations != "float32":
        server_args = server_args + (["--quant", quant] if quant else []) + ["--activations", activations]
    model = tinyllm.load(model_path, quant=quant, activations=activations)
    prompt = model.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    tinyllm.generate(model, prompt, max_new_tokens=8, ignore_eos=True)            # compile outside the timing
    engine_decode_rate(model, prompt, 8)
    http, local, engine = [], [], []
    for _ in range(rounds):
        local.append(tinyllm.generate(model, prompt, max_new_tokens=tokens, ignore_eos=True)
                     .stats.decode_tokens_per_s)
        engine.append(engine_decode_rate(model, prompt, tokens))
        with ServerProcess(server_args + ["--max-num-seqs", "1"]) as server:
            http_decode_rate(server.url, prompt, 8)                                # warm the path
            http.append(http_decode_rate(server.url, prompt, tokens))
    return dict(tokens=tokens, rounds=rounds, http_tok_s=http, generate_tok_s=local, engine_tok_s=engine,
                ratio=float(np.median(http) / np.median(local)),
                ratio_to_engine=float(np.median(http) / np.median(engine)))


def plot(sweep: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rates = [s["rate"] for s in sweep]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rates, [s["output_throughput"] for s in sweep], "o-")
    a.set(xlabel="request rate (req/s)", ylabel="output tokens/s", xscale="log", title="throughput")
    b.plot(rates, [s["ttft_s"]["p95"] * 1e3 for s in sweep], "o-", label="p95 TTFT")
    b.plot(rates, [s["itl_s"]["p95"] * 1e3 for s in sweep], "s-", label="p95 ITL")
    b.set(xlabel="request rate (req/s)", ylabel="ms", xscale="log", yscale="log",
          title="latency: the knee is where queueing starts")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def report(args) -> None:
    from report import machine_info, write_json
    server_args = (["--model", args.model] if args.model else []) + args.server_arg
    common = dict(num_requests=args.num_requests, max_concurrency=args.max_concurrency,
                  prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed)
    res = dict(machine=machine_info(), settings={**common, "rates": args.rates, "server_args": server_args})
    with ServerProcess(server_args + ["--policy", "continuous"]) as server:
        tok = RemoteTokenizer(server.url)
        res["sweep"] = []
        for rate in args.rates:
            s = run_once(server.url, rate, tokenizer=tok, **common)
            print(summary_line(s), flush=True)
            res["sweep"].append(s)
    res["policies"] = {}
    for policy in ("static", "continuous"):
        with ServerProcess(server_args + ["--policy", policy]) as server:
            s = run_once(server.url, args.policy_rate, tokenizer=RemoteTokenizer(server.url), **common)
            print(f"{policy}: {summary_line(s)}", flush=True)
            res["policies"][policy] = s
    res["overhead"] = []                                          # per thread count, the same on both sides
    for threads in (1, 2):
        o = overhead(args.model, without_threads(server_args), args.overhead_tokens, args.overhead_rounds, threads)
        res["overhead"].append(dict(threads=threads, **o))
        print(f"overhead, {threads} thread(s): HTTP {np.median(o['http_tok_s']):.1f} tok/s vs generate "
              f"{np.median(o['generate_tok_s']):.1f} tok/s = {o['ratio']:.2f}x (target >= 0.9x); the Engine "
              f"in-process {np.median(o['engine_tok_s']):.1f} tok/s (HTTP / Engine = {o['ratio_to_engine']:.2f}x)",
              flush=True)
    if args.out:                                                  # a file of its own; RESULTS.md untouched
        out = Path(args.out)
        out.write_text(json.dumps(res, indent=1))
        png = out.with_suffix(".png")
    else:
        out = write_json("serving", res, command=" ".join(["python benchmarks/load.py"] + sys.argv[1:]))
        png = HERE / "serving.png"
    drew = plot(res["sweep"], png)
    print(f"wrote {out}" + (f" and {png}" if drew else ""))


def without_threads(server_args: list[str]) -> list[str]:
    """server_args without a --threads setting (overhead() sets its own, on both sides)."""
    out, skip = [], False
    for a in server_args:
        if skip:
            skip = False
        elif a == "--threads":
            skip = True
        elif not a.startswith("--threads="):
            out.append(a)
    return out


def overhead_only(args) -> None:
    """One stream through HTTP against generate, per thread count: the server's own threads (its engine loop and
    HTTP side) share the cores with the decode's."""
    print("| threads | weights | HTTP tok/s | generate tok/s | HTTP / generate | Engine in-process tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for threads in args.threads:
        o = overhead(args.model, [], args.overhead_tokens, args.overhead_rounds, threads, args.quant, args.activations)
        print(f"| {threads} | {args.quant or 'fp32'}{'+a8' if args.activations == 'int8' else ''} | "
              f"{np.median(o['http_tok_s']):.1f} | {np.median(o['generate_tok_s']):.1f} | {o['ratio']:.2f} | "
              f"{np.median(o['engine_tok_s']):.1f} |", flush=True)


def main(argv=None) -> None:
    from report import no_background_compiles
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "report"):
        q = sub.add_parser(name)
        q.add_argument("--num-requests", type=int, default=64)
        q.add_argument("--max-concurrency", type=int, default=32)
        q.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
        q.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--out", default=None, help="JSON file for the results")
    r = sub.choices["run"]
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    r.add_argument("--model", default=None, help="model name to send (default: the server's)")
    r = sub.choices["report"]
    r.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    r.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16])
    r.add_argument("--policy-rate", type=float, default=4.0)
    r.add_argument("--overhead-tokens", type=int, default=128)
    r.add_argument("--overhead-rounds", type=int, default=3)
    r.add_argument("--server-arg", action="append", default=[], help="extra scripts/serve.py argument (repeatable)")
    r.add_argument("--quick", action="store_true", help="tiny settings for a smoke test; RESULTS.md untouched")
    o = sub.add_parser("overhead", help="only the one-stream comparison, per thread count (prints a table)")
    o.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    o.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    o.add_argument("--quant", default=None, choices=["int8", "int8-block", "q4_1", "native"])
    o.add_argument("--activations", default="float32", choices=["float32", "int8"])
    o.add_argument("--overhead-tokens", type=int, default=128)
    o.add_argument("--overhead-rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.command == "overhead":
        return overhead_only(args)
    for n in ("num_requests", "max_concurrency"):
        if getattr(args, n) < 1:
            p.error(f"--{n.replace('_', '-')} must be >= 1")
    if args.command == "run":
        url = check_local(args.url)
        s = run_once(url, None if math.isinf(args.rate) else args.rate, args.num_requests, args.max_concurrency,
                     args.prompt_len, args.output_len, args.seed, args.model)
        print(summary_line(s))
        if args.out:
            Path(args.out).write_text(json.dumps(s, indent=1))
        return
    if args.quick:
        args.num_requests, args.max_concurrency, args.rates = 4, 4, [2.0, 8.0]
        args.prompt_len, args.output_len, args.overhead_tokens, args.overhead_rounds = [8, 16], [4, 8], 16, 1
        args.out = args.out or str(Path(os.environ.get("TMPDIR", "/tmp")) / "serving_quick.json")
    report(args)


if __name__ == "__main__":
    main()
