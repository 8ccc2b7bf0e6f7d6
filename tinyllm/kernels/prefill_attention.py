"""Attention for a chunk of a long prompt: blocks of queries against blocks of keys, with an online softmax
(FlashAttention, Dao et al. 2022), so the [T, S] score matrix is never held and each K/V row is read once per
block of queries instead of once per query.

A long prompt is prefilled in chunks of at most dispatch.SMALL_M tokens (model.prefill); the last chunks of a
2,048-token prompt attend to 2,000 cached positions. One task per (block of QUERY_BLOCK tokens, KV head): its
QUERY_BLOCK x G query rows (the G heads of a group share K and V) walk the keys KEY_BLOCK positions at a time, up to
the last one the block's final token sees. Per key block, two small matrix products in 4 x 4 register tiles (as
linear_kernels.linear_tiled): scores = rows . K_block^T, then P . V_block; between them the causal mask and the
online softmax: each row's running max m and sum l, its earlier sums rescaled by exp(m_old - m_new).
K and V are read in the cache's stored format (kv_formats.py) as each key block is loaded, widened to float32.
The twin is ops.attention (the plain softmax over whole rows); tests/test_kernels.py checks they agree.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kv_formats import int8_levels, kv_value
from .numerics import PARALLEL, SERIAL, exp32

QUERY_BLOCK = 16   # query tokens per task: with G heads per KV head, 48 rows share each K/V row read
KEY_BLOCK = 64     # key positions per step: the block's K and V (2 x 64 x Dh floats) stay in L1


@njit(**SERIAL)
def _products(a, b, out):
    """out[m, o] = sum_i a[m, i] * b[o, i] for a [M, I], b [O, I] with M and O multiples of 4: 4 x 4 tiles, 16
    sums in registers, each loaded value used 4 times."""
    M, I = a.shape
    for m in range(0, M, 4):
        for o in range(0, b.shape[0], 4):
            c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = np.float32(0.0)
            c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = np.float32(0.0)
            for i in range(I):
                a0, a1, a2, a3 = a[m, i], a[m + 1, i], a[m + 2, i], a[m + 3, i]
                b0, b1, b2, b3 = b[o, i], b[o + 1, i], b[o + 2, i], b[o + 3, i]
                c00 += a0 * b0; c01 += a0 * b1; c02 += a0 * b2; c03 += a0 * b3      # noqa: E702
                c10 += a1 * b0; c11 += a1 * b1; c12 += a1 * b2; c13 += a1 * b3      # noqa: E702
                c20 += a2 * b0; c21 += a2 * b1; c22 += a2 * b2; c23 += a2 * b3      # noqa: E702
                c30 += a3 * b0; c31 += a3 * b1; c32 += a3 * b2; c33 += a3 * b3      # noqa: E702
            out[m, o], out[m, o + 1], out[m, o + 2], out[m, o + 3] = c00, c01, c02, c03
            out[m + 1, o], out[m + 1, o + 1], out[m + 1, o + 2], out[m + 1, o + 3] = c10, c11, c12, c13
            out[m + 2, o], out[m + 2, o + 1], out[m + 2, o + 2], out[m + 2, o + 3] = c20, c21, c22, c23
            out[m + 3, o], out[m + 3, o + 1], out[m + 3, o + 2], out[m + 3, o + 3] = c30, c31, c32, c33


@njit(**PARALLEL)
def tiled_causal_attention(q, k, ks, v, vs, start, out):
    """q [T, H, Dh] at positions start .. start+T-1; k, v [S, KVH, Dh] (S = start + T) in their stored format with
    their scales ks, vs (None for float formats: kv_formats.py) -> out [T, H, Dh]. Token t sees positions
    0 .. start+t."""
    T, KVH = q.shape[0], k.shape[1]
    n_blocks = (T + QUERY_BLOCK - 1) // QUERY_BLOCK
    for task in prange(n_blocks * KVH):
        # the last query blocks see the most keys: handed out first, so the threads finish together
        qb = n_blocks - 1 - task // KVH
        _query_block(q, k, ks, v, vs, start, out, qb * QUERY_BLOCK, min(T, (qb + 1) * QUERY_BLOCK), task % KVH)


@njit(**SERIAL)
def _query_block(q, k, ks, v, vs, start, out, t0, t1, kvh):
    """Tokens t0 .. t1-1 of q, the heads of KV head kvh, against every key they see -> their rows of out. (A
    function of its own, so that the parallel loop above stays small: Numba compiles a large one slowly.)"""
    H, Dh = q.shape[1], q.shape[2]
    G = H // k.shape[1]
    R4, Dh4 = (QUERY_BLOCK * G + 3) // 4 * 4, (Dh + 3) // 4 * 4   # rows r = (t - t0) * G + g, padded to tiles
    scale = np.float32(1.0 / np.sqrt(Dh))
    rows = np.zeros((R4, Dh), dtype=np.float32)                 # [R4, Dh] the block's queries, pre-scaled
    for r in range((t1 - t0) * G):
        if ks is None:
            for j in range(Dh):
                rows[r, j] = q[t0 + r // G, kvh * G + r % G, j] * scale
        else:                                                   # an int8 cache: q as decode rounds it (kv_rows)
            group = Dh // ks.shape[2]
            levels, factors = int8_levels(q[t0 + r // G, kvh * G + r % G], group, scale)
            for j in range(Dh):
                rows[r, j] = levels[j] * factors[j // group]
    k_blk = np.zeros((KEY_BLOCK, Dh), dtype=np.float32)         # [KB, Dh] this key block's K rows
    v_t = np.zeros((Dh4, KEY_BLOCK), dtype=np.float32)          # [Dh4, KB] its V rows, transposed
    p = np.empty((R4, KEY_BLOCK), dtype=np.float32)             # [R4, KB] scores, then probabilities
    pv = np.empty((R4, Dh4), dtype=np.float32)                  # [R4, Dh4] this block's P . V
    m = np.full(R4, np.float32(-1e30), dtype=np.float32)        # running max of each row's scores
    l = np.zeros(R4, dtype=np.float32)                          # running sum of exp(score - m)
    acc = np.zeros((R4, Dh), dtype=np.float32)                  # running sum of exp(score - m) * v
    for s0 in range(0, start + t1, KEY_BLOCK):                  # keys up to the last one token t1-1 sees
        n_keys = min(start + t1, s0 + KEY_BLOCK) - s0
        for i in range(KEY_BLOCK):                              # load the block as float32 (zeros past its end)
            for j in range(Dh):
                k_blk[i, j] = kv_value(k, ks, s0 + i, kvh, j) if i < n_keys else np.float32(0.0)
                v_t[j, i] = kv_value(v, vs, s0 + i, kvh, j) if i < n_keys else np.float32(0.0)
        _products(rows, k_blk, p)                               # [R4, KB] scores
        for r in range(R4):
            n = min(n_keys, start + t0 + r // G + 1 - s0)       # positions of this block row r may see
            if n <= 0:                                          # (a padding row, or an early token's last block)
                for i in range(KEY_BLOCK):
                    p[r, i] = 0.0
                continue
            m_new = m[r]
            for i in range(n):
                m_new = max(m_new, p[r, i])
            total = np.float32(0.0)
            for i in range(KEY_BLOCK):
                e = exp32(p[r, i] - m_new) if i < n else np.float32(0.0)   # the causal mask
                p[r, i] = e
                total += e
            alpha = exp32(m[r] - m_new)                         # rescales what the earlier blocks added
            l[r] = l[r] * alpha + total
            m[r] = m_new
            for j in range(Dh):
                acc[r, j] *= alpha
        _products(p, v_t, pv)                                   # [R4, Dh4] weighted V rows
        for r in range(R4):
            for j in range(Dh):
                acc[r, j] += pv[r, j]
    for r in range((t1 - t0) * G):
        inv = np.float32(1.0) / l[r]
        for j in range(Dh):
            out[t0 + r // G, kvh * G + r % G, j] = acc[r, j] * inv
