"""Decode attention's two inner loops, over n cached positions of one KV head for the query heads that share it:

    score_rows(q, t, h0, G, k, ks, s0, n, kvh, scale, scores, i0)
        scores[t, h, i0+i] = scale * q[t, h] . K[s0+i, kvh]
    add_rows(acc, t, h0, G, p, i0, n, v, vs, s0, kvh)
        acc[t, h] += sum over i of p[t, h, i0+i] * V[s0+i, kvh]
    for i < n and the G query heads h = h0 .. h0+G-1

K and V are in their stored format (kv_formats.py: float32, float16 bits, or int8 with a float16 scale per group of
values). `score_rows_reference` and `add_rows_reference` below are the plain loops: the readable version, what runs
with NUMBA_DISABLE_JIT=1, and what the tests hold the fast one to (over int8 with q in int8 blocks, as here). The
fast one is LLVM IR (kv_rows_ir.py), with code written out for the usual head sizes.

Which of them a kernel contains is decided when it compiles, by its last argument `shape`: a tuple from
`row_shape` whose type (how many floats, how many ints) carries the head size and the query heads per KV head, or
() for the generic path. So a model compiles exactly the one body it runs (every variant in one kernel cost its
first start seconds of compiling); rows that turn out not to match it get NaN scores and sums: loudly wrong.
"""
from __future__ import annotations

import numpy as np
from numba import config

from .intdot import USE_VNNI
from .kv_formats import F16C, int8_levels, kv_value
from .kv_rows_ir import HEAD_SIZES, INT8_GROUP, LANES, row_intrinsics


def row_shape(head_size: int, heads_per_kv: int, int8_group: int | None) -> tuple:
    """The kernels' `shape` argument for heads of head_size values, heads_per_kv query heads per KV head and int8
    groups of int8_group values (None: a float format): (0.0,) * (head_size / 16) + (0,) * heads_per_kv for the
    written-out head sizes, () for the generic path. Only its type matters (how many floats, how many ints); it is
    one flat tuple because Numba's parallel loops do not pass nested ones on."""
    if head_size not in HEAD_SIZES or int8_group not in (None, INT8_GROUP):
        return ()
    return (0.0,) * (head_size // LANES) + (0,) * heads_per_kv


def row_shape_of(k, ks, heads_per_kv: int) -> tuple:
    """row_shape for cached values k [..., Dh] with int8 scales ks (None for a float format)."""
    if not k.flags.c_contiguous:
        return ()
    return row_shape(k.shape[-1], heads_per_kv, None if ks is None else k.shape[-1] // ks.shape[-1])


def score_rows_reference(q, t, h0, G, k, ks, s0, n, kvh, scale, scores, i0, shape=()):
    """score_rows as plain loops."""
    for h in range(h0, h0 + G):
        if ks is None:                          # one group of all the values, times scale
            row, group, factors = q[t, h].copy(), q.shape[2], np.full(1, np.float32(scale))
        else:                                   # an int8 cache: q in int8 levels per group, as the IR's
            group = q.shape[2] // ks.shape[2]
            row, factors = int8_levels(q[t, h], group, np.float32(scale))
        for i in range(n):
            score = np.float32(0.0)
            for b in range(factors.shape[0]):
                total = np.float32(0.0)
                for j in range(b * group, (b + 1) * group):
                    total += row[j] * kv_value(k, ks, s0 + i, kvh, j)
                score += total * factors[b]
            scores[t, h, i0 + i] = score


def add_rows_reference(acc, t, h0, G, p, i0, n, v, vs, s0, kvh, shape=()):
    """add_rows as plain loops."""
    for h in range(h0, h0 + G):
        for i in range(n):
            for j in range(acc.shape[2]):
                acc[t, h, j] += p[t, h, i0 + i] * kv_value(v, vs, s0 + i, kvh, j)


if config.DISABLE_JIT:                   # stepping through as Python: the plain loops
    score_rows, add_rows = score_rows_reference, add_rows_reference
else:
    score_rows, add_rows = row_intrinsics(F16C, USE_VNNI)
