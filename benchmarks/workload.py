"""Synthetic serving workloads with a fixed seed: Poisson arrivals, prompt and output lengths from distributions.

    reqs = make_workload(tokenizer, n=32, rate=2.0, prompt_len=(16, 128), output="lognormal", seed=0)

Prompts are windows of real text (benchmarks/data/eval_text.txt), so the model sees ordinary tokens; output
lengths are enforced with max_tokens and no stop token (vLLM's `ignore_eos`), so every policy does the same work.
A workload can also be read from a JSON file of {"arrival_s", "prompt_tokens", "output_tokens"} objects.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parent / "data" / "eval_text.txt"


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_s: float          # offset from the start of the run
    prompt_ids: list[int]
    output_tokens: int


def output_lengths(rng: np.random.Generator, n: int, kind: str, lo: int, hi: int, sigma: float = 0.9) -> np.ndarray:
    """'uniform' in [lo, hi]; 'lognormal': most short, a long tail (what chat traffic looks like), clipped.
    sigma is the spread of log(length): the 90th percentile is exp(2.56 sigma) times the 10th (10x at 0.9, 28x at
    1.3), before clipping."""
    if kind == "uniform":
        return rng.integers(lo, hi + 1, n)
    if kind == "lognormal":
        x = rng.lognormal(mean=np.log(np.sqrt(lo * hi)), sigma=sigma, size=n)
        return np.clip(np.round(x), lo, hi).astype(int)
    raise ValueError(f"unknown output length distribution {kind!r}; choose uniform or lognormal")


def make_workload(tokenizer, n: int, rate: float | None, prompt_len=(16, 128), output="lognormal",
                  output_len=(4, 128), seed: int = 0, sigma: float = 0.9) -> list[WorkloadRequest]:
    """n requests; inter-arrival gaps ~ Exponential(1/rate) (a Poisson process), or all at t=0 if rate is None."""
    rng = np.random.default_rng(seed)
    text_ids = tokenizer.encode(TEXT.read_text())
    arrivals = np.zeros(n) if rate is None else np.cumsum(rng.exponential(1.0 / rate, n))
    outs = output_lengths(rng, n, output, *output_len, sigma=sigma)
    reqs = []
    for i in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, len(text_ids) - p))
        reqs.append(WorkloadRequest(f"r{i}", float(arrivals[i]), text_ids[start:start + p], int(outs[i])))
    return reqs


def load_workload(path, tokenizer, seed: int = 0) -> list[WorkloadRequest]:
    """Lengths and arrival times from a JSON file; prompt tokens are drawn from the text as above."""
    rng = np.random.default_rng(seed)
    text_ids = tokenizer.encode(TEXT.read_text())
    reqs = []
    for i, r in enumerate(json.loads(Path(path).read_text())):
        start = int(rng.integers(0, len(text_ids) - r["prompt_tokens"]))
        reqs.append(WorkloadRequest(f"r{i}", float(r["arrival_s"]), text_ids[start:start + r["prompt_tokens"]],
                                    int(r["output_tokens"])))
    return reqs
