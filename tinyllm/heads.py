"""Head detectors: which attention heads do a recognisable job, scored from their attention on a made-up sequence.

    scores = heads.head_scores(model)          # {"previous_token": [L, H], "induction": ..., ...}, each in 0..1
    scores["induction"].max()                  # the best induction head's score

The sequence is n random tokens (distinct, no control tokens) repeated once: A B C ... A B C ... Then, per head,
a score is the attention mass it puts where a head of that kind looks, averaged over the positions that have
such a place (TransformerLens's head detector is the anchor; it divides by all attention instead):
    previous_token   position t looks at t-1
    duplicate_token  t looks at the earlier positions holding the same token (the first copy, from the second)
    induction        t looks at the position just after an earlier copy of its token: what came next last time
                     (Olsson et al. 2022); together with a previous-token head it completes A B ... A -> B
    sink             t looks at position 0 (Xiao et al. 2023: heads park the attention they do not need there)
Left out: other kinds (copying / OV-circuit scores, successor heads), several sequences averaged.
"""
from __future__ import annotations

import numpy as np

from .trace import Trace

KINDS = ("previous_token", "induction", "duplicate_token", "sink")


def repeated_random_tokens(model, n: int = 50, seed: int = 0) -> list[int]:
    """n distinct random ids drawn from the vocabulary (control and unreachable tokens left out), then the same n
    again. -> 2n ids"""
    tok = model.tokenizer
    excluded = set() if tok is None else set(tok.special_ids or ()) | set(tok.unreachable_ids)
    candidates = np.array([i for i in range(model.config.vocab_size) if i not in excluded])   # [V']
    if not 2 <= n <= len(candidates) or 2 * n > model.config.context_length:
        raise ValueError(f"n={n} random tokens repeated do not fit: need 2 <= n <= {len(candidates)} (tokens to "
                         f"draw from) and 2n <= the context length {model.config.context_length}")
    first = np.random.default_rng(seed).choice(candidates, size=n, replace=False)           # [n]
    return [int(i) for i in first] * 2


def where_each_kind_looks(ids) -> dict[str, np.ndarray]:
    """For a sequence of ids, per kind a [S, S] bool matrix: row t marks the positions a head of that kind reads."""
    ids = np.asarray(ids)
    S = len(ids)
    earlier = np.tril(np.ones((S, S), dtype=bool), k=-1)                    # [S, S]: j < t
    same = ids[:, None] == ids[None, :]                                      # [S, S]
    after_same = np.zeros((S, S), dtype=bool)
    after_same[:, 1:] = ids[:, None] == ids[None, :-1]                       # [S, S]: ids[j-1] == ids[t]
    sink = np.zeros((S, S), dtype=bool)
    sink[1:, 0] = True                                                       # (position 0 has no choice)
    return {"previous_token": np.eye(S, k=-1, dtype=bool), "induction": after_same & earlier,
            "duplicate_token": same & earlier, "sink": sink}


def score(attention: np.ndarray, looks: np.ndarray) -> np.ndarray:
    """attention [H, S, S] and a kind's [S, S] pattern -> [H]: per head, the attention mass on the marked positions,
    averaged over the rows that mark any."""
    rows = looks.any(axis=1)                                                 # [S]
    mass = (attention * looks).sum(axis=-1)                                  # [H, S]
    return mass[:, rows].mean(axis=-1)                                       # [H]


def head_scores(model, n: int = 50, seed: int = 0) -> dict[str, np.ndarray]:
    """Every head's score of each kind on n random tokens repeated (one no-cache forward, traced).
    -> {kind: [L, H] float array in 0..1}"""
    ids = repeated_random_tokens(model, n, seed)
    trace = Trace(max_positions=len(ids))
    model.logits(ids, trace=trace)
    looks = where_each_kind_looks(ids)
    return {kind: np.stack([score(trace.attention(layer), looks[kind]) for layer in trace.layers])   # [L, H]
            for kind in KINDS}


def top_heads(scores: dict[str, np.ndarray], k: int = 3) -> dict[str, list[tuple[int, int, float]]]:
    """The k best (layer, head, score) of each kind."""
    out = {}
    for kind, s in scores.items():
        flat = np.argsort(-s, axis=None, kind="stable")[:k]
        out[kind] = [(int(i // s.shape[1]), int(i % s.shape[1]), float(s.flat[i])) for i in flat]
    return out
