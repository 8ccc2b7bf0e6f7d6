"""The inference lab: a local web page (`/lab`) that shows a generation and the engine while they happen.

The page (static/lab.html, lab.css, lab.js: plain files, no build step) talks to the server's own OpenAI API to
generate, and to three read-only JSON endpoints defined here:

    GET  /lab/api/engine       the KV block pool (owner of every block, shared and free ones), the running and
                               waiting queues, and the slot timeline of the last steps (continuous batching)
    POST /lab/api/inspect      one generated token of a finished request, from the inside: attention of the
                               position that chose it and the layer's [S, S] maps up to it, the residual norms
                               (the sink), the logit lens per layer, and the sampling stages
    POST /lab/api/capacity     the serving arithmetic of tinyllm/capacity.py for the calculator form, with a
                               verdict: does the batch fit in memory, and by how much it does not
    GET  /lab/api/presets      model shapes and hardware for that form (this machine's from the cached calibration)
    POST /lab/api/calibrate    measure this machine's roofs now (roofs.py; seconds, the engine pauses) and cache them

Every read of the engine runs on the engine thread between two steps (EngineLoop.call), so it sees a consistent
pool. "Inspect" replays the request with tracing: same prompt ids, sampling parameters and seed, so the same
tokens; the reply says whether the replay really matched the stream. The replay runs on the engine thread too
(the model and its kernels are used by one thread at a time), so other requests pause while it runs: one replay
at a time (429 for a second), stopped between two tokens when its client goes away.

Privacy: the page sends a random token of its own with every request (X-Tinyllm-Client, app.py). The engine view
shows the text of that page's requests only (others appear as ids and block counts), and only that page may
inspect them: a replay shows the whole prompt. The lab is off by default on a non-loopback address (serve.py).
Left out: editing anything (the lab only reads) and requests with n > 1 (inspect follows sample 0).
"""
from __future__ import annotations

import asyncio
import bisect
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from starlette.requests import Request as HTTPRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import capacity, roofs
from ..generate import CacheSpec, stream
from ..trace import Trace
from .app import on_disconnect
from .protocol import APIError, echo

STATIC = Path(__file__).resolve().parent / "static"
TIMELINE_STEPS = 160          # steps of the slot timeline sent to the page
LENS_TOP = 3                  # logit lens: top tokens per layer shown
MATRIX_POSITIONS = 128        # attention heatmaps: the last this many positions ([H, S, S] grows as S squared)
REPLAYS_KEPT = 2              # traced replays kept: q, k, v and the output of every layer, for every position
MAX_REPLAY_POSITIONS = 1024   # (about 185 KB per position on the default model, so ~190 MB at this cap)
SNAPSHOT_EVERY = 0.1          # seconds: however many pages poll, the engine thread draws itself 10 times a second


# --- the engine, as the page draws it ------------------------------------------------------------------------------
def request_name(seq_id) -> str:
    """A pool sequence name -> the request id it belongs to (the scheduler names them ("request", id))."""
    return seq_id[1] if isinstance(seq_id, tuple) and len(seq_id) == 2 and seq_id[0] == "request" else str(seq_id)


def engine_snapshot(engine, steps: int = TIMELINE_STEPS) -> dict:
    """A JSON-ready picture of the engine now (call it on the engine thread): pool, queues, timeline, counters."""
    pool, alloc, sched = engine.pool, engine.pool.allocator, engine.scheduler
    owners = [[] for _ in range(alloc.num_blocks)]             # block -> request ids whose tables list it
    tables = {}
    for seq_id, table in alloc.tables.items():
        rid = request_name(seq_id)
        tables[rid] = list(table)
        for b in table:
            owners[b].append(rid)
    evictable = set(alloc.evictable)
    blocks = []
    for b in range(alloc.num_blocks):
        if alloc.ref[b]:
            state = "shared" if alloc.ref[b] > 1 else "used"
        else:                                                  # cached: free, but holds a reusable prefix
            state = "cached" if b in evictable else "free"
        blocks.append({"state": state, "owners": owners[b], "prefix": alloc.block_hash[b] is not None})

    def card(req) -> dict:
        return {"id": req.request_id, "status": req.status, "slot": req.slot, "prompt_tokens": len(req.prompt_ids),
                "output_tokens": len(req.output_ids), "max_tokens": req.max_tokens, "computed": req.num_computed,
                "cached_tokens": req.metrics.cached_tokens, "preemptions": req.metrics.preemptions,
                "blocks": tables.get(req.request_id, []), "text": req.text[-60:]}

    now = engine.clock()
    recent = list(engine.steps)[-steps:]
    timeline = []
    for s in recent:
        cells = {}
        for slot, rid in s.slots.items():
            req = engine.requests.get(rid)
            times = req.metrics.token_times if req is not None else []
            i = bisect.bisect_left(times, s.start)               # did this step give the request a token?
            cells[slot] = {"id": rid, "token": i < len(times) and times[i] <= s.end}
        timeline.append({"ago": now - s.start, "duration": s.end - s.start, "tokens": s.tokens, "slots": cells})
    return {
        "time": time.time(),
        "pool": {"num_blocks": alloc.num_blocks, "block_size": alloc.block_size, "num_used": alloc.num_used,
                 "num_free": alloc.num_free, "bytes_per_block": pool.bytes_per_token * alloc.block_size,
                 "bytes_per_token": pool.bytes_per_token, "prefix_caching": alloc.prefix_caching,
                 "prefix_hit_tokens": alloc.hit_tokens, "prefix_query_tokens": alloc.query_tokens},
        "blocks": blocks,
        "running": [card(r) for r in sched.running],
        "waiting": [card(r) for r in sched.waiting],
        "scheduler": {"policy": sched.policy, "max_num_seqs": sched.max_num_seqs,
                      "max_num_batched_tokens": sched.max_num_batched_tokens, "preemptions": sched.num_preemptions},
        "timeline": timeline,
        "counters": dict(engine.counters),
    }


# --- look inside a token: a traced replay --------------------------------------------------------------------------
@dataclass
class Replay:
    """A finished request run again with a Trace, and whether it produced the streamed tokens."""
    model: object
    trace: Trace
    prompt_len: int
    streamed: list[int]          # the request's output ids, as the engine streamed them
    replayed: list[int]          # the replay's output ids

    @property
    def first_difference(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.streamed, self.replayed)):
            if a != b:
                return i
        return None if len(self.streamed) == len(self.replayed) else min(len(self.streamed), len(self.replayed))


class Cancelled(Exception):
    """The client of a replay went away."""


def replay(engine, request_id: str, cancel: threading.Event | None = None) -> Replay:
    """Generate again what request `request_id` generated, with tracing (engine thread: it uses the model).
    cancel: checked between two tokens; once set, the replay stops (Cancelled)."""
    req = engine.requests.get(request_id)
    if req is None:
        raise APIError(404, f"no request {request_id!r} in the engine's history (it keeps the last "
                            f"{engine.history}): generate again, then inspect", "request_id")
    if req.status != "finished":
        raise APIError(409, "the request is still running: inspect its tokens once it has finished", "request_id")
    if not req.output_ids:
        raise APIError(400, "the request generated no token to inspect", "request_id")
    if not req.params.greedy and req.params.seed is None:
        raise APIError(400, "a sampled request without a seed cannot be replayed (its draws are not repeatable): "
                            "set a seed and generate again", "request_id")
    positions = len(req.prompt_ids) + len(req.output_ids)
    if positions > MAX_REPLAY_POSITIONS:
        raise APIError(400, f"the request holds {positions} positions; the lab traces at most {MAX_REPLAY_POSITIONS} "
                            f"(a trace keeps every layer's q, k, v for each): inspect a shorter one", "request_id")
    run = stream(engine.model, list(req.prompt_ids), max_new_tokens=len(req.output_ids), params=req.params,
                 cache=CacheSpec(kv_dtype=engine.pool.kv_dtype), ignore_eos=True, trace=Trace(max_positions=positions))
    for _ in run:
        if cancel is not None and cancel.is_set():
            raise Cancelled(request_id)
    out = run.result
    return Replay(engine.model, out.trace, len(req.prompt_ids), list(req.output_ids), list(out.token_ids))


def token_text(tokenizer, token_id: int) -> str:
    """One token's text (a piece of a UTF-8 character shows as the replacement character)."""
    if tokenizer is None:
        return str(token_id)
    return tokenizer.id_to_bytes(int(token_id)).decode("utf-8", errors="replace")


def significant(a: np.ndarray, digits: int = 5) -> list:
    """a rounded to `digits` significant digits, as nested lists: short JSON, and the small weights left beside an
    attention sink keep the precision that renormalising without it needs."""
    a = a.astype(np.float64)
    exponent = np.floor(np.log10(np.abs(a), out=np.zeros_like(a), where=a != 0))
    scale = 10.0 ** (digits - 1 - exponent)
    return (np.round(a * scale) / scale).tolist()


def inspect_token(r: Replay, index: int, layer: int | None) -> dict:
    """Generated token `index` of a replay, from the inside. It was chosen by the pass at the position just before
    it (prompt_len + index - 1): that position's attention over every earlier position, its logit lens, and the
    sampling stages of the token."""
    tr, c, tok = r.trace, r.model.config, r.model.tokenizer
    if not 0 <= index < len(r.replayed):
        raise APIError(400, f"token must be in 0 .. {len(r.replayed) - 1} (the request generated "
                            f"{len(r.replayed)} tokens)", "token")
    layer = c.n_layers - 1 if layer is None else layer
    if not 0 <= layer < c.n_layers:
        raise APIError(400, f"layer must be in 0 .. {c.n_layers - 1}", "layer")
    q = r.prompt_len + index - 1                                  # the position whose output chose the token
    full = tr.attention(layer)                                    # [H, S, S]
    att = full[:, q, :q + 1]                                      # [H, q+1] each head's row over 0..q
    lo = max(0, q + 1 - MATRIX_POSITIONS)                         # the heatmaps' first position
    lens = []
    for i in range(c.n_layers):
        ids, probs = tr.logit_lens(i, top=LENS_TOP, positions=[q])   # [1, top] each
        lens.append({"layer": i, "top": [{"id": int(t), "text": token_text(tok, t), "prob": float(pr)}
                                         for t, pr in zip(ids[0], probs[0])]})
    s = tr.sampling[index]
    diff = r.first_difference
    return {
        "token_index": index, "position": q, "prompt_len": r.prompt_len,
        "tokens": tr.tokens[:q + 1],
        "token": {"id": s.token, "text": token_text(tok, s.token), "prob": s.prob},
        "replay": {"matches": diff is None, "first_difference": diff, "streamed": len(r.streamed)},
        "layer": layer, "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
        "attention": {"heads": att.tolist(), "average": att.mean(axis=0).tolist(),
                      "matrix": {"start": lo, "heads": significant(full[:, lo:q + 1, lo:q + 1])}},
        "residual_norms": tr.residual_norms(layer)[:q + 1, 2].tolist(),     # [q+1] leaving the layer
        "lens": lens,
        "sampling": {"stages": [{"stage": st.stage, "top": [{"id": t, "text": token_text(tok, t), "prob": pr}
                                                           for t, pr in zip(st.ids, st.probs)]}
                                for st in s.stages],
                     "token": s.token, "prob": s.prob},
    }


# --- the arithmetic ------------------------------------------------------------------------------------------------
CAPACITY_FIELDS = {        # name -> (what it is, least and largest allowed value: far beyond any real machine)
    "layers": ("layers", 1, 10_000), "kv_heads": ("KV heads", 1, 10_000), "head_dim": ("head dimension", 1, 100_000),
    "bytes_per_value": ("bytes per KV value", 0.125, 64), "params": ("parameters", 1, 1e15),
    "weight_gb": ("weights (GB)", 0, 1e7), "memory_gib": ("device memory (GiB)", 0, 1e7),
    "usable_fraction": ("usable fraction", 0.01, 1), "bandwidth_gbs": ("bandwidth (GB/s)", 0.001, 1e9),
    "peak_tflops": ("peak compute (TFLOP/s)", 0.000001, 1e9), "context": ("context (tokens)", 1, 100_000_000),
    "batch": ("batch", 1, 1_000_000), "prompt_tokens": ("prompt tokens", 1, 100_000_000),
    "output_tokens": ("output tokens", 1, 1_000_000),     # request_latency builds a list of this many steps
}
INTEGER_FIELDS = {"layers", "kv_heads", "head_dim", "context", "batch", "prompt_tokens", "output_tokens"}
SEED_HARDWARE = {"memory_gib": 80, "usable_fraction": 0.9, "bandwidth_gbs": 2000, "peak_tflops": 200}
DEFAULT_WORKLOAD = {"context": 4096, "batch": 1, "prompt_tokens": 2000, "output_tokens": 500}   # room for the request


def capacity_inputs(body: dict) -> dict:
    """Validate the calculator form: every field a number at or above its least value (one clear 400 otherwise)."""
    values = {}
    for name, (what, least, most) in CAPACITY_FIELDS.items():
        v = body.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not least <= v <= most:
            raise APIError(400, f"{what} must be a number in {least:g} .. {most:g}, got {echo(v)}", name)
        if name in INTEGER_FIELDS and v != int(v):
            raise APIError(400, f"{what} must be a whole number, got {v!r}", name)
        values[name] = int(v) if name in INTEGER_FIELDS else float(v)
    return values


def checked_capacity_figures(v: dict) -> dict:
    """capacity_figures, or a 400 when the arithmetic of these inputs has no finite answer (zero bandwidth left
    for the KV, a product beyond a float): JSON has no NaN or infinity to send."""
    try:
        out = capacity_figures(v)
    except (ArithmeticError, ValueError) as e:
        raise APIError(400, f"these inputs have no answer: {e}") from None
    bad = [k for k, x in out.items() if isinstance(x, float) and not math.isfinite(x)]
    if bad:
        raise APIError(400, f"these inputs have no finite answer for {', '.join(bad)}: check them", bad[0])
    return out


def capacity_figures(v: dict) -> dict:
    """The calculator's results, every one from tinyllm/capacity.py (the same code as scripts/capacity.py)."""
    weight_bytes, bandwidth, peak = v["weight_gb"] * capacity.GB, v["bandwidth_gbs"] * 1e9, v["peak_tflops"] * 1e12
    kv_token = capacity.kv_bytes_per_token(layers=v["layers"], kv_heads=v["kv_heads"], head_dim=v["head_dim"],
                                           bytes_per_value=v["bytes_per_value"])
    hardware = dict(bandwidth=bandwidth, params=v["params"], peak_flops=peak)
    step = capacity.decode_step_time(weight_bytes=weight_bytes, batch=v["batch"], context=v["context"],
                                     kv_bytes_per_token=kv_token, **hardware)
    step_bytes = capacity.decode_step_bytes(weight_bytes=weight_bytes, batch=v["batch"], context=v["context"],
                                            kv_bytes_per_token=kv_token)
    step_flops = capacity.decode_flops(params=v["params"], batch=v["batch"])
    latency = capacity.request_latency(prompt_tokens=v["prompt_tokens"], output_tokens=v["output_tokens"],
                                       weight_bytes=weight_bytes, kv_bytes_per_token=kv_token, batch=v["batch"],
                                       **hardware)
    fits = capacity.max_concurrent_sequences(memory_bytes=v["memory_gib"] * capacity.GiB,
                                             usable_fraction=v["usable_fraction"], weight_bytes=weight_bytes,
                                             context=v["context"], kv_bytes_per_token=kv_token)
    ridge = capacity.ridge_point(peak_flops=peak, bandwidth=bandwidth)
    room = capacity.fit(memory_bytes=v["memory_gib"] * capacity.GiB, usable_fraction=v["usable_fraction"],
                        weight_bytes=weight_bytes, batch=v["batch"], context=v["context"], kv_bytes_per_token=kv_token)
    request = v["prompt_tokens"] + v["output_tokens"]
    warnings = [] if request <= v["context"] else [
        f"a request of {v['prompt_tokens']:,} prompt + {v['output_tokens']:,} output tokens needs {request:,} "
        f"positions, more than the context of {v['context']:,}: raise the context (the memory figures use it)"]
    return {
        "fit": {"fits": room.fits, "verdict": room.verdict(), "needed_bytes": room.needed, "usable_bytes": room.usable,
                "over_bytes": room.over, "max_batch": room.max_batch, "max_context": room.max_context},
        "warnings": warnings,
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_sequence": capacity.kv_bytes_per_sequence(layers=v["layers"], kv_heads=v["kv_heads"],
                                                                head_dim=v["head_dim"],
                                                                bytes_per_value=v["bytes_per_value"],
                                                                context=v["context"]),
        "max_sequences": fits,
        "decode_step_s": step, "decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
        "weights_share_of_step_bytes": weight_bytes / step_bytes if step_bytes else 0.0,
        "tokens_per_s_per_sequence": 1 / step, "tokens_per_s_total": v["batch"] / step,
        "ridge_flops_per_byte": ridge, "decode_flops_per_byte": step_flops / step_bytes if step_bytes else 0.0,
        "bound": "memory bandwidth" if step_bytes / bandwidth >= step_flops / peak else "compute",
        "ttft_s": latency.ttft, "itl_s": latency.itl, "total_s": latency.total,
    }


def machine_hardware() -> dict:
    """This machine for the form, from the cached calibration (roofs.py): its hardware fields, when and how it was
    measured, or why there is none."""
    out = {"hardware": None, "calibration": None, "error": None, "file": str(roofs.calibration_file())}
    try:
        r = roofs.load_calibration()
    except ValueError as e:
        out["error"] = str(e)
        return out
    if r is not None:
        out["hardware"] = {"memory_gib": r.memory / capacity.GiB, "usable_fraction": SEED_HARDWARE["usable_fraction"],
                           "bandwidth_gbs": r.bandwidth / 1e9, "peak_tflops": r.peak_flops / 1e12}
        out["calibration"] = {"measured": r.measured, "source": r.source, "threads": r.threads}
    return out


def presets(model) -> dict:
    """Model shapes for the form: the seed's two illustrative ones and the model this server runs; the seed's
    hypothetical accelerator, and this machine as calibrated."""
    def shape(s: capacity.ModelShape) -> dict:
        return {"name": s.name, "layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                "bytes_per_value": s.kv_bytes_per_value, "params": s.params, "weight_gb": s.weight_bytes / capacity.GB}
    shapes = {key: shape(s) for key, s in capacity.SHAPES.items()}
    shapes["served"] = shape(capacity.ModelShape.from_model(model))
    return {"models": shapes, "hardware": SEED_HARDWARE, "machine": machine_hardware(),
            "defaults": DEFAULT_WORKLOAD}


# --- routes --------------------------------------------------------------------------------------------------------
class Lab:
    """The lab's routes over a Server (its EngineLoop, model, and which page made which request). The API key and
    the Host / Origin checks are guard.py's, before any route."""

    def __init__(self, server):
        self.server = server
        self.replays: OrderedDict[str, Replay] = OrderedDict()    # request id -> replay, most recent last
        self.replaying = False                                    # one replay at a time (they pause the engine)
        self.calibrating = False                                  # one calibration at a time (it pauses it too)
        self.snapshot: tuple[float, asyncio.Future] | None = None   # the last engine snapshot, shared by pollers

    def routes(self) -> list:
        return [Route("/lab", self.page), Route("/lab/", self.page),
                Route("/lab/api/engine", self.engine), Route("/lab/api/presets", self.presets),
                Route("/lab/api/inspect", self.inspect, methods=["POST"]),
                Route("/lab/api/capacity", self.capacity, methods=["POST"]),
                Route("/lab/api/calibrate", self.calibrate, methods=["POST"]),
                Mount("/lab/static", StaticFiles(directory=STATIC), name="lab-static")]

    async def on_engine_thread(self, fn, timeout: float = 120.0):
        """fn(engine), run on the engine thread between two steps."""
        loop = self.server.loop
        if loop.error is not None:
            raise APIError(500, f"the engine could not start: {loop.error!r}")
        if not loop.ready.is_set():
            raise APIError(503, "the engine is still warming up (compiling its kernels): try again in a moment")
        future = asyncio.get_running_loop().create_future()
        loop.call(fn, asyncio.get_running_loop(), future)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise APIError(504, f"the engine thread did not answer within {timeout:g} s") from None

    async def page(self, request: HTTPRequest) -> Response:
        return FileResponse(STATIC / "lab.html", headers={"Cache-Control": "no-cache"})

    async def engine(self, request: HTTPRequest) -> Response:
        """The engine snapshot, each request's text shown only to the page that made it."""
        now = time.monotonic()
        if self.snapshot is None or now - self.snapshot[0] > SNAPSHOT_EVERY:
            self.snapshot = (now, asyncio.ensure_future(self.on_engine_thread(engine_snapshot)))
        snap = await asyncio.shield(self.snapshot[1])          # a poller that leaves does not cancel the others'
        token, owners = self.server.client_token(request), self.server.owners

        def shown(card: dict) -> dict:
            mine = token is not None and owners.get(card["id"].split("/")[0]) == token    # samples: "<id>/<i>"
            return card if mine else {**card, "text": None}
        return JSONResponse({**snap, "running": [shown(c) for c in snap["running"]],
                             "waiting": [shown(c) for c in snap["waiting"]]})

    async def presets(self, request: HTTPRequest) -> Response:
        return JSONResponse(presets(self.server.model))

    async def capacity(self, request: HTTPRequest) -> Response:
        values = capacity_inputs(await self.server._json(request))
        return JSONResponse(await asyncio.to_thread(checked_capacity_figures, values))   # off the event loop

    async def calibrate(self, request: HTTPRequest) -> Response:
        """Measure this machine's roofs on the engine thread (a few seconds: steps pause, nothing else runs kernels
        meanwhile), cache them, and answer with the form's hardware fields."""
        if self.calibrating:
            raise APIError(429, "a calibration is already running: wait for it")
        self.calibrating = True
        try:
            measured = await self.on_engine_thread(lambda engine: roofs.measure_roofs(source="the lab"))
        finally:
            self.calibrating = False
        await asyncio.to_thread(roofs.save_calibration, measured)
        return JSONResponse(machine_hardware())

    async def inspect(self, request: HTTPRequest) -> Response:
        if self.server.draining:
            raise APIError(503, "the server is shutting down")
        body = await self.server._json(request)
        rid, index, layer = body.get("request_id"), body.get("token"), body.get("layer")
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "request_id must be the id of a finished request (the stream's id without its "
                                "'cmpl-' or 'chatcmpl-' prefix)", "request_id")
        for name, value in (("token", index), ("layer", layer)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise APIError(400, f"{name} must be an integer", name)
        if index is None:
            raise APIError(400, "token (the index of a generated token, from 0) is required", "token")
        token = self.server.client_token(request)
        if token is None or self.server.owners.get(rid) != token:        # 404, not 403: no hint that it exists
            raise APIError(404, f"no request {echo(rid)} made by this page: the lab inspects only the requests of "
                                f"the page that made them (its X-Tinyllm-Client token)", "request_id")
        r = self.replays.get(rid)
        if r is None:
            r = await self._replay(request, rid)
        self.replays.move_to_end(rid)
        return JSONResponse(await asyncio.to_thread(inspect_token, r, index, layer))

    async def _replay(self, request: HTTPRequest, rid: str) -> Replay:
        """Replay `rid` on the engine thread: one at a time, stopped if the client leaves or the wait times out."""
        if self.replaying:
            raise APIError(429, "another replay is running (each pauses the engine): try again when it is done")
        self.replaying, cancel = True, threading.Event()
        try:
            async with on_disconnect(request, cancel.set):
                r = await self.on_engine_thread(lambda engine: replay(engine, rid, cancel))
        except Cancelled:
            raise APIError(400, "the replay was stopped: its client went away") from None
        finally:
            cancel.set()                          # a timed-out wait stops the replay too
            self.replaying = False
        self.replays[rid] = r
        while len(self.replays) > REPLAYS_KEPT:
            self.replays.popitem(last=False)
        return r
