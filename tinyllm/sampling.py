"""Turning one row of logits into one token id.

Sampling only reshapes the distribution the model produced; it never changes the model, the cache or the
cost of a step. Order of operations (as in Hugging Face transformers):

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw

Temperature 0 means greedy: the argmax (after the repetition penalty); so does any temperature below
GREEDY_BELOW (as in vLLM), where dividing the logits by it would overflow to inf and the draw would be NaN
garbage. Randomness comes only from an explicit `np.random.Generator`, so a seed reproduces a run exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


GREEDY_BELOW = 1e-5   # a temperature under this samples the argmax: the distribution is one token anyway


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 (< GREEDY_BELOW) = greedy; 1 = the model's distribution; >1 flatter
    top_k: int = 0                    # keep the k most likely tokens (0 = off)
    top_p: float = 1.0                # keep the smallest set whose probability reaches p (1 = off)
    min_p: float = 0.0                # drop tokens below min_p * p(top token) (0 = off)
    repetition_penalty: float = 1.0   # >1 discourages tokens already in the context (1 = off)
    seed: int | None = None

    def __post_init__(self):
        def bad(name, value, rule):
            raise ValueError(f"invalid {name}={value!r}: must be {rule}")

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", self.top_p, "in (0, 1] (1 = off)")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad("min_p", self.min_p, "in [0, 1] (0 = off)")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            bad("seed", self.seed, "a non-negative integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def make_rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def apply_repetition_penalty(logits: np.ndarray, history, penalty: float) -> np.ndarray:
    """CTRL's penalty (Keskar et al. 2019): for each token already seen, divide a positive logit by
    `penalty` and multiply a negative one, so the token always becomes less likely. -> new [V] array"""
    if penalty == 1.0 or len(history) == 0:
        return logits
    out = logits.copy()
    seen = np.unique(np.asarray(history, dtype=np.int64))
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def probabilities(logits: np.ndarray, params: SamplingParams, stages: list | None = None) -> np.ndarray:
    """The distribution sampling draws from, after temperature, top-k, top-p and min-p. [V] -> [V] (sums to 1)
    stages: if a list, (stage name, the distribution after it) is appended for each stage that is on."""
    if params.greedy:                                             # the limit as temperature -> 0: one token
        p = np.zeros(len(logits))
        p[np.argmax(logits)] = 1.0
        return p
    z = logits.astype(np.float64) / params.temperature            # [V]
    z -= z.max()
    if stages is not None:
        stages.append(("temperature", _normalized(np.exp(z))))
    if 0 < params.top_k < len(z):                                 # keep the k largest
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = _normalized(np.exp(z))
    if stages is not None and 0 < params.top_k < len(z):
        stages.append(("top-k", p))
    if params.top_p < 1.0:                                        # nucleus: smallest prefix reaching top_p
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = np.searchsorted(cum, params.top_p) + 1             # tokens needed to reach the mass
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = _normalized(np.where(mask, p, 0.0))
        if stages is not None:
            stages.append(("top-p", p))
    if params.min_p > 0.0:                                        # relative floor under the top token
        p = _normalized(np.where(p >= params.min_p * p.max(), p, 0.0))
        if stages is not None:
            stages.append(("min-p", p))
    return p


def _normalized(p: np.ndarray) -> np.ndarray:
    return p / p.sum()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the distribution p ([V]) by inverse CDF: a single uniform number per draw."""
    cdf = np.cumsum(p)                                            # [V]
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of the model's own distribution (no temperature or truncation). [V] -> [V] float64"""
    z = logits.astype(np.float64)                                 # [V]
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history=(),
           stages: list | None = None) -> int:
    """Pick the next token id from `logits` ([V]); `history` is the ids so far (for the repetition penalty).
    stages: if a list, every stage's distribution is appended to it, in order, as (name, p [V]): "raw" (the
    model's softmax), "repetition penalty", then those of `probabilities`, or "greedy" (all mass on the argmax);
    the last one is the distribution the token is drawn from (trace.py keeps their top entries)."""
    if not np.isfinite(logits.max()):             # NaN and +inf propagate to the max: one cheap reduction
        raise ValueError("the model's logits hold NaN or infinity (its weights overflow float32): the model file "
                         "is corrupt or not made for this engine; no token can be chosen")
    if stages is not None:
        stages.append(("raw", np.exp(log_softmax(logits))))
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if stages is not None and params.repetition_penalty != 1.0:
        stages.append(("repetition penalty", np.exp(log_softmax(logits))))
    if params.greedy:
        token = int(np.argmax(logits))
        if stages is not None:
            stages.append(("greedy", np.eye(1, len(logits), token)[0]))
        return token
    return draw(probabilities(logits, params, stages), rng)
