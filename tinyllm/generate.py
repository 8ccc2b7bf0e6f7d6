"""The generation loop, written out: tokenize, prefill, then one decode step per new token.

    prompt ids --prefill--> logits --sample--> token 1      (TTFT ends here)
    token n    --decode_step--> logits --sample--> token n+1  (one inter-token latency each)

It stops at an end-of-sequence token, a stop string, `max_new_tokens`, or the end of the model's context,
and measures what a serving engineer reads first: time to first token, prefill and decode tokens/s, and
the inter-token latencies. `stream` yields text as it is decoded; `generate` collects everything.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .kv_cache import check_kv_dtype
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


def stream(model, prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
           stop: Sequence[str] = (), chat: bool = False, speculative=None, num_draft: int = 4,
           kv: str = "contiguous", kv_memory: str | int | None = None, ignore_eos: bool = False,
           trace=None, kv_dtype: str = "float32") -> Stream:
    """Generate from `prompt` and yield text pieces as they decode (never half a UTF-8 character).

    prompt: a string (used as is, or wrapped in the model's chat template if `chat=True`), a list of chat
    messages ({"role", "content"} dicts, always templated), or a list of token ids.
    kv: "contiguous" (one array reserved for the whole generation) or "paged" (blocks taken as the
    sequence grows, paged.py); both give the same tokens. kv_memory ("64MiB", bytes): with kv="paged", the
    pool's budget; a request that could outgrow it is refused before any work.
    kv_dtype: how the cache stores K and V: "float32", "float16" (half the memory) or "int8" (about a quarter;
    kv_cache.py); the values are rounded once, when stored.
    ignore_eos: keep generating past the end-of-sequence token (benchmarks use it for fixed output lengths).
    trace: True (or a trace.Trace, to choose layers, heads and the position cap) records what the model did
    inside, layer by layer, and every sampling stage; `result.trace` holds it. Same tokens, slower steps.
    speculative: a draft source ("self-q4", "self-int8", "layers:N", "ngram", "draft=PATH", or an object from
    speculative.make_draft) to draft `num_draft` tokens per target pass; the output distribution is unchanged.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"invalid max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
    stops = StopStrings(stop)
    if trace is True:
        from .trace import Trace
        trace = Trace()
    if speculative is not None:
        if trace is not None:
            raise ValueError("trace follows plain decoding: drop speculative=... to trace a run")
        from .speculative import make_draft
        if not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 1:
            raise ValueError(f"invalid num_draft={num_draft!r}: must be an integer >= 1")
        speculative = (make_draft(model, speculative), num_draft)
    if kv not in KV_CHOICES:
        raise ValueError(f"unknown kv {kv!r}; choose one of: {', '.join(KV_CHOICES)}")
    if kv_memory is not None and kv != "paged":
        raise ValueError("kv_memory sizes the paged pool: use it with kv='paged'")
    kv_dtype = check_kv_dtype(kv_dtype)
    holder: list = []
    return Stream(_run(model, prompt, params, max_new_tokens, stops, chat, holder, speculative,
                       (kv, kv_memory, kv_dtype), ignore_eos, trace), holder)


def generate(model, prompt, **kwargs) -> GenerationResult:
    """Generate and return everything at once: `.token_ids`, `.text`, `.stats`, `.finish_reason`.
    Keywords as for `stream`."""
    s = stream(model, prompt, **kwargs)
    for _ in s:
        pass
    return s.result


def prompt_ids(model, prompt, chat: bool = False) -> list[int]:
    """Token ids for a prompt given as text, chat messages, or ids (checked against the vocabulary)."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        _check_fits(model, [prompt])
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        _check_fits(model, [m.get("content") for m in prompt if isinstance(m.get("content"), str)])
        ids = tok.encode_chat(list(prompt))
    else:
        ids = as_token_ids(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    V = model.config.vocab_size
    if any(not 0 <= i < V for i in ids):
        raise ValueError(f"prompt has token ids outside the vocabulary (0 .. {V - 1})")
    return ids


def _check_fits(model, texts: list[str]) -> None:
    """Refuse, before encoding, text whose byte length alone proves it cannot fit the context (encoding a
    long text costs seconds; see Tokenizer.min_tokens)."""
    ctx = model.config.context_length
    at_least = sum(model.tokenizer.min_tokens(t) for t in texts)
    if at_least >= ctx:
        raise ValueError(f"the prompt has at least {at_least} tokens ({sum(len(t.encode()) for t in texts):,} bytes, "
                         f"at most {model.tokenizer.max_token_bytes} per token) but the model's context is {ctx}: "
                         f"shorten it")


def as_token_ids(values, what: str = "prompt") -> list[int]:
    """Token ids given as a list / tuple / range / 1-D array of integers: never text, floats, bools or a bare
    number (`42` or `[5.9]` is a mistake, not a prompt). -> list[int]; ValueError naming `what` otherwise."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return values.tolist()
    if isinstance(values, (list, tuple, range)) and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in values):
        return [int(i) for i in values]
    raise ValueError(f"{what} must be text, a list of chat messages, or a list of integer token ids; got "
                     f"{type(values).__name__} {str(values)[:40]!r}" if what == "prompt" else
                     f"{what} must be a list of integer token ids; got {type(values).__name__} {str(values)[:40]!r}")


def new_cache(model, max_seq_len: int, kv: str = "contiguous", kv_memory: str | int | None = None,
              kv_dtype: str = "float32"):
    """A KV cache for one generation storing K/V as kv_dtype: a contiguous reservation, or a sequence in a paged
    pool (just big enough, or of `kv_memory` bytes; a budget that cannot hold max_seq_len positions is refused
    here, before any work)."""
    if kv == "contiguous":
        return model.new_cache(max_seq_len, kv_dtype)
    from .paged import PagedKVCache
    if kv_memory is None:
        return PagedKVCache(model.config, block_size=16, num_blocks=-(-max_seq_len // 16),
                            kv_dtype=kv_dtype).new_sequence()
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
    return pool.new_sequence()


def end_token_ids(tokenizer) -> set[int]:
    """Ids that end a generation: the eos token, and `<|endoftext|>` when the vocabulary has it."""
    ends = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    ends |= {i for i in tokenizer.special_ids if tokenizer.id_to_bytes(i) == b"<|endoftext|>"}
    return ends


class StopStrings:
    """Stop strings, checked against a growing text: where to cut it, and how much of it may be shown yet."""

    def __init__(self, stop: str | Sequence[str] = ()):
        stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.strings = tuple(stop)

    def find(self, text: str) -> int:
        """Where the earliest stop string in `text` begins (the text is cut there), or -1."""
        return min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=-1)

    def safe_length(self, text: str) -> int:
        """How much of `text` can be shown: all but the trailing characters that could still grow into a stop
        string."""
        hold = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return len(text) - hold


def _plain_tokens(model, ids: list[int], cache, logits, params: SamplingParams, rng, trace=None) -> Iterator[int]:
    """Plain decoding: sample a token, feed it back through the model, repeat; one token per model pass."""
    history = list(ids)          # for the repetition penalty
    while True:
        stages = [] if trace is not None else None
        next_id = sample(logits, params, rng, history, stages)
        if trace is not None:
            trace.record_sampling(stages, next_id)
        yield next_id
        history.append(next_id)
        logits = model.decode_step(next_id, cache, trace=trace)         # [V]


def _run(model, prompt, params: SamplingParams, max_new_tokens: int, stops: StopStrings, chat: bool,
         holder: list, speculative=None, kv=("contiguous", None, "float32"), ignore_eos: bool = False,
         trace=None) -> Iterator[str]:
    t_start = time.perf_counter()
    tok = model.tokenizer
    ids = prompt_ids(model, prompt, chat)
    ctx = model.config.context_length
    if len(ids) >= ctx:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it "
                         f"(at least one position must be left to generate into)")
    rng = params.make_rng()
    ends = set() if ignore_eos else end_token_ids(tok)
    stats = GenerationStats(prompt_tokens=len(ids))
    cache = new_cache(model, min(ctx, len(ids) + max_new_tokens), *kv)
    stats.kv_bytes_per_token = cache.bytes_per_token

    # --- prefill: the whole prompt (model.prefill: in chunks past 128 tokens) -> logits for the first new token
    t0 = time.perf_counter()
    logits = model.prefill(ids, cache, trace=trace)                      # [V]
    stats.prefill_s = time.perf_counter() - t0

    if speculative is None:
        tokens = _plain_tokens(model, ids, cache, logits, params, rng, trace)
    else:                        # draft several tokens, verify them in one pass (speculative.py)
        from .speculative import SpeculativeStats, speculative_tokens
        draft, k = speculative
        stats.speculative = SpeculativeStats(source=draft.name, num_draft=k)
        tokens = speculative_tokens(model, draft, ids, cache, logits, params, rng, k, max_new_tokens,
                                    stats.speculative)
    decoder = tok.stream_decoder()
    out_ids: list[int] = []
    text, shown = "", 0          # all text decoded so far; how much of it has been yielded
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
        text += decoder.feed(next_id)
        hit = stops.find(text)
        if hit >= 0:                                                     # cut before the stop string
            text, finish = text[:hit], "stop_string"
            break
        safe = stops.safe_length(text)
        if safe > shown:
            yield text[shown:safe]
            shown = safe
        if len(out_ids) >= max_new_tokens:
            break
        if cache.length >= ctx:
            finish = "context"
            break
        # --- decode: the next iteration runs the model (one token per pass, or a speculative round)
    stats.decode_s = sum(stats.itl_s)
    if finish != "stop_string":
        text += decoder.flush()
    if len(text) > shown:
        yield text[shown:]
    stats.generated_tokens = len(out_ids)
    stats.kv_cache_bytes = cache.nbytes          # read at the end: a paged sequence takes blocks as it grows
    holder.append(GenerationResult(out_ids, text, ids, stats, finish, trace))
