"""The scheduler of the serving engine: which requests run in the next step, and how many of their tokens.

A request waits, runs (its prompt in chunks, then one token per step) and finishes; the Scheduler owns the
waiting and running queues and admits, chunks and preempts. Two policies: "continuous" refills free slots between
steps (Orca, Yu et al. OSDI 2022: iteration-level scheduling; vLLM), "static" admits a batch and runs it until its
longest member finishes. It decides only (and alone gives running requests their batch slots): engine.py runs
the steps it plans.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .paged import OutOfBlocks, PagedKVCache, SequenceCache
from .requests import TextOutput
from .sampling import SamplingParams

POLICIES = ("continuous", "static")


def pool_name(request_id: str) -> tuple:
    """A request's sequence name in the KV pool: namespaced, so that no request id collides with the pool's own
    "seq{n}" names."""
    return ("request", request_id)


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
    output: TextOutput               # the output's text, its stop strings, what events have sent of it
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    status: str = "waiting"          # waiting -> running (-> waiting if preempted) -> finished
    finish_reason: str | None = None # "eos", "stop_string", "length", "abort"
    num_computed: int = 0            # leading tokens of all_ids whose K/V are in the cache
    cache: SequenceCache | None = None
    slot: int | None = None          # batch slot while running (for timelines)
    rng: np.random.Generator | None = None
    logprobs: int | None = None      # None: no logprobs; k >= 0: the sampled token's and the k most likely
    group: str = ""                  # the caller's request id; samples forked from it share it (see `index`)
    index: int = 0                   # which of the group's n samples this is (0: the request itself)
    forks: int = 0                   # samples still to fork from this one when its prompt is done (n - 1)
    children: list = field(default_factory=list)   # the Requests forked from this one

    @property
    def text(self) -> str:
        """The output's text so far (cut before a stop string, if one was hit)."""
        return self.output.text

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
    request_id: str                  # the id given to add_request (shared by the n samples of a request)
    token_id: int | None
    text: str                        # the new text piece (may be "" while a UTF-8 character is incomplete)
    finished: bool
    finish_reason: str | None
    index: int = 0                   # which sample of the request (0 .. n-1)
    logprob: float | None = None     # log p(token) under the model's distribution (before sampling's reshaping)
    top_logprobs: list | None = None # [(token id, log p)] of the most likely tokens, most likely first


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
        # Seats: the running requests and the samples they will fork when their prompts are done (n > 1).
        seats = len(self.running) + sum(r.forks for r in self.running)
        while admit and self.waiting and seats + 1 + self.waiting[0].forks <= self.max_num_seqs:
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
            seats += 1 + req.forks
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
            req.cache = self.pool.new_sequence(req.all_ids, seq_id=pool_name(req.request_id))
        except OutOfBlocks:
            return False
        req.num_computed = req.cache.length                       # tokens served by the prefix cache
        if req.metrics.first_scheduled is None:
            req.metrics.first_scheduled = now
            req.metrics.cached_tokens = req.num_computed
        req.status, req.slot = "running", self._free_slot()
        return True

    def _free_slot(self) -> int:
        """The lowest batch slot no running request holds (slots only label rows of timelines)."""
        used = {r.slot for r in self.running}
        return next(s for s in range(len(used) + 1) if s not in used)

    def add_running(self, req: Request) -> None:
        """Run `req` from the next step on, in a free slot: a request that already holds its KV blocks (a sample
        forked from another, engine.py), so admission has nothing to allocate."""
        req.status, req.slot = "running", self._free_slot()
        self.running.append(req)

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


