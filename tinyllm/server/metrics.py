"""Prometheus metrics of the server, named as vLLM names them (under `tinyllm:`)."""
from __future__ import annotations


import numpy as np
import prometheus_client as prom

from ..engine import Engine
from .protocol import FINISH_REASONS


# --- Prometheus metrics ---------------------------------------------------------------------------------------------
class ServerMetrics:
    """The engine's state as Prometheus metrics, named as vLLM names them (prefix tinyllm: for vllm:)."""

    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return prom.Histogram(f"tinyllm:{name}", doc, label, registry=r, buckets=buckets).labels(model_name)

        def gauge(name, doc):
            return prom.Gauge(f"tinyllm:{name}", doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return prom.Counter(f"tinyllm:{name}", doc, label, registry=r).labels(model_name)

        latency = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80]
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).", latency)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", latency)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", latency[6:] + [160, 320])
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", latency)
        self.running = gauge("num_requests_running", "Requests holding KV and running steps.")
        self.waiting = gauge("num_requests_waiting", "Requests queued (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache blocks in use, fraction of the pool (0..1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV dropped, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = prom.Counter("tinyllm:request_success", "Finished requests by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self._seen: dict[str, float] = {}           # cumulative values already added to the counters

    def _advance(self, counter, key: str, total: float) -> None:
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total

    def update(self, engine: Engine) -> None:
        """After a step (engine thread): gauges to the current state, counters up to the engine's totals."""
        sched, alloc = engine.scheduler, engine.pool.allocator
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(alloc.num_used / alloc.num_blocks)
        self._advance(self.prefix_queries, "queries", alloc.query_tokens)
        self._advance(self.prefix_hits, "hits", alloc.hit_tokens)
        self._advance(self.preemptions, "preemptions", sched.num_preemptions)
        self._advance(self.prompt_tokens, "prompt", engine.counters["prompt_tokens"])
        self._advance(self.generation_tokens, "generation", engine.counters["generation_tokens"])

    def finished(self, req, reason: str) -> None:
        """Observe one finished sample's latencies (engine thread)."""
        m = req.metrics
        self.success.labels(self.model_name, FINISH_REASONS.get(reason, reason)).inc()
        if m.first_scheduled is not None:
            self.queue.observe(m.queue_time)
        if m.first_token is not None:
            self.ttft.observe(m.ttft)
            self.e2e.observe(m.finished - m.arrival)
            for gap in np.diff(m.token_times):
                self.itl.observe(float(gap))

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


