"""The server attacked as a careful tester would, on 127.0.0.1 only, every loop bounded (issue 36): malformed and
fuzzed bodies get a 4xx with OpenAI's error body and leave no traceback; one client cannot stall the others
(body size, the length bound before tokenizing, caps on lists, the capacity endpoint, replays); no client reads
another's prompt through the lab; the API key, Host and Origin checks; disconnects and the drain end every
request cleanly; forks count against max_num_seqs; slow sockets are closed. Tiny random model."""
import asyncio
import json
import logging
import socket
import statistics
import threading
import time

import pytest

for _mod in ("starlette", "uvicorn", "prometheus_client", "httpx", "hypothesis"):
    pytest.importorskip(_mod, reason='needs the serve extra, httpx and hypothesis: pip install -e ".[serve,test]"')

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import tinyllm  # noqa: E402
from tinyllm.engine import Engine  # noqa: E402
from tinyllm.server import ServerOptions, build_app  # noqa: E402
from tinyllm.server import guard as guard_module  # noqa: E402
from tinyllm.server import lab as lab_module  # noqa: E402
from test_server import CHATML, Running, gate_engine  # noqa: E402
from tiny_gguf import tiny_llama  # noqa: E402

PAGE_A, PAGE_B = "page-a-0123456789abcdef", "page-b-0123456789abcdef"     # two lab pages' client tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("hostile") / "tiny.gguf"
    tiny_llama(p, metadata={"llama.context_length": 256, "tokenizer.chat_template": CHATML})
    return tinyllm.load(p)


class ErrorLog(logging.Handler):
    """Collects ERROR records of uvicorn and asyncio: a traceback from the app lands here. uvicorn's Config resets
    its loggers' handlers (logging.config.dictConfig), so attach() runs again after every server is made."""

    NAMES = ("uvicorn.error", "uvicorn", "asyncio")

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def attach(self):
        for name in self.NAMES:
            if self not in logging.getLogger(name).handlers:
                logging.getLogger(name).addHandler(self)

    def emit(self, record):
        self.records.append(record)

    def texts(self):
        return [r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") for r in self.records]


@pytest.fixture(scope="module")
def errors():
    handler = ErrorLog()
    yield handler
    for name in ErrorLog.NAMES:
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture(autouse=True)
def fresh_errors(errors):
    errors.attach()
    errors.records.clear()                               # each test answers for its own log


@pytest.fixture(scope="module")
def shared(tiny, errors):
    r = Running(build_app(tiny, ServerOptions(model_name="tiny"), num_blocks=64, block_size=4))
    errors.attach()
    yield r
    r.close()


@pytest.fixture
def running(tiny, errors):
    servers = []

    def start(options=None, limits=None, **engine_kwargs):
        engine_kwargs.setdefault("num_blocks", 64)
        engine_kwargs.setdefault("block_size", 4)
        r = Running(build_app(tiny, options or ServerOptions(model_name="tiny"), **engine_kwargs), **(limits or {}))
        errors.attach()
        servers.append(r)
        return r

    yield start
    for r in servers:
        r.close()
    assert not [t for t in errors.texts() if "graceful shutdown" in t], "a handler was still waiting at shutdown"


def raw(url: str, data: bytes, read: bool = True, timeout: float = 10.0) -> bytes:
    """Send bytes on a fresh socket (no client library to fix them up) -> what came back before it closed."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
        return out


def post_raw(url: str, path: str, body: bytes, extra: str = "", send_body: bool = True) -> tuple[int, bytes]:
    """POST on a raw socket -> (status, response body). send_body=False: only the head, which promises the body."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode()
    reply = raw(url, head + body if send_body else head)
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


def assert_openai_error(status: int, body: bytes, expected: int, words: str = ""):
    assert status == expected, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["code"] == expected and isinstance(err["message"], str) and words in err["message"], err


def assert_no_tracebacks(errors, server):
    assert errors.texts() == [], errors.texts()
    assert server.loop.error is None


# --- 1. no 500s: malformed bodies -------------------------------------------------------------------------------------
DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = [
    ("/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}', "surrogate"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\udfff"}]}', "surrogate"),
    ("/tokenize", rb'{"prompt": "\ud800"}', "surrogate"),
    ("/v1/completions", rb'{"prompt": "hi", "\ud800": 1}', "surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 4000 + b"}", "64 bits"),
    ("/v1/completions", DEEP, "nested too deeply"),
    ("/lab/api/capacity", DEEP, "nested too deeply"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "not finite"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', "not finite"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ' + b"[" * 20 + b"]" * 20 + b"}", "nested too deeply"),
    ("/v1/completions", b"\xff\xfe\x00garbage", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/detokenize", b'{"tokens": [1, 2e308]}', ""),
]


@pytest.mark.parametrize("path, body, words", HOSTILE, ids=range(len(HOSTILE)))
def test_malformed_bodies_get_400_and_no_traceback(shared, errors, path, body, words):
    status, reply = post_raw(shared.url, path, body)
    assert_openai_error(status, reply, 400, words)
    assert_no_tracebacks(errors, shared.server)


def test_cut_bodies_and_lying_lengths_leave_no_traceback(shared, errors):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for i in range(3):                                   # the client promises 100 bytes, sends 10, leaves
        raw(shared.url, head + b"Content-Length: 100\r\n\r\n" + b'{"prompt":', read=False)
    status, reply = post_raw(shared.url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert status == 200
    time.sleep(0.3)                                      # the server noticed the cut bodies by now
    assert_no_tracebacks(errors, shared.server)


JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)    # lone surrogates
KEYS = st.sampled_from(["prompt", "messages", "max_tokens", "n", "stop", "temperature", "top_p", "top_k", "seed",
                        "logprobs", "top_logprobs", "stream", "stream_options", "model", "tokens", "request_id",
                        "token", "layer", "repetition_penalty", "min_p", "layers", "output_tokens"]) | st.text(max_size=8)
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner,
                                                                                                 max_size=4),
                          max_leaves=12)
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/lab/api/capacity",
         "/lab/api/inspect"]


def fuzz_once(server, path, body):
    data = json.dumps(body).encode()                     # NaN, Infinity and \ud800 escapes included
    if path.startswith("/v1/") and isinstance(body, dict):
        body.setdefault("max_tokens", 4)                 # keep generation short when a body is valid
        data = json.dumps(body).encode()
    r = server.http.post(path, content=data, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, data[:300], r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and isinstance(err["message"], str)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=st.dictionaries(KEYS, JSON_VALUE, max_size=6) | JSON_VALUE)
def test_fuzzed_json_bodies_get_no_5xx(shared, errors, path, body):
    fuzz_once(shared, path, body)
    assert_no_tracebacks(errors, shared.server)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=st.dictionaries(KEYS, JSON_VALUE, max_size=8) | JSON_VALUE)
def test_fuzzed_json_bodies_get_no_5xx_many(shared, errors, path, body):
    fuzz_once(shared, path, body)
    assert_no_tracebacks(errors, shared.server)


# --- 2. one client cannot stall the others ---------------------------------------------------------------------------
def health_latencies(url: str, stop: threading.Event, out: list):
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)


def while_polling_health(url: str, action):
    """Run action() while another thread times /health -> (its result, the latencies)."""
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=health_latencies, args=(url, stop, latencies))
    poller.start()
    time.sleep(0.05)
    try:
        result = action()
        deadline = time.monotonic() + 5
        while len(latencies) < 5 and time.monotonic() < deadline:    # a quick refusal: a few more polls after
            time.sleep(0.01)
    finally:
        stop.set()
        poller.join(10)
    return result, latencies


def assert_health_prompt(latencies):
    # /health must answer within 100 ms; the median says it does, the max allows for a loaded 2-core CI host
    # (before the fix it stalled for the whole tokenization: 29 s for 4 MB)
    assert len(latencies) >= 3 and statistics.median(latencies) < 0.1 and max(latencies) < 1.0, latencies


def test_a_4mb_prompt_is_refused_at_once_and_health_answers_meanwhile(running, errors):
    big = json.dumps({"prompt": "hello world " * 350_000, "max_tokens": 2}).encode()       # 4.2 MB
    srv = running()                                   # the default limit, 1 MiB: 413 from the Content-Length alone
    (status, reply), latencies = while_polling_health(
        srv.url, lambda: post_raw(srv.url, "/v1/completions", big, send_body=False))
    assert_openai_error(status, reply, 413, "--max-body-bytes")
    assert_health_prompt(latencies)
    wide = running(ServerOptions(model_name="tiny", max_body_bytes=8 << 20))  # body taken: the length bound
    t0 = time.perf_counter()
    (status, reply), latencies = while_polling_health(wide.url, lambda: post_raw(wide.url, "/v1/completions", big))
    assert_openai_error(status, reply, 400, "max_model_len")
    assert time.perf_counter() - t0 < 5                                   # refused before tokenizing
    assert_health_prompt(latencies)
    assert_no_tracebacks(errors, srv.server)


def test_a_chunked_body_over_the_limit_gets_413(running):
    srv = running(ServerOptions(model_name="tiny", max_body_bytes=1024))

    def chunks():                                        # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(12):
            yield b"x" * 100                             # 1,214 bytes in all
        yield b'"}'
    r = srv.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "hi", "stop": "x" * 257}, "stop"),
    ({"prompt": [1] * 300}, "prompt"),
    ({"messages": [{"role": "user", "content": "a"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]}, "messages"),
    ({"prompt": "hi", "repetition_penalty": 1e308}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 1e-308}, "repetition_penalty"),
    ({"prompt": "hi", "top_k": 2 ** 64 - 1, "max_tokens": 2}, None),      # a valid request
])
def test_caps_on_lists_and_numbers(shared, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = shared.post(path, body)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = shared.post("/detokenize", {"tokens": [1] * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_a_long_model_name_is_not_echoed_in_full(shared):
    r = shared.post("/v1/completions", {"prompt": "hi", "model": "m" * 500_000})
    assert r.status_code == 404 and len(r.content) < 1000 and "500,002 characters" in r.json()["error"]["message"]


CAPACITY = dict(layers=32, kv_heads=32, head_dim=128, bytes_per_value=2, params=7e9, weight_gb=14, memory_gib=80,
                usable_fraction=0.9, bandwidth_gbs=2000, peak_tflops=200, context=1000, batch=1, prompt_tokens=2000,
                output_tokens=500)


@pytest.mark.parametrize("change", [dict(output_tokens=10_000_000), dict(params=1e308), dict(context=10 ** 300),
                                    dict(context=10 ** 18),
                                    dict(bandwidth_gbs=1e300), dict(weight_gb=-1), dict(batch=1.5),
                                    dict(memory_gib="80")])
def test_capacity_refuses_what_it_cannot_compute(shared, change):
    t0 = time.perf_counter()
    r = shared.post("/lab/api/capacity", {**CAPACITY, **change})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"] in change or "64 bits" in err["message"]), r.text
    assert time.perf_counter() - t0 < 2


def test_capacity_at_its_bound_runs_off_the_event_loop(shared):
    body = {**CAPACITY, "output_tokens": 1_000_000}          # the largest list it builds
    r, latencies = while_polling_health(shared.url, lambda: shared.post("/lab/api/capacity", body))
    assert r.status_code == 200 and r.json()["itl_s"] > 0
    assert_health_prompt(latencies)


# --- 3. the lab: a page sees its own requests' text only; replays one at a time ---------------------------------------
def page(srv, token):
    return httpx.Client(base_url=srv.url, timeout=60, headers={"X-Tinyllm-Client": token})


def test_the_lab_shows_text_and_inspects_only_for_the_page_that_made_the_request(running):
    srv = running(max_num_seqs=4)
    a, b, anonymous = page(srv, PAGE_A), page(srv, PAGE_B), srv.http
    gate_engine(srv.server, delay=0.05)                               # 30 tokens: 1.5 s to look at them
    secret = {"messages": [{"role": "system", "content": "My password is hunter2"},
                           {"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
              "ignore_eos": True}
    done = []
    t = threading.Thread(target=lambda: done.append(a.post("/v1/chat/completions", json=secret).json()))
    t.start()
    try:
        deadline, views = time.monotonic() + 20, {}
        while time.monotonic() < deadline and len(views) < 3:
            for name, client in (("a", a), ("b", b), ("anonymous", anonymous)):
                running_ = client.get("/lab/api/engine").json()["running"]
                if running_ and running_[0]["output_tokens"] > 2:
                    views[name] = running_[0]
            time.sleep(0.02)
    finally:
        t.join(30)
    assert set(views) == {"a", "b", "anonymous"}
    assert isinstance(views["a"]["text"], str) and views["b"]["text"] is None and views["anonymous"]["text"] is None
    rid = done[0]["id"].removeprefix("chatcmpl-")
    assert views["b"]["id"] == rid                                    # listed, without its text
    for client in (b, anonymous):
        r = client.post("/lab/api/inspect", json={"request_id": rid, "token": 0})
        assert r.status_code == 404 and "hunter2" not in r.text
    r = a.post("/lab/api/inspect", json={"request_id": rid, "token": 0})
    assert r.status_code == 200 and r.json()["replay"]["matches"]
    # a forged token of the wrong shape counts as none
    r = httpx.post(srv.url + "/lab/api/inspect", json={"request_id": rid, "token": 0},
                   headers={"X-Tinyllm-Client": "a"})
    assert r.status_code == 404


def test_many_pollers_share_one_engine_snapshot(running, monkeypatch):
    srv = running()
    calls, real = [], srv.server.loop.call
    monkeypatch.setattr(srv.server.loop, "call", lambda *args: calls.append(1) or real(*args))

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            return await asyncio.gather(*[c.get("/lab/api/engine") for _ in range(40)])
    t0 = time.monotonic()
    replies = asyncio.run(main())
    assert all(r.status_code == 200 for r in replies)
    assert len(calls) <= 1 + (time.monotonic() - t0) / lab_module.SNAPSHOT_EVERY    # not one per poller


def slow_replays(monkeypatch, delay: float):
    """Make every replayed token take `delay` s; -> a list the replays' token counts are appended to."""
    counted, real = [], lab_module.stream

    class Run:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)
            self.tokens = 0

        def __iter__(self):
            for x in self.inner:
                time.sleep(delay)
                self.tokens += 1
                counted.append(self.tokens)
                yield x

        @property
        def result(self):
            return self.inner.result
    monkeypatch.setattr(lab_module, "stream", Run)
    return counted


def test_a_replay_runs_alone_and_stops_when_its_client_leaves(running, monkeypatch):
    srv = running()
    a = page(srv, PAGE_A)
    ids = [a.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 40, "temperature": 0,
                                           "ignore_eos": True}).json()["id"].removeprefix("cmpl-") for i in range(2)]
    counted = slow_replays(monkeypatch, 0.05)                         # 40 tokens: 2 s a replay
    body = json.dumps({"request_id": ids[0], "token": 0}).encode()
    head = (f"POST /lab/api/inspect HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Tinyllm-Client: {PAGE_A}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + 10
        while not counted:                                            # the replay has begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = a.post("/lab/api/inspect", json={"request_id": ids[1], "token": 0})
        assert second.status_code == 429 and "another replay" in second.json()["error"]["message"]
        _, latencies = while_polling_health(srv.url, lambda: time.sleep(0.3))   # the replay holds the engine
        assert_health_prompt(latencies)
    # the client left: the replay stops within a token or two, and the engine serves again at once
    deadline = time.monotonic() + 5
    while srv.server.lab.replaying:
        assert time.monotonic() < deadline, "the replay kept running after its client left"
        time.sleep(0.01)
    assert max(counted) < 30
    t0 = time.perf_counter()
    assert srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert time.perf_counter() - t0 < 2


# --- 4. the key, Host and Origin ------------------------------------------------------------------------------------
def test_the_key_guards_every_endpoint_but_health(running, monkeypatch):
    compared = []
    real = guard_module.hmac.compare_digest
    monkeypatch.setattr(guard_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    srv = running(ServerOptions(model_name="tiny", api_key="sekret"))
    auth = {"Authorization": "Bearer sekret"}
    gets = ["/v1/models", "/ready", "/metrics", "/lab/api/presets", "/lab/api/engine"]
    posts = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/lab/api/capacity",
             "/lab/api/inspect"]
    for path in gets:
        assert srv.http.get(path).status_code == 401, path
        assert srv.http.get(path, headers=auth).status_code == 200, path
    for path in posts:
        r = srv.http.post(path, json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert srv.http.post(path, json={}, headers=auth).status_code != 401, path
    assert compared                                                    # compared in constant time
    assert srv.http.get("/health").status_code == 200 and srv.http.get("/lab").status_code == 200
    for wrong in ("Bearer sekret2", "Bearer sekre", "bearer sekret", "sekret", "Bearer  sekret"):
        assert srv.http.get("/v1/models", headers={"Authorization": wrong}).status_code == 401, wrong
    for pair in (["Bearer sekret", "Bearer wrong"], ["Bearer wrong", "Bearer sekret"]):    # never the first decides
        status, reply = post_raw(srv.url, "/tokenize", b'{"prompt": "hi"}',
                                 "".join(f"Authorization: {v}\r\n" for v in pair))
        assert_openai_error(status, reply, 401, "one Authorization header")
    public = running(ServerOptions(model_name="tiny", api_key="sekret", metrics_public=True))
    assert public.http.get("/metrics").status_code == 200 and public.http.get("/v1/models").status_code == 401


def test_host_and_origin_allow_lists(running):
    srv = running()
    port = srv.url.rsplit(":", 1)[1]
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert srv.http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", "0.0.0.0"):
        r = srv.http.get("/v1/models", headers={"Host": host})
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"], host
    for origin in ("http://attacker.example", "null", "http://127.0.0.1.attacker.example:80"):
        r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": origin})
        assert r.status_code == 403, origin
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"Origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 200
    named = running(ServerOptions(model_name="tiny", allowed_hosts=("myserver.lan",)))
    assert named.http.get("/health", headers={"Host": "myserver.lan:8000"}).status_code == 200
    assert named.http.get("/health", headers={"Host": "other.lan"}).status_code == 403
    anyhost = running(ServerOptions(model_name="tiny", allowed_hosts=("*",)))
    assert anyhost.http.get("/health", headers={"Host": "other.lan"}).status_code == 200


# --- 5. disconnects, the drain, admission ---------------------------------------------------------------------------
def test_non_streaming_requests_are_aborted_when_their_clients_leave(running):
    srv = running(max_num_seqs=8)
    gate_engine(srv.server, delay=0.02)                               # 200 tokens: 4 s each
    body = json.dumps({"prompt": "hello", "max_tokens": 200, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    host, port = srv.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(6)]
    for s in socks:
        s.sendall(head + body)
    time.sleep(0.4)
    for s in socks:
        s.close()
    assert srv.idle(timeout=2.0), "requests kept running after their clients left"
    deadline = time.monotonic() + 2
    while srv.uv.server_state.tasks:                                  # and their handlers ended
        assert time.monotonic() < deadline, "handlers still wait for requests whose clients left"
        time.sleep(0.01)
    tokens = [len(r.output_ids) for r in srv.server.engine.requests.values()]
    assert len(tokens) == 6 and max(tokens) < 150
    assert all(r.finish_reason == "abort" for r in srv.server.engine.requests.values())


def test_the_drain_ends_every_request_cleanly(running, errors):
    srv = running(ServerOptions(model_name="tiny", drain_timeout=0.5), max_num_seqs=8)
    gate_engine(srv.server, delay=0.02)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            async def streamed():
                lines = []
                async with c.stream("POST", "/v1/completions", json={
                        "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                return lines

            async def plain():
                return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True})
            tasks = [asyncio.create_task(streamed()) for _ in range(3)] + [asyncio.create_task(plain())
                                                                           for _ in range(2)]
            await asyncio.sleep(0.5)
            srv.server.drain()                                        # what SIGTERM calls (serve())
            late = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return await asyncio.gather(*tasks), late

    t0 = time.monotonic()
    (results, late) = asyncio.run(main())
    assert time.monotonic() - t0 < 4                                  # ended at the drain's bound, not 4 s later
    assert late.status_code == 503
    for lines in results[:3]:
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 503
    for r in results[3:]:
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert srv.idle() and srv.server.loop.thread.is_alive()
    assert_no_tracebacks(errors, srv.server)


def test_max_num_seqs_counts_the_samples_still_to_fork(tiny):
    engine = Engine(tiny, num_blocks=200, block_size=4, max_num_seqs=4, long_prefill_tokens=4)
    prompt = tiny.tokenizer.encode("a long prompt that takes several steps to prefill")
    for i in range(4):
        engine.add_request(f"r{i}", prompt, max_tokens=6, n=2, stop_token_ids=())
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 4 and all(r.finish_reason == "length" for r in engine.requests.values())


# --- 6. slow sockets --------------------------------------------------------------------------------------------------
def test_slow_headers_are_cut_and_connections_capped(running):
    srv = running(limits=dict(header_timeout=0.5, max_connections=4))
    host, port = srv.url.removeprefix("http://").split(":")
    srv.http.close()                                   # the test client's own connection would count
    idle = [socket.create_connection((host, int(port))) for _ in range(4)]
    idle[0].sendall(b"GET /health HTTP/1.1\r\nHo")    # a head that never ends
    time.sleep(0.1)
    over = raw(srv.url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert over.startswith(b"HTTP/1.1 503")            # over the cap
    t0 = time.monotonic()
    for s in idle:
        s.settimeout(5)
        assert s.recv(100) == b""                      # closed by the server
    assert time.monotonic() - t0 < 3
    for s in idle:
        s.close()
    ok = raw(srv.url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200")
    srv.http = httpx.Client(base_url=srv.url, timeout=60)


def test_a_body_that_trickles_gets_408(running, monkeypatch):
    from tinyllm.server import app as app_module
    monkeypatch.setattr(app_module, "BODY_TIMEOUT", 0.3)
    srv = running()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    t0 = time.monotonic()
    reply = raw(srv.url, head + b'{"prompt":')                      # 90 bytes never come
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408


def test_settings_that_would_leave_the_server_open_are_refused(tiny, monkeypatch, capsys):
    for options in (ServerOptions(api_key=""), ServerOptions(max_body_bytes=0)):
        with pytest.raises(ValueError, match="API key|max_body_bytes"):
            build_app(tiny, options, num_blocks=8, block_size=4)
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("serve_script", Path(__file__).parent.parent / "scripts" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    monkeypatch.setenv("TINYLLM_API_KEY", "never-printed")
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    assert "never-printed" not in capsys.readouterr().out                # the key is read in main, not a default
    assert serve.main(["--max-connections", "0"]) == 2
