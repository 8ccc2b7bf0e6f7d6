"""The generation loop, written out: tokenize, prefill, then one decode step per new token.

    prompt ids --prefill--> logits --sample--> token 1      (TTFT ends here)
    token n    --decode_step--> logits --sample--> token n+1  (one inter-token latency each)

It stops at an end-of-sequence token, a stop string, `max_new_tokens`, or the end of the model's context,
and measures what a serving engineer reads first: time to first token, prefill and decode tokens/s, and
the inter-token latencies. `stream` yields text as it is decoded; `generate` collects everything. How to
sample is a SamplingParams (sampling.py), where K/V live a CacheSpec; the prompt's checks, the end tokens and
the text with its stop strings are requests.py's, shared with the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Iterator, Sequence

import numpy as np

from .kv_cache import check_kv_dtype
from .requests import StopStrings, TextOutput, as_sampling_params, check_room, end_token_ids, positive_int, prompt_ids
from .sampling import SamplingParams, sample

FINISH_REASONS = ("eos", "stop_string", "length", "context")
KV_CHOICES = ("contiguous", "paged")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0               # request start (incl. tokenization) -> first token sampled
    prefill_s: float = 0.0            # the prefill forward pass alone
    decode_s: float = 0.0             # all decode steps (each: forward + sample)
    itl_s: list[float] = field(default_factory=list)   # one entry per token after the first
    kv_bytes_per_token: int = 0
    kv_cache_bytes: int = 0           # KV memory this request held at its end (contiguous: the whole reservation)
    speculative: object = None        # speculative.SpeculativeStats when decoding speculatively

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.itl_s) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def itl_mean_s(self) -> float:
        return float(np.mean(self.itl_s)) if self.itl_s else 0.0

    @property
    def itl_p95_s(self) -> float:
        return float(np.percentile(self.itl_s, 95)) if self.itl_s else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items()}
        d["speculative"] = self.speculative.as_dict() if self.speculative is not None else None
        d.update(prefill_tokens_per_s=self.prefill_tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                 itl_mean_s=self.itl_mean_s, itl_p95_s=self.itl_p95_s)
        return d

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tok | generated {self.generated_tokens} tok | "
                f"TTFT {self.ttft_s * 1e3:.0f} ms | prefill {self.prefill_tokens_per_s:.0f} tok/s | "
                f"decode {self.decode_tokens_per_s:.1f} tok/s | "
                f"ITL mean {self.itl_mean_s * 1e3:.1f} ms p95 {self.itl_p95_s * 1e3:.1f} ms"
                + (f"\n{self.speculative.summary()}" if self.speculative is not None else ""))


@dataclass
class GenerationResult:
    token_ids: list[int]              # generated ids (the end-of-sequence token itself is not included)
    text: str                         # their text, cut before a stop string if one was hit
    prompt_ids: list[int]
    stats: GenerationStats
    finish_reason: str                # one of FINISH_REASONS
    trace: object = None              # trace.Trace of the run, with trace=True (or a Trace) given


class Stream:
    """Iterate to get text pieces as they are decoded; afterwards `.result` holds ids, text and stats."""

    def __init__(self, pieces: Iterator[str], holder: list):
        self._pieces, self._holder = pieces, holder

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces

    @property
    def result(self) -> GenerationResult:
        if not self._holder:
            raise RuntimeError("the stream has not finished yet: iterate over it first")
        return self._holder[0]


# stream()'s keyword form: SamplingParams' fields, and CacheSpec's under the names the keywords have always had
SAMPLING_KEYWORDS = tuple(f.name for f in fields(SamplingParams))    # temperature, top_k, ..., seed
CACHE_KEYWORDS = {"kv": "kind", "kv_memory": "kv_memory", "kv_dtype": "kv_dtype"}


@dataclass(frozen=True)
class CacheSpec:
    """Where one generation keeps its K and V (checked when made).

    kind: "contiguous" (one array reserved for the whole generation) or "paged" (blocks taken as the sequence
    grows, paged.py); both give the same tokens. kv_memory ("64MiB", bytes): with "paged", the pool's budget; a
    request that could outgrow it is refused before any work. kv_dtype: "float32", "float16" (half the memory)
    or "int8" (about a quarter; kv_cache.py); the values are rounded once, when stored.
    """
    kind: str = "contiguous"
    kv_memory: str | int | None = None
    kv_dtype: str = "float32"

    def __post_init__(self):
        if self.kind not in KV_CHOICES:
            raise ValueError(f"unknown kv {self.kind!r}; choose one of: {', '.join(KV_CHOICES)}")
        if self.kv_memory is not None and self.kind != "paged":
            raise ValueError("kv_memory sizes the paged pool: use it with kv='paged'")
        object.__setattr__(self, "kv_dtype", check_kv_dtype(self.kv_dtype))   # np.float16 -> "float16"


def stream(model, prompt, max_new_tokens: int = 256, *, params: SamplingParams | None = None,
           cache: CacheSpec | None = None, stop: Sequence[str] = (), chat: bool = False, ignore_eos: bool = False,
           speculative=None, num_draft: int = 4, trace=None, ablate=(), patch=(), **settings) -> Stream:
    """Generate from `prompt` and yield text pieces as they decode (never half a UTF-8 character).

    prompt: a string (used as is, or wrapped in the model's chat template if `chat=True`), a list of chat
    messages ({"role", "content"} dicts, always templated), or a list of token ids.
    params: how to sample (SamplingParams; greedy by default), or its fields as keywords: temperature, top_k,
    top_p, min_p, repetition_penalty, seed.
    cache: where K and V live (CacheSpec; a contiguous float32 cache by default), or as keywords: kv (its kind),
    kv_memory, kv_dtype.
    stop: strings that end the generation; the text is cut before them, and no piece of one is ever yielded.
    ignore_eos: keep generating past the end-of-sequence token (benchmarks use it for fixed output lengths).
    trace: True (or a trace.Trace, to choose layers, heads and the position cap) records what the model did
    inside, layer by layer, and every sampling stage; `result.trace` holds it. Same tokens, slower steps.
    ablate: (layer, head) pairs whose output is zeroed in every pass; patch: interventions.Patch values put in
    place at their positions (interventions.py). Both run each pass op by op.
    speculative: a draft source ("self-q4", "self-int8", "layers:N", "ngram", "draft=PATH", or an object from
    speculative.make_draft) to draft `num_draft` tokens per target pass; the output distribution is unchanged.
    """
    params, cache = _settings(params, cache, settings)
    positive_int(max_new_tokens, "max_new_tokens")
    stops = StopStrings(stop)
    if trace is True:
        from .trace import Trace
        trace = Trace()
    from .interventions import make_interventions
    edit = make_interventions(model.config, ablate, patch)
    if speculative is not None:
        if trace is not None:
            raise ValueError("trace follows plain decoding: drop speculative=... to trace a run")
        if edit is not None:
            raise ValueError("ablate and patch follow plain decoding: drop speculative=... to intervene")
        from .speculative import make_draft
        num_draft = positive_int(num_draft, "num_draft")
        speculative = (make_draft(model, speculative), num_draft)
    holder: list = []
    return Stream(_run(model, prompt, params, max_new_tokens, stops, chat, holder, speculative, cache, ignore_eos,
                       trace, edit), holder)


def _settings(params, cache, keywords: dict) -> tuple[SamplingParams, CacheSpec]:
    """stream()'s two ways of saying how to sample and where K/V live: the objects, or their fields as keywords
    (not both for the same one)."""
    sampling = {k: keywords.pop(k) for k in SAMPLING_KEYWORDS if k in keywords}
    caching = {k: keywords.pop(k) for k in CACHE_KEYWORDS if k in keywords}            # by stream()'s names
    if keywords:
        raise TypeError(f"stream() got an unexpected keyword argument {next(iter(keywords))!r}")
    if params is not None and sampling:
        raise ValueError(f"give sampling settings as params=SamplingParams(...) or as keywords, not both "
                         f"(got params and {', '.join(sampling)})")
    if cache is not None and caching:
        raise ValueError(f"give the cache as cache=CacheSpec(...) or as keywords, not both (got cache and "
                         f"{', '.join(caching)})")
    if cache is not None and not isinstance(cache, CacheSpec):
        raise ValueError(f"cache must be a CacheSpec, got {type(cache).__name__}")
    params = SamplingParams(**sampling) if params is None else as_sampling_params(params)
    return params, CacheSpec(**{CACHE_KEYWORDS[k]: v for k, v in caching.items()}) if cache is None else cache


def generate(model, prompt, **kwargs) -> GenerationResult:
    """Generate and return everything at once: `.token_ids`, `.text`, `.stats`, `.finish_reason`.
    Keywords as for `stream`."""
    s = stream(model, prompt, **kwargs)
    for _ in s:
        pass
    return s.result


def new_cache(model, max_seq_len: int, spec: CacheSpec = CacheSpec()):
    """A KV cache for one generation as `spec` says: a contiguous reservation, or a sequence in a paged pool (just
    big enough, or of `spec.kv_memory` bytes; a budget that cannot hold max_seq_len positions is refused here,
    before any work)."""
    kv_memory, kv_dtype = spec.kv_memory, spec.kv_dtype
    if spec.kind == "contiguous":
        return model.new_cache(max_seq_len, kv_dtype)
    from .paged import PagedKVCache
    if kv_memory is None:
        pool = PagedKVCache(model.config, block_size=16, num_blocks=-(-max_seq_len // 16), kv_dtype=kv_dtype)
        model.warm_up_pool(pool)                    # its kernels compiled now, not in the first step
        return pool.new_sequence()
    try:
        pool = PagedKVCache(model.config, block_size=16, memory=kv_memory, kv_dtype=kv_dtype)
    except MemoryError:
        raise ValueError(f"KV memory {kv_memory} cannot be allocated on this machine: give a smaller budget "
                         f"(this request needs {max_seq_len * model.config.kv_bytes_per_token(kv_dtype):,} "
                         f"bytes)") from None
    capacity = pool.num_blocks * pool.block_size
    if capacity < max_seq_len:
        raise ValueError(f"KV memory {kv_memory} holds {capacity} positions ({pool.bytes_per_token:,} bytes each) but "
                         f"this request may need {max_seq_len} (prompt + max_new_tokens): raise the KV memory or "
                         f"lower max_new_tokens")
    model.warm_up_pool(pool)
    return pool.new_sequence()


def _plain_tokens(model, ids: list[int], cache, logits, params: SamplingParams, rng, trace=None,
                  edit=None) -> Iterator[int]:
    """Plain decoding: sample a token, feed it back through the model, repeat; one token per model pass."""
    history = list(ids)          # for the repetition penalty
    while True:
        stages = [] if trace is not None else None
        next_id = sample(logits, params, rng, history, stages)
        if trace is not None:
            trace.record_sampling(stages, next_id)
        yield next_id
        history.append(next_id)
        logits = model.decode_step(next_id, cache, trace=trace, edit=edit)   # [V]


def _run(model, prompt, params: SamplingParams, max_new_tokens: int, stops: StopStrings, chat: bool,
         holder: list, speculative=None, spec: CacheSpec = CacheSpec(), ignore_eos: bool = False,
         trace=None, edit=None) -> Iterator[str]:
    t_start = time.perf_counter()
    tok = model.tokenizer
    ids = prompt_ids(model, prompt, chat)
    ctx = model.config.context_length
    check_room(ids, ctx)
    rng = params.make_rng()
    ends = set() if ignore_eos else end_token_ids(tok)
    stats = GenerationStats(prompt_tokens=len(ids))
    cache = new_cache(model, min(ctx, len(ids) + max_new_tokens), spec)
    if edit is not None:
        edit.check_positions(min(ctx, len(ids) + max_new_tokens))    # the positions this run can reach
    stats.kv_bytes_per_token = cache.bytes_per_token

    # --- prefill: the whole prompt (model.prefill: in chunks past 128 tokens) -> logits for the first new token
    t0 = time.perf_counter()
    logits = model.prefill(ids, cache, trace=trace, edit=edit)           # [V]
    stats.prefill_s = time.perf_counter() - t0

    if speculative is None:
        tokens = _plain_tokens(model, ids, cache, logits, params, rng, trace, edit)
    else:                        # draft several tokens, verify them in one pass (speculative.py)
        from .speculative import SpeculativeStats, speculative_tokens
        draft, k = speculative
        stats.speculative = SpeculativeStats(source=draft.name, num_draft=k)
        tokens = speculative_tokens(model, draft, ids, cache, logits, params, rng, k, max_new_tokens,
                                    stats.speculative)
    out = TextOutput(tok, stops)  # the text: decoded, cut before a stop string, shown once it cannot become one
    out_ids: list[int] = []
    finish = "length"
    t_prev = None
    for next_id in tokens:
        now = time.perf_counter()
        if t_prev is None:
            stats.ttft_s = now - t_start
        else:
            stats.itl_s.append(now - t_prev)
        t_prev = now
        if next_id in ends:
            finish = "eos"
            break
        out_ids.append(next_id)
        if out.add(next_id):                                             # the text is cut before the stop string
            finish = "stop_string"
            break
        piece = out.take()
        if piece:
            yield piece
        if len(out_ids) >= max_new_tokens:
            break
        if cache.length >= ctx:
            finish = "context"
            break
        # --- decode: the next iteration runs the model (one token per pass, or a speculative round)
    stats.decode_s = sum(stats.itl_s)
    rest = out.close()
    if rest:
        yield rest
    stats.generated_tokens = len(out_ids)
    stats.kv_cache_bytes = cache.nbytes          # read at the end: a paged sequence takes blocks as it grows
    holder.append(GenerationResult(out_ids, out.text, ids, stats, finish, trace))
