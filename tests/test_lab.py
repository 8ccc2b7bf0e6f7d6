"""The inference lab (/lab): its JSON endpoints over HTTP, and the page itself in a real headless Chromium.

In the browser: the page loads with no console error; a greedy generation shows tinyllm.generate's text; clicking
a token shows an attention row summing to 1 and a replay that matched the stream; two concurrent requests both
own blocks in the pool view, which are free again when they finish; the calculator reproduces the seed's 512 KiB
of KV per token. The browser tests need Playwright and a Chromium (Debian's `chromium`; $TINYLLM_CHROMIUM names
another) and skip without them; CI installs both (.ci/run). Tiny random model, except the test marked slow.
"""
import dataclasses
import fnmatch
import json
import os
import shutil
import threading
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest

for _mod in ("starlette", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason='needs the serve extra and httpx: pip install -e ".[serve,test]"')

import tinyllm  # noqa: E402
from tinyllm.server import ServerOptions, build_app  # noqa: E402
from tinyllm.server import lab as lab_module  # noqa: E402
from tinyllm.server.lab import STATIC  # noqa: E402
from test_server import CHATML, Running  # noqa: E402
from tiny_gguf import tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
A_7B = dict(layers=32, kv_heads=32, head_dim=128, bytes_per_value=2, params=7e9, weight_gb=14)   # the seed's shapes
SEED_HW = dict(memory_gib=80, usable_fraction=0.9, bandwidth_gbs=2000, peak_tflops=200)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("lab") / "tiny.gguf"
    tiny_llama(p, metadata={"llama.context_length": 256, "tokenizer.chat_template": CHATML})
    return tinyllm.load(p)


PAGE = {"X-Tinyllm-Client": "lab-test-page-0123456789"}   # the page's own token: only it sees its requests' text


@pytest.fixture(scope="module")
def lab(tiny):
    r = Running(build_app(tiny, ServerOptions(model_name="tiny"), num_blocks=64, block_size=4, max_num_seqs=4))
    r.http.headers.update(PAGE)
    yield r
    r.close()


def slow_steps(server, delay: float):
    """Make every engine step take at least `delay` s (the tiny model is too fast to watch); -> undo function."""
    step = server.engine.step

    def slowed():
        time.sleep(delay)
        return step()
    server.engine.step = slowed
    return lambda: setattr(server.engine, "step", step)


# --- the JSON endpoints -------------------------------------------------------------------------------------------
def test_inspect_replays_the_request_and_explains_its_token(lab, tiny):
    prompt = "hello world"
    body = lab.post("/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                        "ignore_eos": True}).json()
    rid = body["id"].removeprefix("cmpl-")
    ref = tinyllm.generate(tiny, prompt, max_new_tokens=10, ignore_eos=True)
    P = len(ref.prompt_ids)
    for index in (0, 4, 9):
        r = lab.post("/lab/api/inspect", {"request_id": rid, "token": index, "layer": 1})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["replay"] == {"matches": True, "first_difference": None, "streamed": 10}
        assert d["token"]["id"] == ref.token_ids[index] and d["position"] == P + index - 1
        assert len(d["tokens"]) == P + index
        heads = d["attention"]["heads"]
        assert len(heads) == tiny.config.n_heads and all(len(h) == P + index for h in heads)
        assert all(abs(sum(h) - 1) < 1e-5 for h in heads + [d["attention"]["average"]])
        assert [row["layer"] for row in d["lens"]] == list(range(tiny.config.n_layers))
        # the last layer's lens is the model's own prediction: its top token is greedy's choice
        assert d["lens"][-1]["top"][0]["id"] == ref.token_ids[index]
        stages = d["sampling"]["stages"]
        assert [s["stage"] for s in stages] == ["raw", "greedy"]
        assert stages[0]["top"][0]["id"] == ref.token_ids[index] and d["sampling"]["prob"] == 1.0
    # the same numbers as the trace of tinyllm.generate
    traced = tinyllm.generate(tiny, prompt, max_new_tokens=10, ignore_eos=True, trace=True).trace
    d = lab.post("/lab/api/inspect", {"request_id": rid, "token": 4, "layer": 0}).json()
    assert d["attention"]["heads"][2] == pytest.approx(traced.attention(0)[2, P + 3, :P + 4].tolist(), abs=1e-6)
    # the heatmaps: every position's row up to this one, to 5 significant digits; the residual norms (the sink)
    m = d["attention"]["matrix"]
    assert m["start"] == 0 and np.array(m["heads"]) == pytest.approx(traced.attention(0)[:, :P + 4, :P + 4],
                                                                      rel=1e-4, abs=1e-12)
    assert d["residual_norms"] == pytest.approx(traced.residual_norms(0)[:P + 4, 2].tolist(), rel=1e-6)


def test_inspect_heatmaps_keep_the_last_positions_of_a_long_request(lab, monkeypatch):
    body = lab.post("/v1/completions", {"prompt": "hello world", "max_tokens": 6, "temperature": 0,
                                        "ignore_eos": True}).json()
    monkeypatch.setattr(lab_module, "MATRIX_POSITIONS", 4)           # the JSON grows as positions squared
    d = lab.post("/lab/api/inspect", {"request_id": body["id"].removeprefix("cmpl-"), "token": 5}).json()
    m = d["attention"]["matrix"]
    assert m["start"] == d["position"] - 3 and np.array(m["heads"]).shape == (len(d["attention"]["heads"]), 4, 4)
    assert [row[-1] for row in m["heads"][0][-1:]] == pytest.approx([d["attention"]["heads"][0][-1]], rel=1e-4)


def test_inspect_replays_with_the_served_kv_format(tiny):
    """A server whose pool stores K/V as int8 replays with an int8 cache: the attention shown is what it used."""
    r = Running(build_app(tiny, ServerOptions(model_name="tiny"), num_blocks=64, block_size=4, max_num_seqs=4,
                          kv_dtype="int8"))
    r.http.headers.update(PAGE)
    try:
        body = r.post("/v1/completions", {"prompt": "hello world", "max_tokens": 6, "temperature": 0,
                                          "ignore_eos": True}).json()
        d = r.post("/lab/api/inspect", {"request_id": body["id"].removeprefix("cmpl-"), "token": 5,
                                        "layer": 0}).json()
        ref = tinyllm.generate(tiny, "hello world", max_new_tokens=6, ignore_eos=True, kv_dtype="int8", trace=True)
        P = len(ref.prompt_ids)
        assert d["replay"]["matches"] and d["token"]["id"] == ref.token_ids[5]
        assert d["attention"]["heads"][1] == pytest.approx(ref.trace.attention(0)[1, P + 4, :P + 5].tolist(), abs=1e-6)
    finally:
        r.close()


@pytest.mark.parametrize("body, status, message", [
    ({"request_id": "nope", "token": 0}, 404, "made by this page"),
    ({"token": 0}, 400, "request_id"),
    ({"request_id": "x", "token": "1"}, 400, "token must be an integer"),
])
def test_inspect_bad_input_is_one_clear_line(lab, body, status, message):
    r = lab.post("/lab/api/inspect", body)
    assert r.status_code == status and message in r.json()["error"]["message"]


def test_inspect_refuses_unseeded_samples_bad_indices_and_long_traces(lab, monkeypatch):
    body = lab.post("/v1/completions", {"prompt": "abc", "max_tokens": 3, "temperature": 1.0,
                                        "ignore_eos": True}).json()
    r = lab.post("/lab/api/inspect", {"request_id": body["id"].removeprefix("cmpl-"), "token": 0})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    body = lab.post("/v1/completions", {"prompt": "abc", "max_tokens": 3, "temperature": 0.7, "seed": 3, "top_k": 20,
                                        "top_p": 0.9, "repetition_penalty": 1.3, "ignore_eos": True}).json()
    rid = body["id"].removeprefix("cmpl-")
    d = lab.post("/lab/api/inspect", {"request_id": rid, "token": 1}).json()
    assert d["replay"]["matches"]                                   # a seeded sample replays exactly
    assert [s["stage"] for s in d["sampling"]["stages"]] == ["raw", "repetition penalty", "temperature", "top-k",
                                                              "top-p"]
    r = lab.post("/lab/api/inspect", {"request_id": rid, "token": 3})
    assert r.status_code == 400 and "0 .. 2" in r.json()["error"]["message"]
    monkeypatch.setattr(lab_module, "MAX_REPLAY_POSITIONS", 4)      # a trace's memory grows with its positions
    body = lab.post("/v1/completions", {"prompt": "abc", "max_tokens": 3, "temperature": 0,
                                        "ignore_eos": True}).json()
    r = lab.post("/lab/api/inspect", {"request_id": body["id"].removeprefix("cmpl-"), "token": 0})
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]


def test_engine_snapshot_while_two_requests_run(lab):
    undo = slow_steps(lab.server, 0.05)
    try:
        done = []
        threads = [threading.Thread(target=lambda p=p: done.append(lab.post("/v1/completions", {
            "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json())) for p in ("aaaa", "bbbbb")]
        for t in threads:
            t.start()
        deadline, seen = time.monotonic() + 20, {}
        while time.monotonic() < deadline and len(seen) < 2:
            snap = lab.http.get("/lab/api/engine").json()
            seen.update({r["id"]: r for r in snap["running"]})
            time.sleep(0.02)
        for t in threads:
            t.join(30)
    finally:
        undo()
    assert len(seen) == 2, "both requests should have been seen running together"
    ids = {b["id"].removeprefix("cmpl-") for b in done}
    assert set(seen) == ids
    assert lab.idle()
    snap = lab.http.get("/lab/api/engine").json()
    assert snap["running"] == [] and snap["pool"]["num_used"] == 0
    assert all(b["state"] in ("free", "cached") and not b["owners"] for b in snap["blocks"])
    slots = [set(s["slots"]) for s in snap["timeline"]]
    assert any(len(s) == 2 for s in slots)                          # a step ran both (continuous batching)


def test_engine_snapshot_shows_samples_sharing_their_prompt_blocks(lab):
    undo = slow_steps(lab.server, 0.05)
    try:
        done = []
        t = threading.Thread(target=lambda: done.append(lab.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 3, "temperature": 0.8,
            "seed": 0, "ignore_eos": True}).json()))
        t.start()
        deadline, owners = time.monotonic() + 20, []
        while time.monotonic() < deadline and not owners:
            snap = lab.http.get("/lab/api/engine").json()
            owners = [b["owners"] for b in snap["blocks"] if b["state"] == "shared" and len(b["owners"]) == 3]
            time.sleep(0.01)
        t.join(30)
    finally:
        undo()
    rid = done[0]["id"].removeprefix("chatcmpl-")
    assert owners and sorted(owners[0]) == [rid, f"{rid}/1", f"{rid}/2"]     # the forks hold the prompt's blocks
    assert lab.idle()


def test_capacity_endpoint_reproduces_the_seed(lab):
    body = dict(A_7B, **SEED_HW, context=4096, batch=1, prompt_tokens=2000, output_tokens=500)
    r = lab.post("/lab/api/capacity", body).json()
    assert r["kv_bytes_per_token"] == 524_288                       # 512 KiB
    assert r["kv_bytes_per_sequence"] == 2 * 2**30                  # 2.0 GiB at 4,096 tokens
    assert r["max_sequences"] == 29                                 # (80 GiB x 0.9 - 14 GB) / 2 GiB = 29.5
    r = lab.post("/lab/api/capacity", dict(body, context=1000)).json()
    assert round(r["decode_step_s"] * 1e3, 2) == 7.26 and round(r["tokens_per_s_total"]) == 138
    assert r["bound"] == "memory bandwidth" and r["ridge_flops_per_byte"] == pytest.approx(100)
    bad = lab.post("/lab/api/capacity", dict(body, layers=0))
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "layers must be a number in 1 .. 10000, got 0"
    presets = lab.http.get("/lab/api/presets").json()
    assert presets["models"]["7b"]["layers"] == 32 and presets["models"]["served"]["layers"] == 2
    d = presets["defaults"]
    assert d["context"] >= d["prompt_tokens"] + d["output_tokens"]     # the default request fits its context


def test_capacity_endpoint_says_what_does_not_fit(lab):
    body = dict(A_7B, **SEED_HW, context=4096, batch=64, prompt_tokens=2000, output_tokens=500)
    f = lab.post("/lab/api/capacity", body).json()["fit"]
    assert f["fits"] is False and f["verdict"].startswith("does not fit: needs 141.0 GiB, 69.0 GiB more than")
    assert f["max_batch"] == 29 and f["needed_bytes"] - f["usable_bytes"] == f["over_bytes"]
    r = lab.post("/lab/api/capacity", dict(body, batch=29)).json()
    assert r["fit"]["fits"] and r["warnings"] == []
    r = lab.post("/lab/api/capacity", dict(body, context=1000)).json()     # 2,000 + 500 tokens in a 1,000 context
    assert r["warnings"] == ["a request of 2,000 prompt + 500 output tokens needs 2,500 positions, more than the "
                             "context of 1,000: raise the context (the memory figures use it)"]


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """A cache directory holding a calibration of this machine (made-up roofs: nothing is timed in a test)."""
    from tinyllm import roofs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = roofs.MachineRoofs(bandwidth=12.5e9, peak_flops=90e9, memory=8 * 2**30, threads=2,
                           machine=roofs.this_machine(), measured="2026-12-04T07:00:00Z", source="a test")
    roofs.save_calibration(r)
    return r


def test_this_server_preset_comes_from_the_cached_calibration(lab, calibrated, tmp_path, monkeypatch):
    m = lab.http.get("/lab/api/presets").json()["machine"]
    assert m["hardware"] == {"memory_gib": 8.0, "usable_fraction": 0.9, "bandwidth_gbs": 12.5, "peak_tflops": 0.09}
    assert m["calibration"]["source"] == "a test" and m["file"] == str(tmp_path / "tinyllm" / "calibration.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    m = lab.http.get("/lab/api/presets").json()["machine"]
    assert m["hardware"] is None and m["error"] is None


def test_lab_can_be_turned_off_and_its_files_are_package_data(tiny):
    r = Running(build_app(tiny, ServerOptions(model_name="tiny", lab=False), num_blocks=16, block_size=4))
    try:
        assert r.http.get("/lab").status_code == 404 and r.http.get("/lab/api/engine").status_code == 404
    finally:
        r.close()
    setupcfg = pytest.importorskip("setuptools.config.setupcfg", reason="needs setuptools to read setup.cfg")
    patterns = setupcfg.read_configuration(REPO / "setup.cfg")["options"]["package_data"]["tinyllm.server"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.iterdir()]
    assert {"static/lab.html", "static/lab.css", "static/lab.js"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


def test_serve_script_lab_flag_and_exposure_warnings():
    import importlib.util
    spec = importlib.util.spec_from_file_location("serve_script", REPO / "scripts" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    assert serve.parse_args([]).lab is None and serve.parse_args(["--no-lab"]).lab is False
    assert serve.parse_args(["--lab"]).lab is True
    # the lab and the host: on by default on loopback only, and a warning for it beyond
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("localhost") and serve.is_loopback("::1")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("example.com")
    assert serve.exposure_warnings(True, None, True, ()) == []
    warnings = serve.exposure_warnings(False, None, True, ())
    assert len(warnings) == 3 and "no API key" in warnings[0] and "lab" in warnings[1]


def test_the_page_loads_nothing_from_elsewhere():
    """No CDN, no external font: every src / href the page and its files name is this server's or a data: URL."""
    import re
    for name in ("lab.html", "lab.css", "lab.js"):
        text = (STATIC / name).read_text()
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text), name
        assert "@import" not in text and "url(http" not in text, name


# --- in a real browser --------------------------------------------------------------------------------------------
def chromium_path() -> str | None:
    for candidate in (os.environ.get("TINYLLM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and (shutil.which(candidate) or Path(candidate).is_file()):
            return shutil.which(candidate) or candidate
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason='needs Playwright: pip install -e ".[lab]"')
    exe = chromium_path()
    if exe is None:
        pytest.skip("needs a Chromium: apt-get install chromium (or set TINYLLM_CHROMIUM to its path)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--headless=new", "--no-sandbox", "--disable-gpu",
                                                         "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser, lab):
    """A fresh page on the lab; fails the test if the page logged any console error or threw."""
    pg = browser.new_page(viewport={"width": 1200, "height": 900})
    errors = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(lab.url + "/lab")
    pg.wait_for_selector("body[data-ready=true]", timeout=20_000)
    yield pg
    pg.close()
    assert errors == [], errors


@pytest.mark.slow
def test_page_loads_with_every_section(page):
    for section in ("generate", "inside", "engine", "arithmetic"):
        assert page.locator(f"section#{section}").is_visible()
    assert page.inner_text("#model-name") == "tiny"
    page.wait_for_function("document.querySelectorAll('#pool .block').length === 64")


def generate_in_page(page, prompt: str, max_tokens: int) -> None:
    """A greedy plain completion from the page's Generate view, waited for."""
    page.check("input[name=mode][value=completion]")
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.click("#go")
    page.wait_for_selector("#gen-text[data-done=true]", timeout=20_000)


@pytest.mark.slow
def test_greedy_generation_shows_generate_text_and_a_token_attention_row(page, tiny):
    prompt = "hello there"
    generate_in_page(page, prompt, 12)
    ref = tinyllm.generate(tiny, prompt, max_new_tokens=12)
    assert page.text_content("#gen-text") == ref.text
    boxes = page.locator("#tokens .tok")
    assert boxes.count() == len(ref.token_ids)
    assert "".join(boxes.nth(i).get_attribute("data-text") for i in range(boxes.count())) == ref.text
    assert page.inner_text("#st-tokens") == str(len(ref.token_ids))
    boxes.nth(3).click()
    page.wait_for_selector("#att-row .att", timeout=20_000)
    assert page.get_attribute("#in-replay", "data-matches") == "true"
    for head in ("average", "0", "3"):
        page.select_option("#in-head", head)
        values = [float(v) for v in page.eval_on_selector_all("#att-row .att", "es => es.map(e => e.dataset.p)")]
        assert len(values) == len(ref.prompt_ids) + 3                # positions 0 .. the one that chose token 3
        assert sum(values) == pytest.approx(1, abs=1e-5)
    assert page.locator("#lens tr").count() == tiny.config.n_layers + 1
    page.select_option("#in-layer", "0")                             # another layer: asks the server again
    page.wait_for_function("document.querySelector('#in-layer').value === '0' && "
                           "document.querySelectorAll('#att-row .att').length > 0")


@pytest.mark.slow
def test_two_concurrent_requests_share_the_pool_then_free_it(page, lab):
    # one request first, so that the system prompt's blocks are in the prefix cache when the two arrive together
    lab.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    undo = slow_steps(lab.server, 0.08)
    try:
        page.fill("#eng-n", "2")
        page.fill("#eng-max", "16")
        page.click("#eng-send")
        # both requests own blocks at once (owners are request ids; samples would be id/1 ...)
        page.wait_for_function("""() => {
            const owners = new Set();
            document.querySelectorAll('#pool .block').forEach(b => b.dataset.owners.split(',').filter(x => x)
                .forEach(o => owners.add(o)));
            return owners.size === 2 && document.querySelectorAll('#running .card').length === 2;
        }""", timeout=20_000)
        assert page.locator("#pool .block.shared").count() >= 1       # the system prompt's blocks, held by both
        page.wait_for_function("""() => document.querySelectorAll('#running .card').length === 0 &&
            [...document.querySelectorAll('#pool .block')].every(b => b.dataset.owners === '')""", timeout=30_000)
    finally:
        undo()
    assert lab.idle()
    assert page.locator("#timeline .tl-cell.tok").count() > 0


TIMELINE_GEOMETRY = """box => {
    const cells = [...box.querySelectorAll('.tl-row')].map(r => [...r.querySelectorAll('.tl-cell')].map(c => {
        const b = c.getBoundingClientRect(); return [b.x, b.width, c.className]; }));
    const names = [...box.querySelectorAll('.tl-name')].map(n => n.getBoundingClientRect().x);
    const rows = [...box.querySelectorAll('.tl-row')].map(r => r.getBoundingClientRect().bottom);
    const b = box.getBoundingClientRect();
    return {cells, names, rows, left: b.x, right: b.right, bottom: b.bottom};
}"""


@pytest.mark.slow
def test_slot_timeline_draws_each_step_as_one_column(page, lab):
    """Requests sent together start in the same column: every slot's cell k has the same x and width whether that
    step gave the slot a token, a prompt chunk or nothing; slot names stay put while the steps scroll."""
    undo = slow_steps(lab.server, 0.05)
    try:              # one request alone first: its token cells stand beside idle cells of the other slots
        lab.post("/v1/completions", {"prompt": "alone", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        page.fill("#eng-n", "3")
        page.fill("#eng-max", "8")
        page.click("#eng-send")
        page.wait_for_function("document.querySelectorAll('#running .card').length >= 2", timeout=20_000)
        page.wait_for_function("document.querySelectorAll('#running .card').length === 0", timeout=30_000)
    finally:
        undo()
    assert lab.idle()
    page.wait_for_timeout(800)                                       # a poll after the last step
    g = page.eval_on_selector("#timeline", TIMELINE_GEOMETRY)
    rows = g["cells"]
    assert len(rows) >= 4 and len({len(r) for r in rows}) == 1 and len(rows[0]) >= 10
    kinds = [{r[k][2] for r in rows} for k in range(len(rows[0]))]
    assert any("tl-cell tok" in ks and "tl-cell" in ks for ks in kinds)    # a token beside an idle slot
    assert sum("tl-cell tok" in ks and sum(r[k][2] == "tl-cell tok" for r in rows) >= 2
               for k, ks in enumerate(kinds)) >= 3                      # steps that gave tokens to several slots
    for k in range(len(rows[0])):
        xs, widths = {round(r[k][0], 2) for r in rows}, {round(r[k][1], 2) for r in rows}
        assert len(xs) == 1 and len(widths) == 1, (k, [r[k] for r in rows])
    assert all(bottom <= g["bottom"] for bottom in g["rows"])          # every row inside the box
    # a box narrower than the steps: the steps scroll, the slot names do not, and the newest step is in view
    page.eval_on_selector("#timeline", "box => { box.style.width = '160px'; box.scrollLeft = box.scrollWidth; }")
    page.wait_for_timeout(700)                                       # re-rendered while following the newest step
    end = page.eval_on_selector("#timeline", TIMELINE_GEOMETRY)
    page.eval_on_selector("#timeline", "box => { box.scrollLeft = 0; }")
    start = page.eval_on_selector("#timeline", TIMELINE_GEOMETRY)
    assert end["cells"][0][0][0] < start["cells"][0][0][0]            # the first step scrolled out of view ...
    assert end["names"] == start["names"] and all(x <= end["left"] + 1 for x in end["names"])   # ... the names did not
    assert all(r[-1][0] + r[-1][1] <= end["right"] for r in end["cells"])  # the newest step inside the box


@pytest.mark.slow
def test_calculator_reproduces_the_seed_kv_figure(page):
    page.select_option("#calc-preset", "7b")
    row = page.locator("tr[data-row='KV cache per token'] td.num")
    assert row.inner_text() == "512 KiB"                             # 2 x 32 x 32 x 128 x 2 B
    page.fill("input[name=context]", "4096")
    page.wait_for_function("document.querySelector(\"tr[data-row='KV cache per sequence'] td.num\")"
                           ".textContent === '2 GiB'")
    page.select_option("select[name=bytes_per_value]", "1")          # an int8 cache halves it
    page.wait_for_function("document.querySelector(\"tr[data-row='KV cache per token'] td.num\")"
                           ".textContent === '256 KiB'")
    page.fill("input[name=layers]", "0")
    page.wait_for_selector("#calc-error:not([hidden])")
    assert page.inner_text("#calc-error").startswith("layers:")       # the form's own check, no request sent


@pytest.mark.slow
def test_calculator_says_when_a_batch_does_not_fit(page):
    page.select_option("#calc-preset", "7b")
    context, prompt, output = (int(page.input_value(f"input[name={n}]"))
                               for n in ("context", "prompt_tokens", "output_tokens"))
    assert context >= prompt + output                                  # the default request fits its context
    assert page.get_attribute("#calc-verdict", "data-fits") == "true"
    page.fill("input[name=context]", "4096")
    page.fill("input[name=batch]", "64")
    page.wait_for_function("document.querySelector('#calc-verdict').dataset.fits === 'false'")
    assert page.inner_text("#calc-verdict").startswith("does not fit: needs 141.0 GiB, 69.0 GiB more than the "
                                                       "72.0 GiB usable")
    assert page.get_attribute("#calc-verdict", "class") == "verdict no-fit"
    page.fill("input[name=batch]", "29")
    page.wait_for_function("document.querySelector('#calc-verdict').dataset.fits === 'true'")
    page.fill("input[name=context]", "1000")                           # shorter than 2,000 + 500 tokens
    page.wait_for_function("document.querySelector('#calc-verdict .warning') !== null")
    assert "needs 2,500 positions" in page.inner_text("#calc-verdict .warning")


@pytest.mark.slow
def test_this_server_preset_predicts_with_the_machines_calibration(calibrated, page, lab, tmp_path, monkeypatch):
    """"this server": the served model on this machine's cached roofs, the predicted step beside the measured one;
    without a cache, the page measures on request (measure_roofs replaced: nothing is timed in a test)."""
    from tinyllm import roofs
    page.select_option("#calc-preset", "served")
    assert page.input_value("input[name=bandwidth_gbs]") == "12.5" and page.input_value("input[name=peak_tflops]") == "0.09"
    assert page.input_value("input[name=memory_gib]") == "8"
    assert "a test" in page.inner_text("#calc-machine-text") and "12.5 GB/s" in page.inner_text("#calc-machine-text")
    lab.post("/v1/completions", {"prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    steps = [s["duration"] for s in lab.http.get("/lab/api/engine").json()["timeline"]
             if len(s["slots"]) == 1 and s["tokens"] == 1 and all(c["token"] for c in s["slots"].values())]
    page.fill("input[name=batch]", "1")
    row = "tr[data-row='decode step measured here']"
    # (the page polls the timeline: wait until its snapshot holds every decode step of the request)
    page.wait_for_function(f"document.querySelector(\"{row} td.muted\").textContent.includes("
                           f"'median of the last {len(steps)} decode steps')", timeout=10_000)
    predicted = page.inner_text("tr[data-row='decode step (ITL)'] td.num")
    assert "× the prediction" in page.inner_text(f"{row} td.muted") and predicted.endswith("ms")
    assert float(page.get_attribute(row, "data-measured")) == pytest.approx(np.median(steps), rel=1e-6)
    # no calibration cached: the seed's accelerator until the page measures this machine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    monkeypatch.setattr(roofs, "measure_roofs", lambda **kw: dataclasses.replace(calibrated, bandwidth=20e9, **kw))
    page.reload()
    page.wait_for_selector("body[data-ready=true]", timeout=20_000)
    page.select_option("#calc-preset", "served")
    assert page.input_value("input[name=bandwidth_gbs]") == "2000"
    assert "not been measured" in page.inner_text("#calc-machine-text")
    page.click("#calc-measure")
    page.wait_for_function("document.querySelector('input[name=bandwidth_gbs]').value === '20'", timeout=20_000)
    assert "the lab" in page.inner_text("#calc-machine-text")
    assert roofs.load_calibration().bandwidth == 20e9                  # cached for the next page and the CLI


def shown(text: str) -> str:
    """A token as the page labels it (lab.js's visible(): whitespace made visible)."""
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u00b7"


def punctuation_only(text: str) -> bool:
    return all(c.isspace() or unicodedata.category(c)[0] in "PS" for c in text)


CELLS = "es => es.map(e => [Number(e.dataset.q), Number(e.dataset.k), e.dataset.p, e.getAttribute('fill')])"


@pytest.mark.slow
def test_attention_views_label_both_axes_and_the_toggles_change_them(page, tiny):
    """The large heatmap of a head is its [S, S] attention from the trace with the tokens on both axes, the future
    hatched apart from zeros, and a colour bar; hiding or renormalising position 0 changes what is drawn as
    scripts/attention.py's view() does; the lines view draws a line per attended key; the sink and lens lines quote
    this trace's own numbers."""
    prompt = "hello there"
    generate_in_page(page, prompt, 12)
    page.locator("#tokens .tok").nth(3).click()
    page.wait_for_selector("#att-big svg.heatmap", timeout=20_000)
    ref = tinyllm.generate(tiny, prompt, max_new_tokens=12, trace=True)
    layer, q = tiny.config.n_layers - 1, len(ref.prompt_ids) + 2          # the position that chose token 3
    S, tr = q + 1, ref.trace
    att = tr.attention(layer)[:, :S, :S]                                  # [H, S, S]
    assert page.locator("#att-thumbs .thumb").count() == tiny.config.n_heads + 1
    page.locator("#att-thumbs .thumb[data-head='1']").click()
    assert page.input_value("#in-head") == "1" and page.get_attribute("#att-big", "data-head") == "1"
    labels = [shown(t) for t in tr.tokens[:S]]
    assert page.eval_on_selector_all("#att-big .xlabel", "es => es.map(e => e.textContent)") == labels
    assert page.eval_on_selector_all("#att-big .ylabel", "es => es.map(e => e.textContent)") == labels
    future = {(t, j) for t in range(S) for j in range(S) if j > t}
    cells = page.eval_on_selector_all("#att-big .hm-cell", CELLS)
    assert len(cells) == S * S
    assert {(t, j) for t, j, p, _ in cells if p == ""} == future
    assert all(fill == "url(#future)" for t, j, p, fill in cells if p == "")          # masked: hatched ...
    assert all(fill.startswith("rgb(") for t, j, p, fill in cells if p != "")         # ... a zero: a colour
    assert [float(p) for t, j, p, _ in cells if p != ""] == pytest.approx(
        [float(att[1, t, j]) for t, j, p, _ in cells if p != ""], abs=2e-5)
    ticks = page.eval_on_selector_all("#att-big .colour-bar .tick", "es => es.map(e => e.textContent)")
    assert ticks == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    # hide position 0: its column joins the masked cells, the scale is the largest value left
    page.select_option("#att-first", "hide")
    cells = page.eval_on_selector_all("#att-big .hm-cell", CELLS)
    assert {(t, j) for t, j, p, _ in cells if p == ""} == future | {(t, 0) for t in range(S)}
    rest = att[1][np.tril(np.ones((S, S), dtype=bool)) & (np.arange(S) > 0)]          # j <= t, j > 0
    assert page.eval_on_selector_all("#att-big .colour-bar .tick", "es => es.map(e => e.textContent)")[-1] == \
        f"{rest.max():.2f}"
    # renormalise: each row divided by what the other positions get, so rows 1.. sum to 1 without position 0
    page.select_option("#att-first", "renormalise")
    cells = page.eval_on_selector_all("#att-big .hm-cell", CELLS)
    for t in range(1, S):
        row = {j: float(p) for tt, j, p, _ in cells if tt == t and p != ""}
        assert sorted(row) == list(range(1, t + 1))
        assert list(row.values()) == pytest.approx((att[1, t, 1:t + 1] / att[1, t, 1:t + 1].sum()).tolist(),
                                                   rel=1e-3, abs=1e-4)
    # the lines view: queries left, keys right, a line per attended key (as thick as its weight)
    page.select_option("#att-first", "show")
    page.select_option("#att-view", "lines")
    page.wait_for_selector("#att-big svg.lines")
    assert page.eval_on_selector_all("#att-big .qlabel", "es => es.map(e => e.textContent)") == labels
    assert page.eval_on_selector_all("#att-big .klabel", "es => es.map(e => e.textContent)") == labels
    lines = page.eval_on_selector_all("#att-big .att-line", "es => es.map(e => [Number(e.dataset.q), "
                                      "Number(e.dataset.k), Number(e.dataset.p), Number(e.getAttribute('stroke-width'))])")
    assert {(t, j) for t, j, _, _ in lines} == {(t, j) for t in range(S) for j in range(t + 1) if att[1, t, j] > 0.02}
    assert all(w == pytest.approx(0.4 + 3 * p, abs=0.01) for _, _, p, w in lines)
    assert any(j == 0 for _, j, _, _ in lines)
    page.select_option("#att-first", "hide")
    lines = page.eval_on_selector_all("#att-big .att-line", "es => es.map(e => Number(e.dataset.k))")
    assert lines and 0 not in lines
    # the sink and the lens, in this trace's numbers
    norms = tr.residual_norms(layer)[:S, 2]
    assert float(page.get_attribute("#sink-line", "data-to-first")) == pytest.approx(att[:, q, 0].mean(), abs=1e-4)
    assert float(page.get_attribute("#sink-line", "data-norm-ratio")) == pytest.approx(
        norms[0] / np.median(norms[1:]), abs=0.01)
    tops = [int(tr.logit_lens(i, top=1, positions=[q])[0][0, 0]) for i in range(tiny.config.n_layers)]
    texts = [lab_module.token_text(tiny.tokenizer, t) for t in tops]
    assert int(page.get_attribute("#lens-line", "data-punctuation")) == sum(map(punctuation_only, texts))
    first_hit = tops.index(ref.token_ids[3]) if ref.token_ids[3] in tops else -1
    assert int(page.get_attribute("#lens-line", "data-first-hit")) == first_hit


@pytest.mark.slow
def test_real_model_chat_in_the_browser(browser, default_model):
    r = Running(build_app(default_model, ServerOptions(model_name="SmolLM2-135M-Instruct"), kv_memory="64MiB"))
    try:
        pg = browser.new_page(viewport={"width": 1200, "height": 900})
        errors = []
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        pg.goto(r.url + "/lab")
        pg.wait_for_selector("body[data-ready=true]", timeout=30_000)
        pg.fill("#prompt", "What is the capital of France?")
        pg.fill("#max-tokens", "24")
        pg.click("#go")
        pg.wait_for_selector("#gen-text[data-done=true]", timeout=60_000)
        ref = tinyllm.generate(default_model, [{"role": "user", "content": "What is the capital of France?"}],
                               max_new_tokens=24)
        assert pg.text_content("#gen-text") == ref.text and "Paris" in ref.text
        pg.locator("#tokens .tok").nth(2).click()
        pg.wait_for_selector("#att-row .att", timeout=120_000)
        assert pg.get_attribute("#in-replay", "data-matches") == "true"
        assert errors == []
    finally:
        r.close()
