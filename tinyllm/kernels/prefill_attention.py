"""Attention for a chunk of a long prompt: blocks of queries against blocks of keys, with an online softmax
(FlashAttention, Dao et al. 2022), so the [T, S] score matrix is never held and each K/V row is read once per
block of queries instead of once per query.

A long prompt is prefilled in chunks of at most dispatch.SMALL_M tokens (model.prefill); the last chunks of a
2,048-token prompt attend to 2,000 cached positions. One task per (block of QUERY_BLOCK tokens, KV head): its
QUERY_BLOCK x G query rows (the G heads of a group share K and V) walk the keys KEY_BLOCK positions at a time, up to
the last one the block's final token sees. Per key block, two small matrix products in register tiles
(register_tiles.py): scores = K_block . Q^T, then P . V_block; between them the causal mask and the online softmax:
each row's running max m and sum l, its earlier sums rescaled by exp(m_old - m_new).
K and V are read in the cache's stored format (kv_formats.py) as each key block is loaded, widened to float32; the
next block's rows are asked for from memory meanwhile (a 2,048-position cache is 3 MB: read from L3, not L1).
The twin is ops.attention (the plain softmax over whole rows); tests/test_kernels.py checks they agree.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kv_formats import int8_levels, kv_value
from .llvm_ir import prefetch
from .numerics import PARALLEL, SERIAL, exp32
from .register_tiles import LANES, product

QUERY_BLOCK = 32   # query tokens per task: with G heads per KV head, 96 rows share each K/V row read
KEY_BLOCK = 64     # key positions per step: the block's K and V (2 x 64 x Dh floats) stay in L1


if config.DISABLE_JIT:
    def prefetch_rows(values, s, kvh, n):
        """(stepping through as Python: nothing to ask for)"""
else:
    @intrinsic
    def prefetch_rows(typingctx, values, s, kvh, n):
        """Ask for the stored rows values[s .. s+n-1, kvh] (each row's cache lines) to be read into the cache."""
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            array = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
            strides = cgutils.unpack_tuple(builder, array.strides, 3)
            shape = cgutils.unpack_tuple(builder, array.shape, 3)
            item = ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype)))
            s, kvh, n = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], signature.args[1:]))
            first = builder.add(builder.ptrtoint(array.data, i64), builder.mul(kvh, strides[1]))
            row_bytes = builder.mul(shape[2], item)
            with cgutils.for_range(builder, n) as loop:
                row = builder.add(first, builder.mul(builder.add(s, loop.index), strides[0]))
                with cgutils.for_range_slice(builder, ir.Constant(i64, 0), row_bytes, ir.Constant(i64, 64)) as (at, _):
                    prefetch(builder, builder.inttoptr(builder.add(row, at), ir.IntType(8).as_pointer()))
            return context.get_dummy_value()
        return types.none(values, s, kvh, n), codegen


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
    function of its own, so that the parallel loop above stays small: Numba compiles a large one slowly.)

    The block's R = QUERY_BLOCK * G query rows, r = (t - t0) * G + g, are held transposed (qt [Dh, R]), so that
    both products run as register tiles (register_tiles.py) with no transposing per key block: the scores come out
    transposed, pt = K_block . qt [KB, R], and the softmax's running max and sum go along a key's R scores at
    once; then P . V reads pt as the transposed A."""
    H, Dh = q.shape[1], q.shape[2]
    G = H // k.shape[1]
    R, D16 = QUERY_BLOCK * G, (Dh + LANES - 1) // LANES * LANES   # a multiple of LANES: whole vectors
    scale = np.float32(1.0 / np.sqrt(Dh))
    qt = np.zeros((Dh, R), dtype=np.float32)                    # [Dh, R] the block's queries, pre-scaled
    for r in range((t1 - t0) * G):
        if ks is None:
            for j in range(Dh):
                qt[j, r] = q[t0 + r // G, kvh * G + r % G, j] * scale
        else:                                                   # an int8 cache: q as decode rounds it (kv_rows)
            group = Dh // ks.shape[2]
            levels, factors = int8_levels(q[t0 + r // G, kvh * G + r % G], group, scale)
            for j in range(Dh):
                qt[j, r] = levels[j] * factors[j // group]
    last_seen = np.empty(R, dtype=np.int64)                     # [R] the last position each row sees (-1: none)
    for r in range(R):
        last_seen[r] = start + t0 + r // G if t0 + r // G < t1 else -1   # (rows past t1: padding)
    k_blk = np.zeros((KEY_BLOCK, Dh), dtype=np.float32)         # [KB, Dh] this key block's K rows
    v_blk = np.zeros((KEY_BLOCK, D16), dtype=np.float32)        # [KB, D16] its V rows
    pt = np.empty((KEY_BLOCK, R), dtype=np.float32)             # [KB, R] scores, then probabilities, transposed
    pv = np.empty((R, D16), dtype=np.float32)                   # [R, D16] this block's P . V
    m = np.full(R, np.float32(-1e30), dtype=np.float32)         # running max of each row's scores
    m_new = np.empty(R, dtype=np.float32)
    alpha = np.empty(R, dtype=np.float32)
    l = np.zeros(R, dtype=np.float32)                           # running sum of exp(score - m)
    acc = np.zeros((R, D16), dtype=np.float32)                  # running sum of exp(score - m) * v
    for s0 in range(0, start + t1, KEY_BLOCK):                  # keys up to the last one token t1-1 sees
        n_keys = min(start + t1, s0 + KEY_BLOCK) - s0
        for i in range(KEY_BLOCK):                              # load the block as float32 (zeros past its end)
            for j in range(Dh):
                k_blk[i, j] = kv_value(k, ks, s0 + i, kvh, j) if i < n_keys else np.float32(0.0)
                v_blk[i, j] = kv_value(v, vs, s0 + i, kvh, j) if i < n_keys else np.float32(0.0)
        n_next = min(start + t1, s0 + 2 * KEY_BLOCK) - s0 - KEY_BLOCK
        if n_next > 0:                                          # the next block's rows, while this one computes
            prefetch_rows(k, s0 + KEY_BLOCK, kvh, n_next)
            prefetch_rows(v, s0 + KEY_BLOCK, kvh, n_next)
        product(k_blk, qt, pt, False)                           # [KB, R] scores
        whole = s0 + KEY_BLOCK <= start + t0 + 1                # every row sees every key of the block
        for r in range(R):
            m_new[r] = m[r]
        for i in range(n_keys):                                 # each row's max over the keys it sees
            for r in range(R):
                if whole or s0 + i <= last_seen[r]:
                    m_new[r] = max(m_new[r], pt[i, r])
        for r in range(R):
            alpha[r] = exp32(m[r] - m_new[r])                   # rescales what the earlier blocks added
            l[r] *= alpha[r]
            m[r] = m_new[r]
        for i in range(KEY_BLOCK):                              # exp(score - max); zero where the mask says
            for r in range(R):
                e = exp32(pt[i, r] - m_new[r]) if whole or s0 + i <= last_seen[r] else np.float32(0.0)
                pt[i, r] = e
                l[r] += e
        product(pt, v_blk, pv, True)                            # [R, D16] weighted V rows
        for r in range(R):
            for j in range(D16):
                acc[r, j] = acc[r, j] * alpha[r] + pv[r, j]
    for r in range((t1 - t0) * G):
        inv = np.float32(1.0) / l[r]
        for j in range(Dh):
            out[t0 + r // G, kvh * G + r % G, j] = acc[r, j] * inv
