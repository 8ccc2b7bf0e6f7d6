"""A whole Llama block for the few new tokens of a step, in one compiled call: the fast twin of model._block.

Called op by op from Python, a decode step makes about 13 kernel calls per layer plus the numpy glue between
them, and each call spends microseconds on argument checks and unboxing in which no weight byte is read. Here the
same kernels are called from compiled code, one Python call per layer, as llama2.c's forward() does in C. The
logits and the cache are bit for bit those of the op-by-op path (tests/test_model.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import intdot
from .attention_kernels import decode_attention
from .dispatch import linear_into
from .kv_formats import first_rows, kernel_operands, store_row
from .kv_rows import row_shape_of
from .linear_kernels import weight_arrays
from .numerics import SERIAL
from .pointwise import rmsnorm_into, swiglu_into, swiglu_rows_into


def block_weights(layer) -> tuple:
    """What the compiled block takes of one layer's weights (model.LayerWeights): its two norms and its four
    matrices' arrays. The same every step: the model builds these once."""
    return (layer.attn_norm, layer.ffn_norm, weight_arrays(layer.wqkv), weight_arrays(layer.wo),
            weight_arrays(layer.w_in), weight_arrays(layer.w_out))


def cache_operands(k_cache, v_cache, n_heads: int) -> tuple:
    """What the compiled block takes of one layer's cache k_cache, v_cache [S_max, KVH, Dh] (in its stored format:
    kv_cache.py): values and scales of K and V, and the rows' shape (kv_rows.row_shape_of). The same every step of
    that cache."""
    (k, k_scales), (v, v_scales) = kernel_operands(k_cache), kernel_operands(v_cache)
    return k, k_scales, v, v_scales, row_shape_of(k, k_scales, n_heads // k.shape[1])


def decode_blocks(x, weights, caches, start: int, cos, sin, n_heads: int, eps: float, int8_inputs: bool) -> None:
    """Every Llama block for the T <= FUSED_ROWS new tokens x [T, D] at positions start .. start+T-1, one compiled
    call per layer, updating x in place and writing their K and V into each layer's cache. weights[i]:
    block_weights(layer i); caches[i]: cache_operands of layer i's K and V; cos, sin [T, Dh/2]: the rotations of
    the tokens' positions; int8_inputs: the activations setting."""
    block, vnni = BLOCKS[int8_inputs], intdot.USE_VNNI
    for (attn_norm, ffn_norm, wqkv, wo, w_in, w_out), (k, k_scales, v, v_scales, shape) in zip(weights, caches):
        block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, vnni, k, k_scales, v, v_scales, start, cos, sin,
              n_heads, eps, shape)


def decode_block(x, layer, k_cache, v_cache, start: int, cos, sin, n_heads: int, eps: float,
                 int8_inputs: bool) -> None:
    """One Llama block (model.LayerWeights `layer`) for the T <= FUSED_ROWS new tokens x [T, D]: decode_blocks
    for a single layer, its cache k_cache, v_cache [S_max, KVH, Dh]."""
    decode_blocks(x, [block_weights(layer)], [cache_operands(k_cache, v_cache, n_heads)], start, cos, sin, n_heads,
                  eps, int8_inputs)


def _compile_block(int8_inputs: bool):
    """The block for one activations setting. int8_inputs is a constant of the compiled code, so that the linears
    compile only that setting's kernels (a first run then compiles only what it uses)."""
    @njit(**SERIAL)
    def block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, vnni, k_cache, k_scales, v_cache, v_scales, pos, cos,
                  sin, n_heads, eps, kv_shape):
        T, D = x.shape
        KVH, Dh = k_cache.shape[1], k_cache.shape[2]
        H, half = n_heads, Dh // 2
        h = np.empty((T, D), np.float32)                            # [T, D] normed x
        delta = np.empty((T, D), np.float32)                        # [T, D] what a sub-block adds to x

        # attention
        rmsnorm_into(x, attn_norm, eps, h)
        qkv = np.empty((T, (H + 2 * KVH) * Dh), np.float32)         # [T, (H + 2*KVH) * Dh]
        linear_into(wqkv, h, qkv, int8_inputs, vnni)
        q = np.empty((T, H, Dh), np.float32)                        # [T, H, Dh]
        k_row = np.empty(Dh, np.float32)                            # [Dh] one rotated k head, before it is stored
        for t in range(T):
            for head in range(H + KVH):                             # rotate q and k (half-split pairs, ops.apply_rope)
                for i in range(half):
                    a, b = qkv[t, head * Dh + i], qkv[t, head * Dh + half + i]
                    ra, rb = a * cos[t, i] - b * sin[t, i], b * cos[t, i] + a * sin[t, i]
                    if head < H:
                        q[t, head, i], q[t, head, half + i] = ra, rb
                    else:
                        k_row[i], k_row[half + i] = ra, rb
                if head >= H:                                   # k and v go into the cache at pos + t, stored format
                    store_row(k_cache, k_scales, pos + t, head - H, k_row)
            for kvh in range(KVH):
                store_row(v_cache, v_scales, pos + t, kvh, qkv[t, (H + KVH + kvh) * Dh:(H + KVH + kvh + 1) * Dh])
        att = np.empty((T, H, Dh), np.float32)                      # [T, H, Dh]
        S = pos + T
        decode_attention(q, k_cache[:S], first_rows(k_scales, S), v_cache[:S], first_rows(v_scales, S), pos, att,
                         kv_shape)
        linear_into(wo, att.reshape(T, H * Dh), delta, int8_inputs, vnni)
        for t in range(T):
            for i in range(D):
                x[t, i] += delta[t, i]

        # feed-forward
        rmsnorm_into(x, ffn_norm, eps, h)
        gate_up = np.empty((T, w_in[0].shape[0]), np.float32)       # [T, 2F]
        linear_into(w_in, h, gate_up, int8_inputs, vnni)
        act = np.empty((T, gate_up.shape[1] // 2), np.float32)     # [T, F]
        if T >= 4:                                                  # as dispatch.swiglu chooses
            swiglu_rows_into(gate_up, act)
        else:
            swiglu_into(gate_up, act)
        linear_into(w_out, act, delta, int8_inputs, vnni)
        for t in range(T):
            for i in range(D):
                x[t, i] += delta[t, i]
    return block


BLOCKS = {False: _compile_block(False), True: _compile_block(True)}     # by activations setting
