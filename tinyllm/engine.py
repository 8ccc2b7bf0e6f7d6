"""Serving many requests at once: a scheduler, batched steps over the paged KV cache, and serving metrics.

    engine = Engine(model, kv_memory="256MiB", max_num_seqs=16)
    engine.add_request("a", prompt_ids, SamplingParams(), max_tokens=64)
    for event in engine.run():            # RequestOutput: one new token (and its text) of one request
        ...
    print(engine.metrics().summary())

Each `step()` the Scheduler picks which requests run and how many of their tokens (a decode: 1; a prompt: a
chunk), `model.forward_batch` runs them all in one pass (one read of every weight for the whole batch), and
every request whose tokens are all computed samples one new token. Two policies, for comparison:
"continuous" refills free slots between steps (Orca, Yu et al. OSDI 2022: iteration-level scheduling; vLLM),
"static" admits a batch and runs it until its longest member finishes. Left out: swapping KV to host memory
(preemption is by recompute), priorities and fairness, beam search, speculative decoding, an HTTP server.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .generate import _held_back, as_token_ids, end_token_ids
from .paged import OutOfBlocks, PagedKVCache, SequenceCache
from .sampling import SamplingParams, sample

POLICIES = ("continuous", "static")


# --- requests -----------------------------------------------------------------------------------------------------
@dataclass
class RequestMetrics:
    """Timestamps of one request (engine clock, seconds) and what happened to it."""
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)    # when each output token was sampled
    cached_tokens: int = 0           # prompt tokens served by the prefix cache (first admission)
    preemptions: int = 0

    @property
    def queue_time(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float:
        """Time to first token: arrival -> first output token (queueing and prefill included)."""
        return self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        return list(np.diff(self.token_times))

    @property
    def tpot(self) -> float:
        """Time per output token after the first: (finish - first token) / (n - 1)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.first_token) / (n - 1) if n > 1 else 0.0

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset
    stop: tuple[str, ...]
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    shown: int = 0                   # characters of text already sent in events
    status: str = "waiting"          # waiting -> running (-> waiting if preempted) -> finished
    finish_reason: str | None = None # "eos", "stop_string", "length", "abort"
    num_computed: int = 0            # leading tokens of all_ids whose K/V are in the cache
    cache: SequenceCache | None = None
    slot: int | None = None          # batch slot while running (for timelines)
    rng: np.random.Generator | None = None
    decoder: object = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output: what the cache must hold (a preempted request recomputes all of it)."""
        return self.prompt_ids + self.output_ids

    @property
    def max_positions(self) -> int:
        """KV positions this request can ever need (its last sampled token is never fed back)."""
        return len(self.prompt_ids) + self.max_tokens - 1


@dataclass
class RequestOutput:
    """One streaming event: a new token of a request (token_id None when it ended without one, e.g. abort)."""
    request_id: str
    token_id: int | None
    text: str                        # the new text piece (may be "" while a UTF-8 character is incomplete)
    finished: bool
    finish_reason: str | None


# --- scheduler ----------------------------------------------------------------------------------------------------
class Scheduler:
    """Decides, each step, which requests run and how many tokens of each. Owns the waiting and running queues.

    Order of a step: running requests first (oldest first), each one decode token or its next prompt chunk;
    then, if the policy allows, waiting requests are admitted while there is a free slot (max_num_seqs), token
    budget (max_num_batched_tokens) and blocks for their whole prompt. When a running request needs a block
    and none is left, the newest running request is preempted (vLLM's recompute preemption): its blocks are
    freed and it goes back to the front of the queue, to be prefilled again over prompt + output so far.
    """

    def __init__(self, pool: PagedKVCache, policy: str = "continuous", max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, chunked_prefill: bool = True, watermark: float = 0.01,
                 long_prefill_tokens: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 <= watermark < 1:
            raise ValueError(f"invalid watermark={watermark!r}: a fraction of the pool in [0, 1)")
        if long_prefill_tokens is not None and long_prefill_tokens < 1:
            raise ValueError(f"invalid long_prefill_tokens={long_prefill_tokens!r}: must be >= 1 (or None)")
        self.pool, self.policy = pool, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        # Admission keeps this many blocks free for the running requests to grow into (vLLM's watermark, 1% by
        # default): admitting a request into the very last blocks would only get someone preempted a few
        # decode steps later, its prefill work thrown away.
        self.watermark_blocks = int(watermark * pool.num_blocks)
        # At most this many prompt tokens of one request per step (vLLM's long_prefill_token_threshold): a long
        # prompt then enters over several steps, and the decodes that share those steps are slowed by a
        # bounded amount (the ITL tail). None: up to the step's whole token budget.
        self.long_prefill_tokens = long_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def schedule(self, now: float) -> list[tuple[Request, int]]:
        """-> [(request, number of its next tokens to run)] for this step; reserves their KV slots."""
        batch, budget, preemptions = [], self.max_num_batched_tokens, self.num_preemptions
        admit = self.policy == "continuous" or not self.running   # static: a new batch only when the old is done
        for req in list(self.running):
            if req.status != "running":                           # preempted earlier in this loop
                continue
            n = self._chunk(req, budget, batch_empty=not batch)
            if n == 0:
                continue
            if self._reserve(req, n):
                batch.append((req, n))
                budget -= n
        admit = admit and self.num_preemptions == preemptions     # memory just ran out: admit nobody this step
        while admit and self.waiting and len(self.running) < self.max_num_seqs:
            if budget == 0 and self.policy == "continuous":
                break                                             # admit only what can start now
            req = self.waiting[0]
            if not self._admit(req, now):
                break                                             # no blocks: wait for running requests to end
            n = self._chunk(req, budget, batch_empty=not batch)  # static: may be 0, the prompt starts next step
            if not self._reserve(req, n, preempt=False):
                self._evict(req)                                  # give the blocks back; try again next step
                break
            self.waiting.popleft()
            self.running.append(req)
            if n:
                batch.append((req, n))
                budget -= n
        return batch

    def _chunk(self, req: Request, budget: int, batch_empty: bool) -> int:
        """Tokens of `req` to run now: 1 for a decode, the rest of the prompt (or a chunk of it) for a prefill."""
        todo = len(req.prompt_ids) + len(req.output_ids) - req.num_computed
        if self.chunked_prefill:                                  # chunked prefill (Sarathi; vLLM): split long prompts
            return min(todo, budget, self.long_prefill_tokens or todo)
        return todo if todo <= budget or batch_empty else 0

    def _admit(self, req: Request, now: float) -> bool:
        """Give `req` blocks for everything it has (reusing cached prefix blocks). False if the pool is too full,
        or would be left with fewer than the watermark's free blocks while others are running."""
        allocator = self.pool.allocator
        if self.running and allocator.num_free - allocator.blocks_taken(req.all_ids) < self.watermark_blocks:
            return False
        try:
            # a namespaced name: a request id can never collide with the pool's own "seq{n}" names
            req.cache = self.pool.new_sequence(req.all_ids, seq_id=("request", req.request_id))
        except OutOfBlocks:
            return False
        req.num_computed = req.cache.length                       # tokens served by the prefix cache
        if req.metrics.first_scheduled is None:
            req.metrics.first_scheduled = now
            req.metrics.cached_tokens = req.num_computed
        req.status = "running"
        used = {r.slot for r in self.running}
        req.slot = next(s for s in range(len(used) + 1) if s not in used)
        return True

    def _reserve(self, req: Request, n: int, preempt: bool = True) -> bool:
        """Make room for n more tokens of a running request, preempting the newest others if needed."""
        while True:
            try:
                req.cache.check_room(n)
                return True
            except OutOfBlocks:
                if not preempt:
                    return False
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    return False

    def preempt(self, req: Request) -> None:
        """Recompute preemption: drop the request's KV (its cached full blocks stay in the prefix cache) and
        queue it first; its output so far is kept, and prefilled again with the prompt when it resumes."""
        self._evict(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.metrics.preemptions += 1
        self.num_preemptions += 1

    def _evict(self, req: Request) -> None:
        req.cache.free()
        req.cache, req.num_computed, req.status, req.slot = None, 0, "waiting", None

    def finish(self, req: Request) -> None:
        if req.cache is not None:
            req.cache.free()
            req.cache = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.slot = "finished", None


# --- engine -------------------------------------------------------------------------------------------------------
@dataclass
class StepRecord:
    """What one step did (for timelines and utilisation figures)."""
    start: float
    end: float
    slots: dict                      # slot -> request id of every request that ran
    tokens: int                      # tokens in the forward pass
    blocks_used: int
    paged_waste: float               # empty slots in allocated blocks / allocated slots
    contiguous_waste: float          # what a max-length reservation per running request would leave empty
    running: int = 0                 # requests holding KV after the step
    stored_tokens: int = 0           # positions they hold


class Engine:
    """Requests in, token events out. See the module docstring for an example.

    model: a Transformer. KV pool: `kv_memory` ("512MiB") or `num_blocks`, of `block_size` positions each.
    Scheduling: `policy` ("continuous" or "static"), `max_num_seqs` running at once, `max_num_batched_tokens` per
    step, `chunked_prefill`, `watermark` (share of the pool admission leaves free), `long_prefill_tokens` (most
    prompt tokens of one request per step). clock: a function returning seconds (tests pass a fake one).
    """

    def __init__(self, model, kv_memory: str | int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", chunked_prefill: bool = True, prefix_caching: bool = True,
                 watermark: float = 0.01, long_prefill_tokens: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if kv_memory is None and num_blocks is None:
            kv_memory = "256MiB"
        self.model, self.clock = model, clock
        self.pool = PagedKVCache(model.config, block_size, num_blocks, kv_memory, prefix_caching)
        self.scheduler = Scheduler(self.pool, policy, max_num_seqs, max_num_batched_tokens, chunked_prefill,
                                   watermark, long_prefill_tokens)
        self.requests: dict[str, Request] = {}
        self.steps: list[StepRecord] = []
        self._ends = set()
        if model.tokenizer is not None:
            self._ends = end_token_ids(model.tokenizer)

    # ---- requests in
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    max_tokens: int = 64, stop_token_ids: Sequence[int] | None = None, stop: Sequence[str] = (),
                    arrival_time: float | None = None) -> Request:
        """Queue a request. Rejected here, before any work, if it could never fit the KV pool or the context.

        stop_token_ids: ids that end it (default: the tokenizer's end-of-sequence ids); stop: stop strings
        (need a tokenizer). The stop token itself is not part of the output.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = as_token_ids(prompt_ids, "prompt_ids")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        V = self.model.config.vocab_size
        if any(not 0 <= i < V for i in prompt_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary (0 .. {V - 1})")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"invalid max_tokens={max_tokens!r}: must be an integer >= 1")
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if stop and self.model.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        stop_token_ids = None if stop_token_ids is None else as_token_ids(stop_token_ids, "stop_token_ids")
        req = Request(request_id, prompt_ids, params or SamplingParams(), max_tokens,
                      frozenset(self._ends if stop_token_ids is None else stop_token_ids), tuple(stop),
                      RequestMetrics(self.clock() if arrival_time is None else arrival_time))
        capacity = self.pool.num_blocks * self.pool.block_size
        if req.max_positions > capacity:
            raise ValueError(f"request {request_id!r} needs up to {req.max_positions} KV positions "
                             f"({len(prompt_ids)} prompt + {max_tokens} new - 1) but the whole pool holds {capacity} "
                             f"({self.pool.num_blocks} blocks of {self.pool.block_size}): it can never run; "
                             f"give more KV memory or ask for fewer tokens")
        if req.max_positions > self.model.config.context_length:
            raise ValueError(f"request {request_id!r} needs up to {req.max_positions} positions, more than the "
                             f"model's context {self.model.config.context_length}")
        req.rng = req.params.make_rng()
        if self.model.tokenizer is not None:
            req.decoder = self.model.tokenizer.stream_decoder()
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request (waiting or running) and free its blocks; a finished one is left as it is."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            raise ValueError(f"no request with id {request_id!r} to abort")
        if req.status != "finished":
            self.scheduler.finish(req)
            req.finish_reason = "abort"
            req.metrics.finished = self.clock()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward pass, sample. -> the new-token events of this step."""
        t0 = self.clock()
        batch = self.scheduler.schedule(t0)
        if not batch:
            return []
        seqs = [req.all_ids[req.num_computed:req.num_computed + n] for req, n in batch]   # each [n] token ids
        logits = self.model.forward_batch(seqs, [req.cache for req, _ in batch], last_only=True)   # B x [1, V]
        slots = {req.slot: req.request_id for req, _ in batch}   # before finished requests leave their slots
        events = []
        for (req, n), row in zip(batch, logits):
            req.num_computed += n
            req.cache.register(req.all_ids)                       # full blocks join the prefix cache
            if req.num_computed < len(req.prompt_ids) + len(req.output_ids):
                continue                                          # a prefill chunk: no token yet
            token = sample(row[0], req.params, req.rng, req.all_ids)
            events.append(self._accept(req, token, self.clock()))
        self._record(t0, batch, slots)
        return events

    def run(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding events as they happen."""
        while self.has_unfinished():
            yield from self.step()

    def _accept(self, req: Request, token: int, now: float) -> RequestOutput:
        """Record a sampled token: stop conditions, text, timing. -> its event (text held back while it could
        still be the start of a stop string, as in generate.py)."""
        m = req.metrics
        if m.first_token is None:
            m.first_token = now
        m.token_times.append(now)
        reason = None
        if token in req.stop_token_ids:
            reason = "eos"
        else:
            req.output_ids.append(token)
            if req.decoder is not None:
                req.text += req.decoder.feed(token)
                hit = min((i for i in (req.text.find(s) for s in req.stop) if i >= 0), default=-1)
                if hit >= 0:                                      # cut before the stop string
                    req.text, reason = req.text[:hit], "stop_string"
            if reason is None and len(req.output_ids) >= req.max_tokens:
                reason = "length"
        if reason in ("eos", "length") and req.decoder is not None:
            req.text += req.decoder.flush()
        safe = len(req.text) if reason else len(req.text) - _held_back(req.text, list(req.stop))
        piece, req.shown = req.text[req.shown:safe], max(req.shown, safe)
        if reason is not None:
            req.finish_reason, m.finished = reason, now
            self.scheduler.finish(req)
        return RequestOutput(req.request_id, None if reason == "eos" else token, piece, reason is not None, reason)

    def _record(self, t0: float, batch, slots: dict) -> None:
        running = self.scheduler.running
        usage = self.pool.usage([r.cache for r in running])
        reserved = sum(r.max_positions for r in running)          # a contiguous cache per request, sized for its max
        stored = sum(r.num_computed for r in running)
        self.steps.append(StepRecord(t0, self.clock(), slots, sum(n for _, n in batch), usage["blocks_used"],
                                     usage["waste"], 1 - stored / reserved if reserved else 0.0, len(running), stored))

    # ---- metrics
    def metrics(self) -> "EngineMetrics":
        return EngineMetrics.from_engine(self)


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


@dataclass
class EngineMetrics:
    """Aggregates over finished requests and recorded steps (seconds; rates per second)."""
    requests: int
    generated_tokens: int
    duration: float                  # first arrival -> last finish
    throughput: float                # generated tokens / duration, all requests together
    queue_time_mean: float
    ttft_mean: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    itl_mean: float
    itl_p50: float
    itl_p95: float
    itl_p99: float
    tpot_mean: float
    e2e_mean: float
    e2e_max: float
    kv_utilisation_mean: float       # blocks in use / pool, averaged over steps
    kv_utilisation_peak: float
    paged_waste_mean: float          # empty slots in allocated blocks, averaged over steps
    contiguous_waste_mean: float     # the same for a per-request max-length reservation
    prefix_hit_rate: float           # tokens served from the prefix cache / tokens looked up, over every
                                     # admission (a request resumed after preemption is looked up again)
    preemptions: int
    kv_bytes_per_token: int

    @staticmethod
    def from_engine(engine: Engine) -> "EngineMetrics":
        done = [r for r in engine.requests.values() if r.status == "finished" and r.metrics.first_token is not None]
        ms = [r.metrics for r in done]
        itl = [x for m in ms for x in m.itl]
        ttft = [m.ttft for m in ms]
        gen = sum(len(m.token_times) for m in ms)
        duration = max((m.finished for m in ms), default=0.0) - min((m.arrival for m in ms), default=0.0)
        steps, alloc = engine.steps, engine.pool.allocator
        util = [s.blocks_used / engine.pool.num_blocks for s in steps]
        return EngineMetrics(
            requests=len(done), generated_tokens=gen, duration=duration,
            throughput=gen / duration if duration > 0 else 0.0,
            queue_time_mean=float(np.mean([m.queue_time for m in ms])) if ms else 0.0,
            ttft_mean=float(np.mean(ttft)) if ttft else 0.0, ttft_p50=_pct(ttft, 50), ttft_p95=_pct(ttft, 95),
            ttft_p99=_pct(ttft, 99), itl_mean=float(np.mean(itl)) if itl else 0.0, itl_p50=_pct(itl, 50),
            itl_p95=_pct(itl, 95), itl_p99=_pct(itl, 99),
            tpot_mean=float(np.mean([m.tpot for m in ms])) if ms else 0.0,
            e2e_mean=float(np.mean([m.e2e for m in ms])) if ms else 0.0,
            e2e_max=max((m.e2e for m in ms), default=0.0),
            kv_utilisation_mean=float(np.mean(util)) if util else 0.0, kv_utilisation_peak=max(util, default=0.0),
            paged_waste_mean=float(np.mean([s.paged_waste for s in steps])) if steps else 0.0,
            contiguous_waste_mean=float(np.mean([s.contiguous_waste for s in steps])) if steps else 0.0,
            prefix_hit_rate=alloc.hit_tokens / alloc.query_tokens if alloc.query_tokens else 0.0,
            preemptions=engine.scheduler.num_preemptions, kv_bytes_per_token=engine.pool.bytes_per_token)

    def summary(self) -> str:
        ms = 1e3
        return (f"{self.requests} requests, {self.generated_tokens} tokens in {self.duration:.2f} s = "
                f"{self.throughput:.1f} tok/s | queue {self.queue_time_mean * ms:.0f} ms | TTFT mean "
                f"{self.ttft_mean * ms:.0f} p50 {self.ttft_p50 * ms:.0f} p95 {self.ttft_p95 * ms:.0f} p99 "
                f"{self.ttft_p99 * ms:.0f} ms | ITL mean {self.itl_mean * ms:.1f} p50 {self.itl_p50 * ms:.1f} p95 "
                f"{self.itl_p95 * ms:.1f} p99 {self.itl_p99 * ms:.1f} ms | TPOT {self.tpot_mean * ms:.1f} ms | "
                f"e2e mean "
                f"{self.e2e_mean:.2f} s | KV util mean {self.kv_utilisation_mean:.0%} peak "
                f"{self.kv_utilisation_peak:.0%} | waste paged {self.paged_waste_mean:.1%} vs contiguous "
                f"{self.contiguous_waste_mean:.1%} | prefix hits {self.prefix_hit_rate:.0%} | "
                f"preemptions {self.preemptions} | {self.kv_bytes_per_token:,} KV B/token")
