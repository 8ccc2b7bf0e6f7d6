"""Speculative decoding: a cheap draft guesses k tokens, the target checks all of them in one forward pass.

A decode step is memory-bound: it reads every weight once, and the cores mostly wait. A pass over k+1 tokens
reads the same bytes, so it costs about the same as a pass over one. A cheap draft proposes k tokens, the
target scores them in one (k+1)-row pass, and the exact accept/resample rule (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling") keeps the output distributed exactly as the target alone would sample it.
Greedy output is the target's own greedy output, token for token.

Draft sources: another checkpoint with the same tokenizer ("draft=PATH"), the target quantized ("self-int8";
"self-q4": 4-bit matrices, 8-bit head), the target's first N layers plus its output head ("layers:N", early
exit), and n-gram prompt lookup ("ngram": no model, propose what followed the last occurrence of the current
n-gram). The self-drafts (the target quantized or cut short) share the target's KV cache; another checkpoint
keeps its own.
Left out: tree drafts with several candidates per position (SpecInfer, Medusa), speculation across a batch,
adaptive k. Only `cache.truncate` is needed for rollback, so any cache with that contract works.

Vocabulary: k drafted tokens per round, V vocabulary size, n committed tokens (prompt + generated).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .quant import QuantizedWeight, quantize
from .sampling import SamplingParams, apply_repetition_penalty, draw, probabilities, sample

DRAFT_SPECS = "draft=PATH | self-int8 | self-q4 | layers:N | ngram"


# --- the accept/resample rule: pure functions ----------------------------------------------------------------


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: accept drafted tokens while they equal the target's argmax.

    draft: the k drafted ids; target_argmax: k+1 ids, the target's choice at each drafted position and one
    after the last. -> (n_accepted, next_token): the target's own token at the first mismatch, or the bonus
    token target_argmax[k] if all k matched. The output is exactly what plain greedy decoding produces.
    """
    for i, x in enumerate(draft):
        if x != target_argmax[i]:
            return i, int(target_argmax[i])
    return len(draft), int(target_argmax[len(draft)])


def accept_or_resample(draft: Sequence[int], p: np.ndarray, q: np.ndarray | None,
                       rng: np.random.Generator) -> tuple[int, int]:
    """The speculative sampling rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    draft: k ids, drafted token i drawn from q[i]; p: [k+1, V] the target's distributions at each drafted
    position and one after; q: [k, V] the draft's distributions, or None for a point-mass draft (n-gram
    lookup: q = 1 on the drafted token). -> (n_accepted, next_token).

    Each token that comes out is distributed exactly as a draw from p, whatever q is: a bad draft costs speed,
    never correctness.
    """
    k = len(draft)
    for i, x in enumerate(draft):
        if q is None:
            # Point mass: min(1, p(x)/1) = p(x) to accept, and the residual norm(max(0, p - onehot(x))) is p
            # without x. Drawing y ~ p and accepting iff y == x does both at once: y is the resample otherwise.
            y = draw(p[i], rng)
            if y != x:
                return i, y
            continue
        # accept x with probability min(1, p(x) / q(x)); q(x) > 0 since x was drawn from q
        if rng.random() * q[i, x] < p[i, x]:
            continue
        # first rejection: resample from the residual norm(max(0, p - q)), the mass p has and q lacks
        residual = np.maximum(p[i] - q[i], 0.0)                           # [V]
        if residual.sum() <= 0.0:      # p == q up to rounding: rejection had probability ~0; p is then right
            residual = p[i]
        return i, draw(residual / residual.sum(), rng)
    return k, draw(p[k], rng)          # all k accepted: a bonus token from the target's last row, for free


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023, Theorem 3.8: (1 - alpha^(k+1)) / ((1 - alpha)(k*c + 1)).

    alpha: probability a drafted token is accepted (assumed independent per token); k: tokens drafted per
    round; c: cost of one draft step / cost of one target step. The numerator over (1 - alpha) is the expected
    number of tokens a round yields (accepted + the one the target adds); a round costs k draft steps and one
    target pass, assumed to cost one plain decode step (true while decode is memory-bound).
    """
    tokens_per_round = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens_per_round / (k * c + 1.0)


# --- statistics ----------------------------------------------------------------------------------------------

@dataclass
class SpeculativeStats:
    source: str                       # the draft source, e.g. "self-q4"
    num_draft: int                    # k: tokens drafted per round (fewer near the end, or when n-gram finds less)
    rounds: int = 0                   # target verification passes that checked >= 1 drafted token
    plain_steps: int = 0              # target passes with nothing drafted (n-gram found no match; last token)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0                  # tokens produced by all target passes (accepted + one per pass)
    accepted_hist: list[int] = field(default_factory=list)   # [k+1]: rounds that accepted 0, 1, .., k tokens
    draft_prefill_s: float = 0.0      # the draft model's pass over the prompt (not part of any round)
    draft_s: float = 0.0              # proposing, all rounds
    verify_s: float = 0.0             # target passes + accept/resample, all rounds and plain steps
    measured_speedup: float | None = None   # decode tok/s vs plain decode; only the benchmark measures it

    def __post_init__(self):
        if not self.accepted_hist:
            self.accepted_hist = [0] * (self.num_draft + 1)

    @property
    def target_steps(self) -> int:
        return self.rounds + self.plain_steps

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        return self.emitted / self.target_steps if self.target_steps else 0.0

    @property
    def cost_ratio(self) -> float:
        """c: time to draft one token / time of one target pass (both measured in this run)."""
        if not self.drafted or not self.target_steps:
            return 0.0
        return (self.draft_s / self.drafted) / (self.verify_s / self.target_steps)

    @property
    def expected_speedup(self) -> float:
        return expected_speedup(self.alpha, self.num_draft, self.cost_ratio)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(target_steps=self.target_steps, alpha=self.alpha, tokens_per_target_step=self.tokens_per_target_step,
                 cost_ratio=self.cost_ratio, expected_speedup=self.expected_speedup)
        return d

    def _hist_text(self) -> str:
        """The accepted-length histogram; for a large k only its non-zero entries, as {length: rounds}."""
        hist = self.accepted_hist
        return str(hist) if len(hist) <= 17 else str({i: n for i, n in enumerate(hist) if n})

    def summary(self) -> str:
        s = (f"speculative {self.source} k={self.num_draft} | accepted {self.accepted}/{self.drafted} "
             f"(alpha {self.alpha:.2f}) | {self.tokens_per_target_step:.2f} tok/target step | "
             f"accepted lengths {self._hist_text()} | draft {self.draft_s * 1e3:.0f} ms verify "
             f"{self.verify_s * 1e3:.0f} ms (c {self.cost_ratio:.2f}) | expected {self.expected_speedup:.2f}x")
        if self.measured_speedup is not None:
            s += f" measured {self.measured_speedup:.2f}x"
        return s


# --- draft sources -------------------------------------------------------------------------------------------

def _pick(logits: np.ndarray, params: SamplingParams, rng, history) -> tuple[int, np.ndarray | None]:
    """The draft's choice from its logits ([V]), made with the same sampling settings as the target.
    -> (token, q): q is the [V] distribution it was drawn from, or None when greedy."""
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits)), None
    q = probabilities(logits, params)                                     # [V]
    return draw(q, rng), q


class ModelDraft:
    """A draft that is a transformer. A copy of the target (quantized, or its first layers: the self-drafts) has
    the target's cache geometry and shares its KV cache (`shares_cache`, as LayerSkip's and QSpec's self-drafts do):
    no second cache, no prefill of the prompt before the first token, no catch-up. Another checkpoint keeps a
    cache of its own."""

    point_mass = False

    def __init__(self, model, name: str, shares_cache: bool = False):
        self.model, self.name, self.shares_cache, self.cache = model, name, shares_cache, None

    def start(self, seq: list[int], max_seq_len: int, target_cache) -> None:
        """Before the first round, when the target's cache holds seq[0 .. n-2] (the prompt). A shared cache is
        ready as it is; an own cache is prefilled with the same positions."""
        if self.shares_cache:
            self.cache = target_cache
            return
        ctx = self.model.config.context_length
        if len(seq) - 1 > ctx:           # seq is the prompt and the first generated token
            raise ValueError(f"the draft model's context is {ctx} positions but the prompt has {len(seq) - 1} tokens: "
                             f"use a draft with a longer context, or a shorter prompt")
        # the draft's own cache stores K/V as the target's does (a paged sequence's dtype is its pool's)
        self.cache = self.model.new_cache(min(max_seq_len, ctx), target_cache.kv_dtype)
        if len(seq) > 1:
            self.model.prefill(seq[:-1], self.cache)

    def propose(self, seq: list[int], k: int, params: SamplingParams, rng) -> tuple[list[int], np.ndarray | None]:
        """Up to k tokens continuing `seq`, and their distributions q ([k, V], None when greedy)."""
        if not self.shares_cache:        # it feeds positions up to n+k-2 (see speculative_tokens)
            k = min(k, self.cache.max_seq_len - len(seq) + 1)
        if k <= 0:
            return [], None
        # The cache holds a prefix of seq. Feed what it lacks: seq[-1], the token the target added last round; an
        # own cache lacks two tokens after a round that accepted all k (d_k was drafted but never fed, then the
        # bonus).
        logits = self.model.forward(seq[self.cache.length:], self.cache, last_only=True)[0]   # [V]
        tokens, qs = [], []
        for i in range(k):
            x, q = _pick(logits, params, rng, seq + tokens)
            tokens.append(x)
            qs.append(q)
            if i < k - 1:                       # the last drafted token is never fed: nothing would read its logits
                logits = self.model.decode_step(x, self.cache)                              # [V]
        if self.shares_cache:                   # hand the target its cache back as it was: seq[0 .. n-2]; its
            self.cache.truncate(len(seq) - 1)   # pass recomputes positions n-1 .. exactly
        return tokens, (None if params.greedy else np.stack(qs))                            # [k, V]

    def rollback(self, n_valid: int) -> None:
        """Keep the first n_valid positions (those that agree with the committed sequence)."""
        if not self.shares_cache:               # a shared cache is the target's, cut by the caller
            self.cache.truncate(min(self.cache.length, n_valid))


class NgramDraft:
    """Prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM's n-gram proposer): find the most
    recent earlier occurrence of the last n tokens (n = max_n down to min_n) and propose what followed it.
    Costs no model pass; wins when the output copies the input (edits, summaries with quotes, code)."""

    point_mass = True
    model = None

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.name, self.max_n, self.min_n = "ngram", max_n, min_n

    def start(self, seq: list[int], max_seq_len: int, target_cache) -> None:
        pass                                 # no state: every proposal is a fresh search of seq

    def propose(self, seq: list[int], k: int, params: SamplingParams, rng) -> tuple[list[int], None]:
        s = np.asarray(seq)                                               # [n]
        for n in range(min(self.max_n, len(s) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(s[:-1], n)   # [n_tokens - n, n]: all earlier n-grams
            hits = np.flatnonzero((windows == s[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n                                 # the token after the latest match
                return [int(t) for t in s[start:start + k]], None
        return [], None

    def rollback(self, n_valid: int) -> None:
        pass


def early_exit(target, n_layers: int):
    """The target's first n_layers blocks plus its final norm and output head, sharing the weights (no copy)."""
    if not 1 <= n_layers < target.config.n_layers:
        raise ValueError(f"layers:N needs 1 <= N < {target.config.n_layers} (the target's layers), got {n_layers}")
    draft = copy.copy(target)
    draft.layers = target.layers[:n_layers]
    draft.config = dataclasses.replace(target.config, n_layers=n_layers)   # its cache gets n_layers layers
    return draft


# The format of a self-draft's output head (and embedding table), by the format of its matrices: the head picks the
# token, so a 4-bit one costs acceptance; 8 bits, as in llama.cpp's 4-bit mixes and the default model's own file
# (docs/design/kernels.md, "Tried and not kept").
DRAFT_HEAD_FORMAT = {"int8": "int8", "q4_1": "int8-block"}


def quantized_copy(target, fmt: str, activations: str = "int8"):
    """The target with every matrix quantized to `fmt` and its output head to DRAFT_HEAD_FORMAT[fmt]:
    self-speculation's draft. Norms stay float32, as in weights.quantize_weights; a tied head stays tied. The
    draft multiplies int8 activations by default (quant.py): that makes it faster, and its small errors cannot
    change the output, which the target's verification decides."""
    def q(w, to=fmt):
        if w is None:
            return None
        return quantize(w.dequantize() if isinstance(w, QuantizedWeight) else w, to)

    head_fmt = DRAFT_HEAD_FORMAT.get(fmt, fmt)
    draft = copy.copy(target)
    draft.layers = [dataclasses.replace(layer, wqkv=q(layer.wqkv), wo=q(layer.wo), w_in=q(layer.w_in),
                                        w_out=q(layer.w_out)) for layer in target.layers]
    draft.tok_embed = q(target.tok_embed, head_fmt)
    draft.lm_head = draft.tok_embed if target.tied_head else q(target.lm_head, head_fmt)
    draft.quant = fmt
    draft.activations = activations
    draft.backend = target.backend       # compiles the draft's kernels now (its formats), not in its first step
    return draft


def make_draft(target, spec) -> ModelDraft | NgramDraft:
    """A draft source from its CLI spelling (see DRAFT_SPECS), or a draft object passed through as is
    (build it once with make_draft and reuse it: quantizing a self-draft takes seconds)."""
    if not isinstance(spec, str):
        return spec
    if spec == "ngram":
        return NgramDraft()
    if spec in ("self-int8", "self-q4"):
        return ModelDraft(quantized_copy(target, "int8" if spec == "self-int8" else "q4_1"), spec, shares_cache=True)
    if spec.startswith("layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad draft spec {spec!r}: layers:N needs an integer N") from None
        return ModelDraft(early_exit(target, n), spec, shares_cache=True)
    if spec.startswith("draft="):
        from . import load
        draft = load(spec.split("=", 1)[1], backend=target.backend)
        t, d = target.tokenizer, draft.tokenizer
        if draft.config.vocab_size != target.config.vocab_size or (
                t is not None and d is not None and
                any(t.id_to_bytes(i) != d.id_to_bytes(i) for i in range(target.config.vocab_size))):
            raise ValueError("the draft model's vocabulary differs from the target's: drafted ids would mean "
                             "other tokens. Use a draft from the same model family (same tokenizer).")
        return ModelDraft(draft, spec)
    raise ValueError(f"unknown draft source {spec!r}; choose one of: {DRAFT_SPECS}")


# --- the decoding loop ---------------------------------------------------------------------------------------

def _target_choices(logits: np.ndarray, params: SamplingParams, seq: list[int], draft: list[int]):
    """What the target wants at each of the k+1 verified positions, with the repetition penalty seeing the
    drafted tokens before each one (as plain decoding would). -> argmax ids [k+1] (greedy) or p [k+1, V]."""
    rows = [apply_repetition_penalty(logits[i], seq + draft[:i], params.repetition_penalty)
            for i in range(len(logits))]                                  # k+1 x [V]
    if params.greedy:
        return [int(np.argmax(r)) for r in rows]
    return np.stack([probabilities(r, params) for r in rows])             # [k+1, V]


def speculative_tokens(target, draft, prompt_ids: Sequence[int], cache, logits: np.ndarray,
                       params: SamplingParams, rng: np.random.Generator, num_draft: int,
                       max_new_tokens: int, stats: SpeculativeStats) -> Iterator[int]:
    """Yield generated token ids, a round of up to num_draft+1 at a time. The caller has prefilled `cache`
    with the prompt (`logits`: [V], the last prompt position's) and stops iterating when it has enough.

    Position bookkeeping. seq holds the n committed tokens. Invariant at the top of each round: the target's
    cache (and a draft's own cache) holds K/V for seq[0 .. n-2]; the last token seq[n-1] was sampled but no
    model has seen it yet.
      draft:   feeds seq[n-1], d1 .. d(k-1) (positions n-1 .. n+k-2) and proposes d1 .. dk. A self-draft
               does this in the target's cache and then cuts it back to n-1 positions: what it wrote there was
               its own approximation of the target's K/V, and the target's pass writes the real ones.
      target:  one pass over [seq[n-1], d1, .., dk] at positions n-1 .. n+k-1 -> k+1 rows of logits;
               row i is the target's distribution for the token at position n+i: row 0 checks d1, row k-1
               checks dk, row k gives the bonus token. Its cache now holds n+k positions.
      accept a of the k drafts, then add one token t (the resample at the first rejection, or the bonus):
               seq becomes seq + d1..da + t, n' = n + a + 1 tokens.
      rollback: the target's positions 0 .. n+a-1 hold seq'[0 .. n'-2] (the last prompt/committed token and
               the a accepted drafts); position n+a held d(a+1) (rejected) or nothing (a = k): truncate to
               n + a = n' - 1, and the invariant holds again. A draft with its own cache holds n+k-1
               positions: truncate to n + a if a < k; if a == k it holds only n+k-1 = n'-2 and catches up
               next round by feeding dk and t together.
    Example: a 10-token prompt and the first sampled token give n = 11; the caches hold positions 0 .. 9.
    With k = 4 the draft fills positions 10 .. 13 (it feeds seq[10], d1, d2, d3), the target 10 .. 14. If a = 2,
    seq gets d1, d2, t (n' = 14) and the caches are cut to 13 positions: 0 .. 12 = prompt, seq[10], d1, d2.
    """
    seq = list(prompt_ids)
    first = sample(logits, params, rng, seq)         # the first token comes from the prefill, as in plain decode
    seq.append(first)
    ctx = target.config.context_length
    t0 = time.perf_counter()                         # the draft's prefill belongs to the prefill phase (TTFT),
    draft.start(seq, min(ctx, len(prompt_ids) + max_new_tokens), cache)   # as in vLLM: before the first token
    stats.draft_prefill_s += time.perf_counter() - t0
    yield first
    budget = max_new_tokens - 1                      # tokens still wanted after the first
    while budget > 0:
        n = len(seq)
        # never draft past the budget (a round yields up to k+1 tokens), nor past the context (the target
        # pass writes positions n-1 .. n+k-1). The cache was sized for prompt + max_new_tokens, so this fits.
        k = min(num_draft, budget - 1, ctx - n)
        t0 = time.perf_counter()
        drafted, q = draft.propose(seq, k, params, rng) if k > 0 else ([], None)
        t1 = time.perf_counter()
        target_logits = target.forward([seq[-1]] + drafted, cache)       # [k+1, V], positions n-1 .. n+k-1
        want = _target_choices(target_logits, params, seq, drafted)
        if params.greedy:
            a, t = accept_greedy(drafted, want)
        else:
            a, t = accept_or_resample(drafted, want, None if draft.point_mass else q, rng)
        cache.truncate(n + a)                        # drop the K/V of rejected drafts (see the docstring)
        draft.rollback(n + a)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        if drafted:
            stats.rounds += 1
            stats.drafted += len(drafted)
            stats.accepted += a
            stats.accepted_hist[a] += 1
        else:
            stats.plain_steps += 1
        stats.emitted += a + 1
        new = drafted[:a] + [t]
        seq += new
        budget -= len(new)
        yield from new


@dataclass
class SpeculativeResult:
    token_ids: list[int]              # generated ids (no stopping at end-of-sequence: exactly max_new_tokens)
    stats: SpeculativeStats
    cache: object                     # the target's cache afterwards: the prompt and all tokens but the last
    prefill_s: float                  # the target's prefill and the draft's (stats.draft_prefill_s)
    decode_s: float                   # after the first token


def speculative_generate(target, prompt_ids: Sequence[int], draft="ngram", num_draft: int = 4,
                         max_new_tokens: int = 32, params: SamplingParams = SamplingParams(),
                         rng: np.random.Generator | None = None, kv_dtype: str = "float32") -> SpeculativeResult:
    """Speculative decoding as one function: prefill, then rounds of draft + verify, exactly max_new_tokens
    tokens (end-of-sequence does not stop it; `tinyllm.generate(..., speculative=...)` handles stopping).
    kv_dtype: how the caches store K and V (kv_cache.py)."""
    if not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an integer >= 1, got {num_draft!r}")
    draft = make_draft(target, draft)
    rng = params.make_rng() if rng is None else rng
    ids = [int(i) for i in prompt_ids]
    cache = target.new_cache(len(ids) + max_new_tokens, kv_dtype)
    stats = SpeculativeStats(source=draft.name, num_draft=num_draft)
    t0 = time.perf_counter()
    logits = target.prefill(ids, cache)                                   # [V]
    t1 = time.perf_counter()
    out = []
    for tok in speculative_tokens(target, draft, ids, cache, logits, params, rng, num_draft, max_new_tokens, stats):
        out.append(tok)
        if len(out) == 1:
            t2 = time.perf_counter()
        if len(out) >= max_new_tokens:
            break
    return SpeculativeResult(out, stats, cache, prefill_s=t1 - t0 + stats.draft_prefill_s,
                             decode_s=time.perf_counter() - t2)
