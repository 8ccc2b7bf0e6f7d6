"""The OpenAI-compatible server over HTTP on 127.0.0.1: greedy output equals tinyllm.generate, streams in OpenAI's
chunk format, 16 concurrent streams each equal to their solo output, disconnects and timeouts free their blocks,
overload gives 429, bad input 400, SIGTERM drains, /metrics counts. Tiny random model, except the tests marked slow
(the official openai client against the default model)."""
import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

for _mod in ("starlette", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason='needs the serve extra and httpx: pip install -e ".[serve,test]"')

import httpx  # noqa: E402
import uvicorn  # noqa: E402

import tinyllm  # noqa: E402
from tinyllm.server import ServerOptions, build_app, chat_prompt_ids  # noqa: E402
from tinyllm.server.app import uvicorn_config  # noqa: E402
from tiny_gguf import tiny_llama  # noqa: E402

SERVE = Path(__file__).resolve().parent.parent / "scripts" / "serve.py"
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    tiny_llama(p, metadata={"llama.context_length": 256, "tokenizer.chat_template": CHATML})
    return p


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return tinyllm.load(tiny_path)


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class Running:
    """A Server on a free 127.0.0.1 port, run by uvicorn in a thread of this process."""

    def __init__(self, server, **limits):
        self.server, sock = server, free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn_config(server, log_level="warning", graceful_timeout=5, **limits))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.uv.started and server.loop.ready.is_set()):
            assert time.monotonic() < deadline, "the server did not start within 60 s"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def post(self, path, body, **kw):
        return self.http.post(path, json=body, **kw)

    def idle(self, timeout=10.0) -> bool:
        """Wait until the engine holds no request and no block (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.server.engine
            if not e.has_unfinished() and e.pool.allocator.num_used == 0 and not self.server.loop.active:
                return True
            time.sleep(0.01)
        return False

    def close(self):
        self.http.close()
        self.uv.should_exit = True
        self.thread.join(15)


@pytest.fixture
def running(tiny):
    servers = []

    def start(options=None, **engine_kwargs):
        engine_kwargs.setdefault("num_blocks", 64)
        engine_kwargs.setdefault("block_size", 4)
        r = Running(build_app(tiny, options or ServerOptions(model_name="tiny"), **engine_kwargs))
        servers.append(r)
        return r

    yield start
    for r in servers:
        r.close()


@pytest.fixture(scope="module")
def shared(tiny):
    """One server for the tests that only send requests and read answers."""
    r = Running(build_app(tiny, ServerOptions(model_name="tiny"), num_blocks=64, block_size=4))
    yield r
    r.close()


def sse(lines) -> list:
    """Server-sent events -> the decoded JSON chunks, checking the stream ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# --- answers equal tinyllm.generate ---------------------------------------------------------------------------------
def test_completion_greedy_equals_generate_and_usage_counts(running, tiny):
    srv = running()
    for ignore_eos in (False, True):
        r = srv.post("/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 12,
                                         "temperature": 0, "ignore_eos": ignore_eos})
        assert r.status_code == 200, r.text
        ref = tinyllm.generate(tiny, "hello world", max_new_tokens=12, ignore_eos=ignore_eos)
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        (choice,) = body["choices"]
        assert choice["text"] == ref.text
        assert choice["finish_reason"] == {"eos": "stop", "length": "length"}[ref.finish_reason]
        assert body["usage"] == {"prompt_tokens": len(tiny.tokenizer.encode("hello world")),
                                 "completion_tokens": len(ref.token_ids),
                                 "total_tokens": len(ref.token_ids) + len(ref.prompt_ids)}
    # token ids as the prompt, and a seeded sample reproduces
    ids = tiny.tokenizer.encode("abc")
    a, b = (srv.post("/v1/completions", {"prompt": ids, "max_tokens": 10, "temperature": 1.0, "seed": 4,
                                         "ignore_eos": True}).json()["choices"][0]["text"] for _ in range(2))
    assert a == b == tinyllm.generate(tiny, ids, max_new_tokens=10, temperature=1.0, seed=4, ignore_eos=True).text


def test_kv_dtype_reaches_the_pool_and_answers_as_generate_does(running, tiny):
    srv = running(kv_dtype="int8")
    assert srv.server.engine.pool.kv_dtype == "int8"
    r = srv.post("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    ref = tinyllm.generate(tiny, "hello world", max_new_tokens=8, ignore_eos=True, kv_dtype="int8")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


def test_chat_stream_is_openai_chunks_and_contents_are_text(running, tiny):
    srv = running()
    messages = [{"role": "user", "content": "say <|im_end|> please"}]
    ids = srv.post("/tokenize", {"messages": messages}).json()["tokens"]
    im_end = tiny.tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and ids.count(im_end[0]) == 2            # the template's two, none from the content
    assert ids == chat_prompt_ids(tiny.tokenizer, messages)
    with srv.http.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 15, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r.iter_lines())
    ref = tinyllm.generate(tiny, ids, max_new_tokens=15)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ref.text
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == [{"eos": "stop", "length": "length"}[ref.finish_reason]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ref.token_ids)
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids)


def test_n_samples_and_logprobs(running, tiny):
    srv = running()
    body = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3,
                                             "max_tokens": 6, "temperature": 1.0, "seed": 1, "ignore_eos": True,
                                             "logprobs": True, "top_logprobs": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18
    assert len({c["message"]["content"] for c in body["choices"]}) > 1       # independent samples
    for c in body["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == 6
        for item in content:
            assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 2
            assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
            assert item["top_logprobs"][0]["logprob"] >= item["logprob"]
    greedy = srv.post("/v1/completions", {"prompt": "hello", "max_tokens": 5, "temperature": 0, "logprobs": 1,
                                          "ignore_eos": True}).json()["choices"][0]
    lp = greedy["logprobs"]
    assert "".join(lp["tokens"]) == greedy["text"] or len(lp["tokens"]) == 5
    assert all(lp["top_logprobs"][k][t] == lp["token_logprobs"][k] for k, t in enumerate(lp["tokens"]))
    assert srv.idle()


# --- many clients -------------------------------------------------------------------------------------------------
async def _stream_text(client, prompt, max_tokens, stop_after=None):
    """Stream a completion; with stop_after, close the connection after that many chunks. -> (text, chunks)."""
    text, n = "", 0
    async with client.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                n += 1
                if stop_after is not None and n >= stop_after:
                    return text, n                                 # leaving the block closes the connection
    return text, n


def test_16_concurrent_streams_equal_solo_and_aborted_half_frees_blocks(running, tiny):
    srv = running(max_num_seqs=16, num_blocks=200)
    prompts = [f"request {i}: " + "ab" * i for i in range(16)]
    solo = [tinyllm.generate(tiny, p, max_new_tokens=40, ignore_eos=True).text for p in prompts]

    async def main(abort_half):
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            return await asyncio.gather(*[_stream_text(client, p, 40, 3 if abort_half and i % 2 else None)
                                          for i, p in enumerate(prompts)])

    results = asyncio.run(main(abort_half=False))
    assert [t for t, _ in results] == solo
    assert srv.idle()
    peak = max(s.running for s in srv.server.engine.steps)
    assert peak > 1                                                 # they really ran together
    results = asyncio.run(main(abort_half=True))
    for i, (text, n) in enumerate(results):
        if i % 2 == 0:
            assert text == solo[i]
        else:
            assert n == 3
    assert srv.idle(), "blocks still allocated after the aborted streams"
    reasons = [r.finish_reason for r in srv.server.engine.requests.values()]
    assert reasons.count("abort") >= 1                              # most end before finishing; none leaks
    srv.server.engine.pool.allocator.check_invariants()


def gate_engine(server, delay=None):
    """Hold the engine thread at each step until the returned Event is set (or slow each step by `delay` s)."""
    gate, step = threading.Event(), server.engine.step

    def held():
        if delay is not None:
            time.sleep(delay)
        else:
            gate.wait(30)
        return step()
    server.engine.step = held
    return gate


def test_overload_gives_429_and_the_rest_still_works(running, tiny):
    srv = running(ServerOptions(model_name="tiny", max_waiting=2), max_num_seqs=1)
    gate = gate_engine(srv.server)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            async def one(i):
                await asyncio.sleep(0.05 * i)                     # arrive one after another
                return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                                  "temperature": 0, "ignore_eos": True})
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.sleep(0.6)
            gate.set()
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    refused = next(r for r in responses if r.status_code == 429).json()["error"]
    assert "overloaded" in refused["message"] and refused["code"] == 429
    ref = tinyllm.generate(tiny, "hi", max_new_tokens=4, ignore_eos=True).text
    assert all(r.json()["choices"][0]["text"] == ref for r in responses if r.status_code == 200)
    assert srv.idle()


def test_timeout_aborts_and_frees_blocks(running):
    srv = running(ServerOptions(model_name="tiny", request_timeout=0.3))
    gate_engine(srv.server, delay=0.02)                            # 20 ms a step: 200 tokens take 4 s
    r = srv.post("/v1/completions", {"prompt": "hello", "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 504 and "timeout" in r.json()["error"]["message"]
    assert srv.idle()
    with srv.http.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 200, "stream": True,
                                                          "ignore_eos": True}) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]" and json.loads(chunks[-2][6:])["error"]["code"] == 504
    assert srv.idle()


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty is not supported"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "unknown parameter 'frobnicate'"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, "max_model_len"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 17, "stream": True}, "max-num-seqs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream: true"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools is not supported"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
])
def test_malformed_requests_give_400_with_an_openai_error(shared, path, body, message):
    srv = shared
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = srv.http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
    assert srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200   # still serving


def test_models_tokenize_health_metrics_and_api_key(running, tiny):
    srv = running(ServerOptions(model_name="tiny", api_key="sekret"))
    auth = {"Authorization": "Bearer sekret"}
    assert srv.http.get("/health").status_code == 200 and srv.http.get("/ready", headers=auth).json()["ready"]
    assert srv.http.get("/v1/models").status_code == 401
    models = srv.http.get("/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    assert srv.post("/v1/completions", {"prompt": "x", "model": "gpt-4"}, headers=auth).status_code == 404
    toks = srv.post("/tokenize", {"prompt": "hello"}, headers=auth).json()
    assert toks["tokens"] == tiny.tokenizer.encode("hello") and toks["count"] == len(toks["tokens"])
    assert srv.post("/detokenize", {"tokens": toks["tokens"]}, headers=auth).json()["prompt"] == "hello"
    for max_tokens in (5, 7):
        srv.post("/v1/completions", {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}, headers=auth)
    text = srv.http.get("/metrics", headers=auth).text
    assert srv.idle()

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
        return float(line.rsplit(" ", 1)[1])
    assert value("tinyllm:generation_tokens_total") == 12
    assert value("tinyllm:prompt_tokens_total") == 2 * len(toks["tokens"])
    assert value("tinyllm:time_to_first_token_seconds_count") == 2
    assert value("tinyllm:inter_token_latency_seconds_count") == 4 + 6
    assert value("tinyllm:e2e_request_latency_seconds_count") == 2
    assert value("tinyllm:request_queue_time_seconds_count") == 2
    assert 'tinyllm:request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "prefix_cache_queries_total", "num_preemptions_total"):
        assert f"tinyllm:{name}" in text


def test_draining_refuses_new_requests_and_is_not_ready(running):
    srv = running()
    srv.server.draining = True                                     # what SIGTERM sets (see serve())
    r = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert srv.http.get("/ready").status_code == 503 and srv.http.get("/health").status_code == 200


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="needs per-thread CPU clocks (Linux)")
def test_engine_thread_sleeps_when_idle(running):
    srv = running()
    srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert srv.idle()
    clock = time.pthread_getcpuclockid(srv.server.loop.thread.ident)
    cpu0 = time.clock_gettime(clock)
    time.sleep(0.5)
    assert time.clock_gettime(clock) - cpu0 < 0.05                 # blocked on its queue, not spinning


def test_load_generator_against_the_server(running):
    sys.path.append(str(SERVE.parent.parent / "benchmarks"))
    import load
    srv = running()
    s = load.run_once(srv.url, rate=50.0, num_requests=6, max_concurrency=3, prompt_len=(4, 12), output_len=(3, 6))
    assert s["completed"] == 6 and s["errors"] == 0
    assert s["ttft_s"]["p50"] > 0 and s["itl_s"]["p95"] >= s["itl_s"]["p50"] > 0 and s["output_throughput"] > 0
    assert srv.server.engine.counters["generation_tokens"] == sum(
        r.output_tokens for r in load.make_workload(load.RemoteTokenizer(srv.url), 6, 50.0, prompt_len=(4, 12),
                                                    output="uniform", output_len=(3, 6), seed=0))
    with pytest.raises(SystemExit, match="only targets 127.0.0.1"):
        load.check_local("http://example.com:8000")


# --- SIGTERM ------------------------------------------------------------------------------------------------------
SLOW_SERVER = """
import sys, time
sys.path.insert(0, {repo!r})
import tinyllm
from tinyllm.server import ServerOptions, build_app, serve
server = build_app(tinyllm.load({model!r}), ServerOptions(model_name="tiny", drain_timeout={drain}),
                   num_blocks=80, block_size=4)
step = server.engine.step
def slow_step():                      # 10 ms a step: a 240-token stream takes 2.4 s, long enough to signal
    time.sleep(0.01)
    return step()
server.engine.step = slow_step
serve(server, port={port}, log_level="warning")
"""


@pytest.mark.parametrize("drain", [30, 0.5])
def test_sigterm_drains_running_streams_within_the_bound(tiny_path, drain):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    code = SLOW_SERVER.format(repo=str(SERVE.parent.parent), model=str(tiny_path), drain=drain, port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the server was not ready within 120 s"
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        chunks, last, signalled, lines = 0, None, None, []
        plain = []                                                 # a non-streaming client, cut by the drain

        def collect():
            plain.append(httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 240, "temperature": 0, "ignore_eos": True}))
        waiter = threading.Thread(target=collect)
        waiter.start()
        while "tinyllm:num_requests_running{model_name=\"tiny\"} 1.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the non-streaming request did not start"
            time.sleep(0.02)
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "hello", "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if chunks == 1:
                            proc.send_signal(signal.SIGTERM)       # mid-stream
                            signalled = time.monotonic()
                            time.sleep(0.2)
                            try:                                   # nothing new is admitted
                                late = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=2)
                                assert late.status_code == 503     # still listening, but draining
                            except httpx.TransportError:
                                pass                               # no longer listening
                    if line:
                        last = line
                        lines.append(line)
        except httpx.TransportError:
            pass
        waiter.join(60)
        proc.wait(30)
        assert last == "data: [DONE]"                              # every stream ends properly
        if drain == 30:
            assert chunks == 240 and plain[0].status_code == 200   # the running requests finished in full
        else:
            assert chunks < 240 and time.monotonic() - signalled < 10       # ended at the bound, with an error
            assert json.loads(lines[-2][6:])["error"]["code"] == 503
            assert plain[0].status_code == 503 and "shutting down" in plain[0].json()["error"]["message"]
        err = proc.stderr.read().decode()
        assert "Traceback" not in err and "Exception" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


IDLE_SERVER = """
import signal, sys, threading, time
sys.path.insert(0, {repo!r})
import tinyllm
from tinyllm.server import ServerOptions, build_app, serve
server = build_app(tinyllm.load({model!r}), ServerOptions(model_name="tiny"), num_blocks=80, block_size=4)
def signal_on_this_thread():          # what the OS may do with a process's SIGTERM: hand it to any thread
    server.loop.ready.wait()
    time.sleep(1.0)                   # the engine thread is idle, waiting for a command
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
threading.Thread(target=signal_on_this_thread, daemon=True).start()
serve(server, port={port}, log_level="warning")
print("stopped", flush=True)
"""


def test_an_idle_server_stops_on_a_sigterm_another_thread_took(tiny_path):
    """Python runs signal handlers on the main thread, where serve() runs the engine: a SIGTERM the OS hands to
    another thread must still stop a server whose engine waits idle for requests (seen: an idle server that
    ignored it)."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    code = IDLE_SERVER.format(repo=str(SERVE.parent.parent), model=str(tiny_path), port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.decode().strip() == "stopped", err.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


ONE_THREAD_SERVER = """
import sys, threading
sys.path.insert(0, {repo!r})
import tinyllm
from tinyllm.server import ServerOptions, build_app, serve
server = build_app(tinyllm.load({model!r}), ServerOptions(model_name="tiny"), num_blocks=80, block_size=4)
step, threads = server.engine.step, set()
def recorded_step():
    threads.add(threading.current_thread().name)
    return step()
server.engine.step = recorded_step
serve(server, port={port}, log_level="warning")
print("steps ran on:", sorted(threads), flush=True)
"""


def test_serve_steps_the_engine_on_the_thread_that_loaded_the_model(tiny_path):
    """OpenMP gives each thread that starts parallel kernels its own workers; with a second pool (the loading
    thread's, then an engine thread's) the workers outnumber the cores and libgomp cuts their waits short, which
    made every kernel of a step wait for a wake-up (one stream over HTTP at a third of generate's speed). So
    serve() steps the engine on the thread that called it, uvicorn on another, and the signals still stop it."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    code = ONE_THREAD_SERVER.format(repo=str(SERVE.parent.parent), model=str(tiny_path), port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the server was not ready within 120 s"
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert out.decode().strip() == "steps ran on: ['MainThread']"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_script_bad_model_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(SERVE), "--model", str(tmp_path / "missing.gguf")],
                       capture_output=True, timeout=120)
    assert r.returncode == 2
    err = r.stderr.decode().strip()
    assert err.startswith("error:") and "\n" not in err


# --- the official client, the default model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(default_model):
    pytest.importorskip("openai", reason="needs the openai client: pip install -e \".[serve,test]\"")
    r = Running(build_app(default_model, ServerOptions(model_name="SmolLM2-135M-Instruct"), kv_memory="64MiB"))
    yield r
    r.close()


def test_openai_client_completion_equals_generate(real_server, default_model):
    import openai
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none")
    prompt = "The capital of France is"
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0)
    ref = tinyllm.generate(default_model, prompt, max_new_tokens=16)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(default_model.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.slow
def test_openai_client_streamed_chat_equals_generate(real_server, default_model):
    import openai
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = tinyllm.generate(default_model, messages, max_new_tokens=40)
    assert text == ref.text and "Paris" in text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_ids)
    assert real_server.idle()
