"""Attention kernels: a few new tokens against a contiguous cache, and a batch of one-token queries against a paged
cache (prompt chunks: prefill_attention.py). Each is the compiled twin of ops.attention or ops.paged_attention.

Grouped-query attention throughout: query head h reads KV head h // G, so a K/V row read once serves the G query
heads of its group (the other query tokens of a call find it in the cache); K and V are never copied or repeated.

K and V arrive in the cache's stored format as (values, scales) pairs (kv_formats.py: float32, float16 bits, or
int8 with a scale per 32 values) and no dequantized copy of the cache is made: kv_rows.py's `score_rows` and
`add_rows` (q . k and the weighted sum of v over a run of cached rows) widen each stored row once for the G query
heads of its KV head.
"""
from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from .kv_rows import add_rows, score_rows
from .numerics import PARALLEL, SERIAL, exp32, ordered_sum, softmax_in_place

ATTN_CHUNK = 64       # about this many cache positions per task in decode attention (a pair of tasks per 128)
ATTN_TASKS = 16       # most tasks: past 1,024 positions the chunks grow, so the serial merge stays small
ATTN_ONE_TASK = 16    # fewer positions than this: one task
ROWS_AT_ONCE = 32  # cached positions per pass of kv_rows: their rows for every KV head come from memory once


@njit(**PARALLEL)
def decode_attention(q, k, ks, v, vs, start, out, shape):
    """q [T, H, Dh]: T new tokens (1 in a decode step, k+1 in a speculative verification) at positions start ..
    start+T-1; k, v [S, KVH, Dh] (the cache incl. these tokens, S = start + T) with their scales ks, vs (None for
    float formats) -> out [T, H, Dh]. Causal: token t sees positions 0 .. start+t. shape: kv_rows.row_shape
    of the cache.

    Split over positions ("flash-decoding", Dao et al. 2023), so both cores work even with 3 KV heads: each task
    takes a chunk of positions (position_chunks) and computes, per query token and head, the scores, their
    running max m, the sum l of their exponentials and the weighted sum of V; the chunks are merged at the end by
    rescaling with exp(m_chunk - m_global). A task reads its K rows, then its V rows, front to back, ROWS_AT_ONCE
    positions at a time (each KV head's part of them in turn, kv_rows.py).
    """
    T, H, Dh = q.shape
    S = k.shape[0]
    chunk, n_chunks = position_chunks(S)
    chunk_max = np.empty((n_chunks, T, H), dtype=np.float32)    # m per chunk
    chunk_sum = np.empty((n_chunks, T, H), dtype=np.float32)    # l per chunk
    chunk_out = np.empty((n_chunks, T, H, Dh), dtype=np.float32)
    for c in prange(n_chunks):
        attend_chunk(q, k, ks, v, vs, start, c * chunk, min(S, (c + 1) * chunk), chunk_max[c], chunk_sum[c],
                     chunk_out[c], shape)
    merge_chunks(chunk_max, chunk_sum, chunk_out, out, 0, H)


def _renamed(f, name: str):
    """A copy of the Python function f named `name` (Numba names a compiled function, and its disk cache file, by
    the qualified name: the same function compiled twice needs two)."""
    copy = types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    copy.__qualname__, copy.__doc__ = name, f.__doc__
    return copy


# decode_attention's chunks on one thread: what a first run calls while the parallel one compiles in the background
# (its parallel loop takes 2-3 s of a 4 s compile: kernels/warmup.py)
decode_attention_one_thread = njit(**SERIAL)(_renamed(getattr(decode_attention, "py_func", decode_attention),
                                                     "decode_attention_one_thread"))   # (NUMBA_DISABLE_JIT=1: a function)


@njit(fastmath=True, cache=True, inline="always")
def position_chunks(S):
    """decode_attention's split of S positions -> (positions per chunk, how many chunks): an even number of
    chunks of nearly equal size (about ATTN_CHUNK), so that two threads get equal shares (a context of 40 in one
    chunk of 64 left the other core waiting), whatever the thread count (the results do not depend on it)."""
    n = 1 if S < ATTN_ONE_TASK else min(ATTN_TASKS, 2 * ((S + 2 * ATTN_CHUNK - 1) // (2 * ATTN_CHUNK)))
    chunk = (S + n - 1) // n
    return chunk, (S + chunk - 1) // chunk


@njit(**SERIAL)
def merge_chunks(chunk_max, chunk_sum, chunk_out, out, h0, h1):
    """out[:, h0:h1] from the chunks' statistics (decode_attention): each head's chunks rescaled by
    exp(m_chunk - m_global) and summed, then divided by the rescaled sum of the exponentials."""
    n_chunks, T, _, Dh = chunk_out.shape
    for t in range(T):
        for h in range(h0, h1):
            m = chunk_max[0, t, h]
            for c in range(1, n_chunks):
                m = max(m, chunk_max[c, t, h])
            total = np.float32(0.0)
            for j in range(Dh):
                out[t, h, j] = 0.0
            for c in range(n_chunks):
                w = exp32(chunk_max[c, t, h] - m)
                total += w * chunk_sum[c, t, h]
                for j in range(Dh):
                    out[t, h, j] += w * chunk_out[c, t, h, j]
            inv = np.float32(1.0) / total
            for j in range(Dh):
                out[t, h, j] *= inv


@njit(**SERIAL)
def attend_chunk(q, k, ks, v, vs, start, s0, s1, m_out, l_out, acc, shape):
    """decode_attention's task: the T tokens of q against positions s0 .. s1-1 -> per token and head the max m_out
    [T, H] and sum l_out [T, H] of the exponentiated scores, and acc [T, H, Dh] their weighted sum of v rows.
    (A function of its own, so that the parallel loop stays small: Numba compiles a large one slowly.)"""
    T, H, Dh = q.shape
    KVH = k.shape[1]
    G = H // KVH
    scale = np.float32(1.0 / np.sqrt(Dh))
    scores = np.empty((T, H, s1 - s0), dtype=np.float32)
    for t in range(T):                                           # q . k
        n = min(s1, start + t + 1) - s0                          # how many of the positions token t sees
        for first in range(0, n, ROWS_AT_ONCE):                  # a few rows at a time: read from memory once
            rows = min(ROWS_AT_ONCE, n - first)
            for kvh in range(KVH):                               # its G query heads kvh*G .. kvh*G+G-1
                score_rows(q, t, kvh * G, G, k, ks, s0 + first, rows, kvh, scale, scores, first, shape)
    for t in range(T):                                           # this chunk's softmax statistics
        n = min(s1, start + t + 1) - s0
        for h in range(H):
            for j in range(Dh):
                acc[t, h, j] = 0.0
            if n <= 0:                                           # none: a chunk that adds nothing in the merge
                m_out[t, h], l_out[t, h] = np.float32(-1e30), np.float32(0.0)
                continue
            m = scores[t, h, 0]
            for i in range(1, n):
                m = max(m, scores[t, h, i])
            for i in range(n):
                scores[t, h, i] = exp32(scores[t, h, i] - m)
            m_out[t, h], l_out[t, h] = m, ordered_sum(scores[t, h], n)
    for t in range(T):                                           # weighted sum of v
        n = min(s1, start + t + 1) - s0
        for first in range(0, n, ROWS_AT_ONCE):
            rows = min(ROWS_AT_ONCE, n - first)
            for kvh in range(KVH):
                add_rows(acc, t, kvh * G, G, scores, first, rows, v, vs, s0 + first, kvh, shape)


@njit(**PARALLEL)
def paged_decode_attention(q, k_slots, ks, v_slots, vs, block_size, block_tables, context_lens, out, shape):
    """PagedAttention (Kwon et al. 2023) for a batch of one-token queries: q [B, H, Dh]; k_slots, v_slots
    [NB*BS, KVH, Dh] (one layer of the pool, its blocks end to end) with their scales ks, vs (None for float
    formats); block_tables [B, max blocks] int32; context_lens [B] int32 -> out [B, H, Dh]. One task per
    sequence; no history is gathered into a copy. shape: kv_rows.row_shape of the cache."""
    for b in prange(q.shape[0]):
        _paged_attend_one(q[b:b + 1], k_slots, ks, v_slots, vs, block_size, block_tables[b], context_lens[b],
                          out[b:b + 1], shape)


@njit(**SERIAL)
def _paged_attend_one(q, k, ks, v, vs, BS, table, S, out, shape):
    """One sequence: q [1, H, Dh] against its S cached positions, found through its block table -> out [1, H, Dh].
    Position s is slot table[s // BS] * BS + s % BS. It walks the blocks in order, K then V, a block (one
    contiguous [BS, KVH, Dh] run of memory) at a time."""
    _, H, Dh = q.shape
    KVH = k.shape[1]
    G = H // KVH
    scale = np.float32(1.0 / np.sqrt(Dh))
    scores = np.empty((1, H, S), dtype=np.float32)               # [1, H, S]
    for first in range(0, S, BS):                                # q . k, a block of BS slots at a time
        slot, n = table[first // BS] * BS, min(BS, S - first)
        for kvh in range(KVH):
            score_rows(q, 0, kvh * G, G, k, ks, slot, n, kvh, scale, scores, first, shape)
    for h in range(H):                                           # softmax over the S positions
        softmax_in_place(scores[0, h])
    acc_out = np.zeros((1, H, Dh), dtype=np.float32)             # [1, H, Dh] weighted sum of v
    for first in range(0, S, BS):
        slot, n = table[first // BS] * BS, min(BS, S - first)
        for kvh in range(KVH):
            add_rows(acc_out, 0, kvh * G, G, scores, first, n, v, vs, slot, kvh, shape)
    for h in range(H):
        for j in range(Dh):
            out[0, h, j] = acc_out[0, h, j]
