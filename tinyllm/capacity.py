"""The arithmetic of serving: KV cache sizing, concurrency, roofline step times, request latency, token spend,
and static vs continuous batching on the real scheduler.

Pure functions over plain keyword arguments. Bytes are SI (1 GB = 1e9 B) unless a name says GiB (2**30 B);
bandwidth is bytes per second, compute FLOPs per second. `ModelShape` bundles what the formulas need about a
model: one of the illustrative shapes (`SHAPES`), any tinyllm config (`ModelShape.from_config`) or a loaded
model (`ModelShape.from_model`). `forward_flops` counts tinyllm's own forward pass exactly (the benchmarks'
roofline uses it); the seed-level formulas (2 x params per token) are deliberately simpler.
`fit` says whether a batch fits in memory, and by how much it does not. This machine's own roofs: roofs.py.
Left out: tensor parallelism, activation memory, and any overhead the roofline does not see (kernel launches,
Python): `scripts/capacity.py calibrate` measures how far this machine is from the roofline.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 10**9


# --- the KV cache ---------------------------------------------------------------------------------------------
def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    """K and V of one token, every layer and KV head: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def kv_bytes_per_sequence(*, layers: int, kv_heads: int, head_dim: int, bytes_per_value: float,
                          context: int) -> float:
    """KV cache of one sequence holding `context` tokens."""
    return context * kv_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                        bytes_per_value=bytes_per_value)


def kv_dtype_bytes(kv_dtype: str, head_dim: int) -> float:
    """Average bytes per cached value of a tinyllm kv_dtype: float32 4, float16 2, int8 1 plus its share of a
    float16 scale per 32 values (1.0625; kv_cache.py)."""
    from .kv_cache import bytes_per_value
    return bytes_per_value(kv_dtype, head_dim)


def sequences_by_kv_dtype(shape: "ModelShape", *, memory_bytes: float, usable_fraction: float,
                          context: int) -> dict:
    """How many sequences of `context` tokens fit beside the weights with each tinyllm kv_dtype.
    -> {kv_dtype: dict(kv_bytes_per_token, sequences, vs_float32)}; vs_float32 is None when float32 fits none."""
    from .kv_cache import KV_DTYPES
    out = {}
    for kv_dtype in KV_DTYPES:
        per_token = shape.replace(kv_bytes_per_value=kv_dtype_bytes(kv_dtype, shape.head_dim)).kv_bytes_per_token
        n = max_concurrent_sequences(memory_bytes=memory_bytes, usable_fraction=usable_fraction,
                                     weight_bytes=shape.weight_bytes, context=context, kv_bytes_per_token=per_token)
        base = out["float32"]["sequences"] if out else n
        out[kv_dtype] = dict(kv_bytes_per_token=per_token, sequences=n, vs_float32=n / base if base else None)
    return out


def max_concurrent_sequences(*, memory_bytes: float, usable_fraction: float, weight_bytes: float, context: int,
                             kv_bytes_per_token: float) -> int:
    """How many sequences of `context` tokens fit beside the weights in the usable share of device memory
    (the rest kept for activations and fragmentation). 0 when the weights alone do not fit."""
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction}")
    if context < 1 or kv_bytes_per_token <= 0:
        raise ValueError("context and kv_bytes_per_token must be positive")
    free = memory_bytes * usable_fraction - weight_bytes
    return max(0, int(free // (context * kv_bytes_per_token)))


@dataclass(frozen=True)
class Fit:
    """Does a decode batch fit beside the weights? Bytes are what one step needs resident (and reads)."""
    needed: float          # the weights + batch x context x KV per token
    usable: float          # memory x usable fraction
    memory: float
    weights: float
    batch: int
    context: int
    max_batch: int         # sequences of `context` tokens that fit (0: not one)
    max_context: int       # tokens per sequence that fit at `batch` (0: the weights alone take it all)

    @property
    def fits(self) -> bool:
        return self.needed <= self.usable

    @property
    def over(self) -> float:
        """Bytes beyond the usable memory (negative: room to spare)."""
        return self.needed - self.usable

    def verdict(self) -> str:
        """One line: fits with how much to spare, or does not fit, by how much, and what would."""
        gib = lambda n: f"{n / GiB:,.1f} GiB"                                  # noqa: E731
        usable = f"{gib(self.usable)} usable ({gib(self.memory)} x {self.usable / self.memory:g})" \
            if self.memory else "no memory"
        if self.fits:
            return f"fits: needs {gib(self.needed)} of {usable}, {gib(-self.over)} to spare"
        if self.weights >= self.usable:
            return (f"does not fit: the weights alone ({gib(self.weights)}) exceed the {usable}, "
                    f"{gib(self.over)} over with the KV cache")
        return (f"does not fit: needs {gib(self.needed)}, {gib(self.over)} more than the {usable}; at context "
                f"{self.context:,} at most {self.max_batch:,} sequences fit, at batch {self.batch:,} at most "
                f"{self.max_context:,} tokens each")


def fit(*, memory_bytes: float, usable_fraction: float, weight_bytes: float, batch: int, context: int,
        kv_bytes_per_token: float) -> Fit:
    """Whether `batch` sequences of `context` tokens fit beside the weights in the usable share of memory."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    usable = memory_bytes * usable_fraction
    room = max(0.0, usable - weight_bytes)                       # what is left for the KV cache
    return Fit(needed=decode_step_bytes(weight_bytes=weight_bytes, batch=batch, context=context,
                                        kv_bytes_per_token=kv_bytes_per_token),
               usable=usable, memory=memory_bytes, weights=weight_bytes, batch=batch, context=context,
               max_batch=max_concurrent_sequences(memory_bytes=memory_bytes, usable_fraction=usable_fraction,
                                                  weight_bytes=weight_bytes, context=context,
                                                  kv_bytes_per_token=kv_bytes_per_token),
               max_context=int(room // (batch * kv_bytes_per_token)))


# --- FLOPs, bytes and the roofline ----------------------------------------------------------------------------
def prefill_flops(*, params: float, tokens: int) -> float:
    """A forward over `tokens` prompt tokens: one multiply and one add per parameter per token (attention's
    quadratic term left out: small next to the matmuls until the prompt is thousands of tokens long)."""
    return 2 * params * tokens


def decode_flops(*, params: float, batch: int = 1) -> float:
    """One decode step: one new token per sequence, 2 FLOPs per parameter each."""
    return 2 * params * batch


def decode_step_bytes(*, weight_bytes: float, batch: int, context: int, kv_bytes_per_token: float) -> float:
    """Bytes one decode step reads: every weight once (shared by the whole batch) plus each sequence's cache."""
    return weight_bytes + batch * context * kv_bytes_per_token


def ridge_point(*, peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte above which a kernel is compute-bound on this hardware."""
    return peak_flops / bandwidth


def roofline_time(*, bytes_moved: float, flops: float, bandwidth: float, peak_flops: float) -> float:
    """The least time a pass can take: it must move its bytes and do its arithmetic, whichever is slower."""
    return max(bytes_moved / bandwidth, flops / peak_flops)


def decode_step_time(*, weight_bytes: float, batch: int, context: int, kv_bytes_per_token: float,
                     bandwidth: float, params: float, peak_flops: float) -> float:
    """Seconds per decode step of `batch` sequences with `context` cached tokens each (the roofline)."""
    return roofline_time(bytes_moved=decode_step_bytes(weight_bytes=weight_bytes, batch=batch, context=context,
                                                       kv_bytes_per_token=kv_bytes_per_token),
                         flops=decode_flops(params=params, batch=batch), bandwidth=bandwidth, peak_flops=peak_flops)


def prefill_time(*, prompt_tokens: int, weight_bytes: float, kv_bytes_per_token: float, bandwidth: float,
                 params: float, peak_flops: float) -> float:
    """Seconds to prefill one prompt: the weights read once, the prompt's K/V written once, 2 x params FLOPs per
    token."""
    return roofline_time(bytes_moved=weight_bytes + prompt_tokens * kv_bytes_per_token,
                         flops=prefill_flops(params=params, tokens=prompt_tokens), bandwidth=bandwidth,
                         peak_flops=peak_flops)


# --- latency and money ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLatency:
    ttft: float          # seconds to the first token: the prefill (no queueing)
    itl: float           # seconds between tokens: one decode step (the mean one, with growing_context)
    total: float         # ttft + (output_tokens - 1) * itl


def request_latency(*, prompt_tokens: int, output_tokens: int, weight_bytes: float, params: float,
                    kv_bytes_per_token: float, bandwidth: float, peak_flops: float, batch: int = 1,
                    growing_context: bool = False) -> RequestLatency:
    """TTFT + (output_tokens - 1) x ITL for one request decoding in a batch of `batch`.

    By default every decode step reads the prompt's cache only (the seed's simplification); with
    growing_context each step reads the cache as it is at that step, prompt plus the tokens generated so far.
    """
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt_tokens and output_tokens must be >= 1")
    ttft = prefill_time(prompt_tokens=prompt_tokens, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
                        bandwidth=bandwidth, params=params, peak_flops=peak_flops)
    contexts = range(prompt_tokens + 1, prompt_tokens + output_tokens) if growing_context else \
        [prompt_tokens] * (output_tokens - 1)
    steps = [decode_step_time(weight_bytes=weight_bytes, batch=batch, context=c, kv_bytes_per_token=kv_bytes_per_token,
                              bandwidth=bandwidth, params=params, peak_flops=peak_flops) for c in contexts]
    itl = sum(steps) / len(steps) if steps else 0.0
    return RequestLatency(ttft=ttft, itl=itl, total=ttft + sum(steps))


@dataclass(frozen=True)
class TokenSpend:
    input_per_day: float             # dollars
    output_per_day: float
    total_per_day: float
    output_share_of_spend: float     # fraction of the dollars the output tokens take
    output_share_of_tokens: float    # fraction of the tokens they are


def token_spend(*, requests_per_day: float, input_tokens: float, output_tokens: float,
                price_in_per_million: float, price_out_per_million: float) -> TokenSpend:
    """Daily cost of a traffic pattern at per-million-token prices for input and output."""
    tokens_in, tokens_out = requests_per_day * input_tokens, requests_per_day * output_tokens
    cost_in, cost_out = tokens_in / 1e6 * price_in_per_million, tokens_out / 1e6 * price_out_per_million
    total = cost_in + cost_out
    return TokenSpend(cost_in, cost_out, total, cost_out / total if total else 0.0,
                      tokens_out / (tokens_in + tokens_out) if tokens_in + tokens_out else 0.0)


# --- model shapes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the calculators need to know about a model."""
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float
    weight_bytes: float
    kv_bytes_per_value: float = 2

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  bytes_per_value=self.kv_bytes_per_value)

    def replace(self, **changes) -> "ModelShape":
        """A copy with some fields changed (None values are ignored, so CLI flags can be passed straight in)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_config(cls, config: ModelConfig, weight_bytes: float | None = None,
                    kv_bytes_per_value: float = 4, kv_dtype: str | None = None) -> "ModelShape":
        """A tinyllm config. Weights default to float32; the KV cache to float32 (4 bytes per value), or the
        bytes of `kv_dtype` ("float16", "int8") when given."""
        if kv_dtype is not None:
            kv_bytes_per_value = kv_dtype_bytes(kv_dtype, config.head_dim)
        return cls(config.name or config.arch, config.n_layers, config.n_kv_heads, config.head_dim,
                   config.n_params, 4 * config.n_params if weight_bytes is None else weight_bytes,
                   kv_bytes_per_value)

    @classmethod
    def from_model(cls, model, kv_dtype: str | None = None) -> "ModelShape":
        """A loaded tinyllm Transformer, with the bytes its weights really take in their format (and a KV cache
        of kv_dtype, float32 by default)."""
        shape = cls.from_config(model.config, weight_bytes=model.weight_bytes, kv_dtype=kv_dtype)
        return shape.replace(name=f"{shape.name} ({model.quant or 'fp32'})")


# Illustrative shapes (not any particular model card): fp16 weights (2 bytes per parameter) and fp16 KV.
SHAPES = {
    "7b": ModelShape("7B-class, full multi-head attention", layers=32, kv_heads=32, head_dim=128, params=7e9,
                     weight_bytes=14e9),
    "70b": ModelShape("70B-class, grouped-query attention", layers=80, kv_heads=8, head_dim=128, params=70e9,
                      weight_bytes=140e9),
}


# --- tinyllm's own forward, counted exactly -------------------------------------------------------------------
def matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies in the blocks: q, k, v, o and the MLP, all layers (not the head)."""
    c = config
    mlp = 3 if c.mlp == "swiglu" else 2
    return c.n_layers * (c.dim * c.q_dim + 2 * c.dim * c.kv_dim + c.q_dim * c.dim + mlp * c.dim * c.ffn_dim)


def forward_flops(config: ModelConfig, tokens: int, past: int = 0) -> float:
    """FLOPs of one tinyllm forward over `tokens` new positions after `past` cached ones: the block matmuls,
    attention (q.K and p.V; new position t attends to past + t positions: causal), and the output head for the
    last position only (prefill and decode both compute just that row). A decode step is tokens=1, past=S."""
    c = config
    attended = tokens * past + tokens * (tokens + 1) / 2                  # sum over new positions of their context
    attention = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * attended
    return 2 * tokens * matmul_params(c) + 2 * c.dim * c.vocab_size + attention


# --- static vs continuous batching, on the real scheduler -----------------------------------------------------
@dataclass(frozen=True)
class SimRequest:
    """A request of the batching simulation. Times are in steps."""
    name: str                  # one character: its letter in the timeline
    output_tokens: int
    prompt_tokens: int = 1
    arrival: int = 0


class _StepClock:
    """The engine's clock: time is the number of forward passes so far (one tick per step)."""

    def __init__(self):
        self.t = 0

    def __call__(self) -> int:
        return self.t


class _StubModel:
    """Stands in for a Transformer in the Engine: reserves and fills KV positions like the real forward pass,
    ticks the clock once per batched pass, and always predicts token 1 (requests end by length)."""

    def __init__(self, clock: _StepClock):
        self.clock, self.tokenizer = clock, None
        self.config = ModelConfig(arch="llama", vocab_size=4, dim=2, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=1,
                                  context_length=1 << 20, name="stub")

    def warm_up_pool(self, pool) -> None:
        pass                                # no kernels to compile

    def forward_batch(self, seqs, caches, last_only=True):
        for ids, cache in zip(seqs, caches):
            cache.check_room(len(ids))
            cache.length += len(ids)
        self.clock.t += 1
        logits = np.zeros((1, self.config.vocab_size), dtype=np.float32)   # [1, V]: argmax is token 1
        logits[0, 1] = 1.0
        return [logits] * len(seqs)


@dataclass
class BatchingRun:
    """What one policy did: per slot, one character per step (the request's letter: upper case when that step
    gave it a token, lower case for a step of its prompt only, '.' idle), and when each request finished."""
    policy: str
    rows: list[str]              # [slots] strings of one character per step
    finished: dict[str, int]     # request name -> the step (1-based) that produced its last token
    latency: dict[str, int]      # request name -> finished - arrival
    engine: object               # the tinyllm.engine.Engine that ran it: its steps, metrics and scheduler

    def render(self) -> str:
        lines = [f"{self.policy} batching ({len(self.rows)} slots)"]
        lines += [f"  slot {i}: {row}" for i, row in enumerate(self.rows)]
        done = "  ".join(f"{name}:{t}" for name, t in self.finished.items())
        mean = sum(self.latency.values()) / len(self.latency)
        lines.append(f"  finished at step: {done}")
        lines.append(f"  all done at step {max(self.finished.values())}, mean completion (finish - arrival) "
                     f"{mean:.1f} steps")
        return "\n".join(lines)


def simulate_batching(requests: list[SimRequest], *, slots: int, policy: str,
                      max_num_batched_tokens: int = 512) -> BatchingRun:
    """Run `requests` through tinyllm's Engine (its Scheduler decides everything) on a stub model and a clock that
    counts steps, with `slots` sequences at most per step. A prompt longer than the step's token budget is
    prefilled in chunks over several steps (lower-case letters)."""
    from .engine import Engine                                    # imported here: it compiles the paged kernels

    if slots < 1:
        raise ValueError(f"need at least one slot, got {slots}")
    names = [r.name for r in requests]
    if not names:
        raise ValueError("no requests to simulate: give at least one")
    if len(set(names)) != len(names) or any(len(n) != 1 for n in names):
        raise ValueError(f"request names must be distinct single characters, got {names}")
    clock = _StepClock()
    model = _StubModel(clock)
    blocks = sum(-(-(r.prompt_tokens + r.output_tokens) // 16) for r in requests)   # room for all: no preemption
    engine = Engine(model, num_blocks=blocks, block_size=16, max_num_seqs=slots, policy=policy,
                    max_num_batched_tokens=max_num_batched_tokens, prefix_caching=False, watermark=0.0, clock=clock)
    pending = sorted(requests, key=lambda r: r.arrival)
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival <= clock.t:
            r = pending.pop(0)
            engine.add_request(r.name, [2] * r.prompt_tokens, max_tokens=r.output_tokens, stop_token_ids=[],
                               arrival_time=r.arrival)
        before = len(engine.steps)
        if engine.has_unfinished():
            engine.step()
        if len(engine.steps) == before:                         # nothing could run: wait for the next arrival
            if not pending:
                raise RuntimeError("the scheduler made no progress with no request left to arrive")
            clock.t = max(clock.t, pending[0].arrival)

    width = clock.t
    grid = [["."] * width for _ in range(slots)]
    token_steps = {rid: set(req.metrics.token_times) for rid, req in engine.requests.items()}
    for step in engine.steps:
        for slot, rid in step.slots.items():
            grid[slot][step.start] = rid.upper() if step.end in token_steps[rid] else rid.lower()
    finished = {r.name: engine.requests[r.name].metrics.finished for r in requests}
    return BatchingRun(policy, ["".join(row) for row in grid], finished,
                       {r.name: finished[r.name] - r.arrival for r in requests}, engine)
