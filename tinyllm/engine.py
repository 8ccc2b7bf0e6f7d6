"""Serving many requests at once: a scheduler, batched steps over the paged KV cache, and serving metrics.

    engine = Engine(model, kv_memory="256MiB", max_num_seqs=16)
    engine.add_request("a", prompt_ids, SamplingParams(), max_tokens=64)
    for event in engine.run():            # RequestOutput: one new token (and its text) of one request
        ...
    print(engine.metrics().summary())

Each `step()` the Scheduler picks which requests run and how many of their tokens (a decode: 1; a prompt: a
chunk), `model.forward_batch` runs them all in one pass (one read of every weight for the whole batch), and
every request whose tokens are all computed samples one new token (or, with `n` > 1, n tokens: the samples
fork the prompt's blocks and split them by copy-on-write). Two policies, for comparison:
"continuous" refills free slots between steps (Orca, Yu et al. OSDI 2022: iteration-level scheduling; vLLM),
"static" admits a batch and runs it until its longest member finishes. Left out: swapping KV to host memory
(preemption is by recompute), priorities and fairness, beam search, speculative decoding. The scheduler and
the request types are in scheduler.py; a request's checks and its text (end tokens, stop strings) are
requests.py's, shared with generate.py. The HTTP server (server/) drives one Engine from one thread. History
is bounded (`history` finished requests and steps are kept for `metrics()`); `counters` are cumulative over the
engine's life.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .paged import PagedKVCache, SequenceCache
from .requests import (StopStrings, TextOutput, as_sampling_params, as_token_ids, check_prompt_ids, end_token_ids,
                       positive_int)
from .sampling import SamplingParams, log_softmax, sample
from .scheduler import POLICIES, Request, RequestMetrics, RequestOutput, Scheduler, pool_name  # noqa: F401


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

    model: a Transformer. KV pool: `kv_memory` ("512MiB") or `num_blocks`, of `block_size` positions each, storing
    K/V as `kv_dtype` ("float32", "float16", "int8": the same budget holds 2x or ~3.8x the positions).
    Scheduling: `policy` ("continuous" or "static"), `max_num_seqs` running at once, `max_num_batched_tokens` per
    step, `chunked_prefill`, `watermark` (share of the pool admission leaves free), `long_prefill_tokens` (most
    prompt tokens of one request per step). clock: a function returning seconds (tests pass a fake one).
    history: how many finished requests (in `requests`) and step records (in `steps`) are kept for `metrics()`;
    a server runs for days, so older ones are dropped. `counters` keep cumulative totals regardless.
    """

    def __init__(self, model, kv_memory: str | int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", chunked_prefill: bool = True, prefix_caching: bool = True,
                 watermark: float = 0.01, long_prefill_tokens: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, history: int = 10_000, kv_dtype: str = "float32"):
        if kv_memory is None and num_blocks is None:
            kv_memory = "256MiB"
        self.model, self.clock = model, clock
        self.pool = PagedKVCache(model.config, block_size, num_blocks, kv_memory, prefix_caching, kv_dtype)
        model.warm_up_pool(self.pool)               # the batched kernels compiled now, not in the first step
        self.scheduler = Scheduler(self.pool, policy, max_num_seqs, max_num_batched_tokens, chunked_prefill,
                                   watermark, long_prefill_tokens)
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"invalid history={history!r}: must be an integer >= 1")
        self.requests: dict[str, Request] = {}     # every unfinished request, and the last `history` finished
        self._finished: deque[str] = deque()       # ids of finished requests still in `requests`, oldest first
        self.history = history
        self.steps: deque[StepRecord] = deque(maxlen=history)
        # Cumulative totals (never trimmed): prompt_tokens and generation_tokens of requests that got their first
        # token / each token, finished_<reason> per finish reason. Preemptions and prefix-cache hits are counted
        # by the scheduler and the allocator.
        self.counters: Counter = Counter()
        self._ends = set()
        if model.tokenizer is not None:
            self._ends = end_token_ids(model.tokenizer)

    # ---- requests in
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    max_tokens: int = 64, stop_token_ids: Sequence[int] | None = None, stop: Sequence[str] = (),
                    arrival_time: float | None = None, n: int = 1, logprobs: int | None = None) -> Request:
        """Queue a request. Rejected here, before any work, if it could never fit the KV pool or the context.

        stop_token_ids: ids that end it (default: the tokenizer's end-of-sequence ids; () never stops on a token,
        vLLM's ignore_eos); stop: stop strings (need a tokenizer). The stop token itself is not part of the output.
        n: independent samples of the same prompt. The prompt is computed once; when it is done the request forks
        n - 1 children (ids "<id>/1" ...) that share its blocks; their events carry request_id <id> and index i.
        With a seed s, sample i draws from default_rng((s, i)) (sample 0 from default_rng(s), as when n = 1).
        logprobs: also report each sampled token's log-probability and the `logprobs` most likely alternatives.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        V = self.model.config.vocab_size
        prompt_ids = check_prompt_ids(as_token_ids(prompt_ids, "prompt_ids"), V)
        positive_int(max_tokens, "max_tokens")
        params = as_sampling_params(params)
        output = TextOutput(self.model.tokenizer, StopStrings(stop))
        if not isinstance(n, int) or not 1 <= n <= self.scheduler.max_num_seqs:
            raise ValueError(f"invalid n={n!r}: must be an integer in 1 .. max_num_seqs "
                             f"({self.scheduler.max_num_seqs}), since the samples run side by side")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= V):
            raise ValueError(f"invalid logprobs={logprobs!r}: must be an integer in 0 .. {V} (or None)")
        stop_token_ids = None if stop_token_ids is None else as_token_ids(stop_token_ids, "stop_token_ids")
        req = Request(request_id, prompt_ids, params, max_tokens,
                      frozenset(self._ends if stop_token_ids is None else stop_token_ids), output,
                      RequestMetrics(self.clock() if arrival_time is None else arrival_time),
                      logprobs=logprobs, group=request_id, forks=n - 1)
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
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks; with n > 1, every sample forked from it too."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            raise ValueError(f"no request with id {request_id!r} to abort")
        for r in [req, *req.children]:
            if r.status != "finished":
                r.finish_reason = "abort"
                self._finish(r, self.clock())

    def _finish(self, req: Request, now: float) -> None:
        req.metrics.finished = now
        req.forks = 0                                             # an aborted request forks nobody later
        self.scheduler.finish(req)
        self.counters[f"finished_{req.finish_reason}"] += 1
        self._finished.append(req.request_id)
        while len(self._finished) > self.history:                 # bounded history: forget the oldest
            self.requests.pop(self._finished.popleft(), None)

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
            now = self.clock()
            if req.forks:                                         # parallel sampling: fork before sampling
                group = [req] + [self._fork(req, i) for i in range(1, req.forks + 1)]
                req.forks = 0
            else:
                group = [req]
            for r in group:
                token = sample(row[0], r.params, r.rng, r.all_ids)
                events.append(self._accept(r, token, now, row[0]))
        self._record(t0, batch, slots)
        return events

    def run(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding events as they happen."""
        while self.has_unfinished():
            yield from self.step()

    def _fork(self, parent: Request, index: int) -> Request:
        """Sample `index` of a request whose prompt was just computed: it shares every block of the parent
        (ref counts, no copy); the first write into a shared block copies it (copy-on-write, paged.py)."""
        child_id = f"{parent.request_id}/{index}"
        seed = parent.params.seed
        child = Request(child_id, parent.prompt_ids, parent.params, parent.max_tokens, parent.stop_token_ids,
                        TextOutput(self.model.tokenizer, parent.output.stops),
                        RequestMetrics(parent.metrics.arrival, parent.metrics.first_scheduled,
                                       cached_tokens=parent.metrics.cached_tokens),
                        num_computed=parent.num_computed, logprobs=parent.logprobs, group=parent.group, index=index)
        child.rng = np.random.default_rng(None if seed is None else (seed, index))
        self.pool.allocator.fork(pool_name(parent.request_id), pool_name(child_id))
        child.cache = SequenceCache(self.pool, pool_name(child_id))
        child.cache.length, child.cache.slots = parent.cache.length, parent.cache.slots.copy()
        self.scheduler.add_running(child)
        parent.children.append(child)
        self.requests[child_id] = child
        return child

    def _accept(self, req: Request, token: int, now: float, logits: np.ndarray | None = None) -> RequestOutput:
        """Record a sampled token: stop conditions, text, timing. -> its event (text held back while it could
        still be the start of a stop string: requests.TextOutput). logits ([V]): for the logprobs, if asked."""
        m = req.metrics
        if m.first_token is None:
            m.first_token = now
            if req.index == 0:                                    # the samples of a request share its prompt
                self.counters["prompt_tokens"] += len(req.prompt_ids)
        m.token_times.append(now)
        self.counters["generation_tokens"] += 1
        logprob = top = None
        if req.logprobs is not None and logits is not None:
            lp = log_softmax(logits)                              # [V]
            logprob = float(lp[token])
            k = min(req.logprobs, len(lp) - 1)
            best = np.argpartition(-lp, k)[:req.logprobs]         # [k] the k most likely, in no order
            best = best[np.argsort(-lp[best], kind="stable")]     # [k] most likely first
            top = [(int(i), float(lp[i])) for i in best]
        reason = None
        if token in req.stop_token_ids:
            reason = "eos"
        else:
            req.output_ids.append(token)
            if req.output.add(token):                             # the text is cut before the stop string
                reason = "stop_string"
            elif len(req.output_ids) >= req.max_tokens:
                reason = "length"
        piece = req.output.close() if reason else req.output.take()
        if reason is not None:
            req.finish_reason = reason
            self._finish(req, now)
        return RequestOutput(req.group, None if reason == "eos" else token, piece, reason is not None, reason,
                             req.index, logprob, top)

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
