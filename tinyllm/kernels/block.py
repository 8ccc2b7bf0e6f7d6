"""A whole Llama block for the few new tokens of a step, in one compiled call: the fast twin of model._block.

Called op by op from Python, a decode step makes about 13 kernel calls per layer plus the numpy glue between
them, and each call spends microseconds on argument checks and unboxing in which no weight byte is read. Here the
same kernels are called from compiled code, one Python call per layer, as llama2.c's forward() does in C. The
logits and the cache are those of the op-by-op path (tests/test_model.py): bit for bit when the kernels were
compiled alike, else to float32 rounding (a kernel compiled into a block may vectorise a float sum in another
order than alone).

Two versions. The plain block calls the kernels one after another, and each kernel starts and joins its own
parallel region (about 5 per layer). The threaded block, for fewer than TILE_MIN_ROWS tokens (a decode step, a
short verification) of a model with quantized weights, is one parallel region per layer: both threads run the
whole block, each taking its share of every matrix's rows (and of attention's position chunks and heads) and
meeting at a spin barrier (spin_barrier.py) between the stages that need each other's results; the small
per-token work (RMSNorm, the input's rounding, SwiGLU) every thread does for itself rather than wait. Its shares
are computed by the very functions the kernels' parallel loops call, so its results are the plain block's (with
the same caveat).
"""
from __future__ import annotations

import os
import time

import numba
import numpy as np
from numba import njit, prange

from ..threads import step_threads
from . import intdot
from .attention_kernels import attend_chunk, decode_attention, merge_chunks, position_chunks
from .dispatch import linear_into, linear_share, thread_share
from .kv_formats import first_rows, kernel_operands, store_row
from .kv_rows import row_shape_of
from .linear_kernels import TILE_MIN_ROWS
from .numerics import PARALLEL, SERIAL
from .pointwise import rmsnorm_into, swiglu_into, swiglu_rows_into
from .spin_barrier import COUNT, barrier, new_state
from .weight_formats import kernel_weight, named


def block_weights(layer) -> tuple:
    """What the compiled block takes of one layer's weights (model.LayerWeights): its two norms and its four
    matrices, each the plain tuple of its format's arrays (the block names them: weight_formats.named). The same
    every step: the model builds these once."""
    matrices = (layer.wqkv, layer.wo, layer.w_in, layer.w_out)
    return (layer.attn_norm, layer.ffn_norm, *(tuple(kernel_weight(w)) for w in matrices))


def cache_operands(k_cache, v_cache, n_heads: int) -> tuple:
    """What the compiled block takes of one layer's cache k_cache, v_cache [S_max, KVH, Dh] (in its stored format:
    kv_cache.py): values and scales of K and V, and the rows' shape (kv_rows.row_shape_of). The same every step of
    that cache."""
    (k, k_scales), (v, v_scales) = kernel_operands(k_cache), kernel_operands(v_cache)
    return k, k_scales, v, v_scales, row_shape_of(k, k_scales, n_heads // k.shape[1])


def decode_blocks(x, weights, caches, start: int, cos, sin, n_heads: int, eps: float, int8_inputs: bool,
                  budget: float = 0.0) -> bool:
    """Every Llama block for the T <= FUSED_ROWS new tokens x [T, D] at positions start .. start+T-1, one compiled
    call per layer, updating x in place and writing their K and V into each layer's cache. weights[i]:
    block_weights(layer i); caches[i]: cache_operands of layer i's K and V; cos, sin [T, Dh/2]: the rotations of
    the tokens' positions; int8_inputs: the activations setting. budget: seconds for the step (0: no limit); once
    the layers so far took longer than their share of it, plus a quarter of it up front (a hiccup early in a step
    is not a stall), the rest run on one thread (threads.step_threads(1)): a machine whose cores other work has
    taken can hold up each of a step's barriers for a time slice, and the step for a second.
    -> whether they did (the same numbers either way: a share's work does not depend on the thread count)"""
    int_dots = intdot.USE_INT_DOTS
    n, t0, fell_back = numba.get_num_threads(), time.perf_counter(), False
    # the threaded block for quantized weights only (fp32 gained nothing: docs/design/kernels.md)
    quantized = weights[0][2][0].dtype != np.float32               # (wqkv's values: not a Float32Weight)
    threaded = x.shape[0] < TILE_MIN_ROWS and quantized and not _plain_only and threads_can_wait()
    block = (THREADED_BLOCKS if threaded else BLOCKS)[int8_inputs]
    state = new_state() if threaded else None                      # a barrier per call: two callers never share one
    for i, ((attn_norm, ffn_norm, wqkv, wo, w_in, w_out), (k, k_scales, v, v_scales, shape)) in enumerate(
            zip(weights, caches)):
        args = (x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k, k_scales, v, v_scales, start, cos, sin,
                n_heads, eps, shape)
        if threaded:
            block(*args, state, n)
        else:
            block(*args)
        if budget and n > 1 and time.perf_counter() - t0 > budget * (i + 1 + len(weights) / 4) / len(weights):
            n, fell_back = 1, True
            step_threads(1)
    return fell_back


_layer_ok, _plain_only = False, False


def plain_blocks_only(only: bool = True) -> None:
    """Run the plain blocks from now on in this process (warmup: the threaded ones are still being compiled), or
    (only=False: they are loaded) the threaded ones again."""
    global _plain_only
    _plain_only = only


def threads_can_wait() -> bool:
    """Whether the threaded block may run: Numba's threading layer gives each thread of a region its own
    iteration of `prange(get_num_threads())` (omp, workqueue), so that threads waiting at a barrier cannot hold up
    the one they wait for. TBB's work stealing does not promise that, nor OpenMP when OMP_DYNAMIC or
    OMP_THREAD_LIMIT let it start fewer threads than asked; nor is the layer known before the first parallel
    region has run (then the plain block runs, which starts one)."""
    global _layer_ok
    if not _layer_ok:
        try:
            layer = numba.threading_layer()
        except ValueError:
            return False
        limit = os.environ.get("OMP_THREAD_LIMIT", "").strip()
        fewer = (os.environ.get("OMP_DYNAMIC", "").strip().lower() in ("true", "1", "yes")
                 or (limit.isdigit() and int(limit) < numba.config.NUMBA_NUM_THREADS))
        _layer_ok = layer == "workqueue" or (layer == "omp" and not fewer)
    return _layer_ok


@njit(**SERIAL)
def rotate_and_store(qkv, cos, sin, q, k_cache, k_scales, v_cache, v_scales, pos):
    """From the rows qkv [T, (H + 2*KVH) * Dh]: q [T, H, Dh] <- the queries rotated by their positions' angles
    (half-split pairs, ops.apply_rope); the keys rotated and the values as they are go into the cache at
    pos .. pos+T-1, in its stored format."""
    T, H, Dh = q.shape
    KVH = k_cache.shape[1]
    half = Dh // 2
    k_row = np.empty(Dh, np.float32)                            # [Dh] one rotated k head, before it is stored
    for t in range(T):
        for head in range(H + KVH):
            for i in range(half):
                a, b = qkv[t, head * Dh + i], qkv[t, head * Dh + half + i]
                ra, rb = a * cos[t, i] - b * sin[t, i], b * cos[t, i] + a * sin[t, i]
                if head < H:
                    q[t, head, i], q[t, head, half + i] = ra, rb
                else:
                    k_row[i], k_row[half + i] = ra, rb
            if head >= H:
                store_row(k_cache, k_scales, pos + t, head - H, k_row)
        for kvh in range(KVH):
            store_row(v_cache, v_scales, pos + t, kvh, qkv[t, (H + KVH + kvh) * Dh:(H + KVH + kvh + 1) * Dh])


def _compile_block(int8_inputs: bool):
    """The block for one activations setting. int8_inputs is a constant of the compiled code, so that the linears
    compile only that setting's kernels (a first run then compiles only what it uses)."""
    def block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k_cache, k_scales, v_cache, v_scales, pos, cos,
                  sin, n_heads, eps, kv_shape):
        wqkv, wo, w_in, w_out = named(wqkv), named(wo), named(w_in), named(w_out)   # (plain tuples from Python)
        T, D = x.shape
        KVH, Dh = k_cache.shape[1], k_cache.shape[2]
        H = n_heads
        h = np.empty((T, D), np.float32)                            # [T, D] normed x
        delta = np.empty((T, D), np.float32)                        # [T, D] what a sub-block adds to x

        # attention
        rmsnorm_into(x, attn_norm, eps, h)
        qkv = np.empty((T, (H + 2 * KVH) * Dh), np.float32)         # [T, (H + 2*KVH) * Dh]
        linear_into(wqkv, h, qkv, int8_inputs, int_dots)
        q = np.empty((T, H, Dh), np.float32)                        # [T, H, Dh]
        rotate_and_store(qkv, cos, sin, q, k_cache, k_scales, v_cache, v_scales, pos)
        att = np.empty((T, H, Dh), np.float32)                      # [T, H, Dh]
        S = pos + T
        decode_attention(q, k_cache[:S], first_rows(k_scales, S), v_cache[:S], first_rows(v_scales, S), pos, att,
                         kv_shape)
        linear_into(wo, att.reshape(T, H * Dh), delta, int8_inputs, int_dots)
        for t in range(T):
            for i in range(D):
                x[t, i] += delta[t, i]

        # feed-forward
        rmsnorm_into(x, ffn_norm, eps, h)
        gate_up = np.empty((T, w_in[0].shape[0]), np.float32)       # [T, 2F]
        linear_into(w_in, h, gate_up, int8_inputs, int_dots)
        act = np.empty((T, gate_up.shape[1] // 2), np.float32)     # [T, F]
        if T >= 4:                                                  # as dispatch.swiglu chooses
            swiglu_rows_into(gate_up, act)
        else:
            swiglu_into(gate_up, act)
        linear_into(w_out, act, delta, int8_inputs, int_dots)
        for t in range(T):
            for i in range(D):
                x[t, i] += delta[t, i]
    return njit(**SERIAL)(named_for(block, int8_inputs))


@njit(**SERIAL)
def _block_arrays(x, w_in, k_cache, pos, n_heads, n):
    """The threaded block's arrays (allocated outside its parallel loop, which then compiles faster): those every
    thread writes its share of and reads whole after a barrier, and each thread's own (normed x, x after
    attention, silu(gate) * up: [n, T, ...])."""
    T, D = x.shape
    KVH, Dh = k_cache.shape[1], k_cache.shape[2]
    H, F = n_heads, w_in[0].shape[0] // 2
    n_chunks = position_chunks(pos + T)[1]
    shared = (np.empty((T, (H + 2 * KVH) * Dh), np.float32),        # qkv [T, (H + 2*KVH) * Dh]
              np.empty((T, H, Dh), np.float32),                     # q [T, H, Dh], rotated
              np.empty((T, H, Dh), np.float32),                     # att [T, H, Dh]
              np.empty((T, D), np.float32),                         # delta [T, D]: what a sub-block adds to x
              np.empty((T, 2 * F), np.float32),                     # gate_up [T, 2F]
              np.empty((n_chunks, T, H), np.float32),               # attention's max per position chunk,
              np.empty((n_chunks, T, H), np.float32),               # its sum of exponentials,
              np.empty((n_chunks, T, H, Dh), np.float32))           # and its weighted sum of v
    return shared, np.empty((n, T, D), np.float32), np.empty((n, T, D), np.float32), np.empty((n, T, F), np.float32)


def _compile_threaded_block(int8_inputs: bool):
    """The threaded block (see the module's docstring) for one activations setting, T < TILE_MIN_ROWS tokens."""
    def threaded_block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k_cache, k_scales, v_cache, v_scales,
                       pos, cos, sin, n_heads, eps, kv_shape, state, n):
        """block's arguments, and: state, the barrier's (spin_barrier.new_state()); n, the region's threads."""
        T, D = x.shape
        H, Dh = n_heads, k_cache.shape[2]
        S = pos + T
        chunk, n_chunks = position_chunks(S)                        # attention's split, as decode_attention's
        shared, normed, x_mid, act = _block_arrays(x, w_in, k_cache, pos, n_heads, n)
        qkv, q, att, delta, gate_up, chunk_max, chunk_sum, chunk_out = shared
        state[COUNT] = 0                                            # (no thread is waiting yet)
        for tid in prange(n):                                       # one iteration per thread (threads_can_wait)
            h, xm, a = normed[tid], x_mid[tid], act[tid]
            # attention
            rmsnorm_into(x, attn_norm, eps, h)
            linear_share(wqkv, h, qkv, int8_inputs, int_dots, tid, n)
            barrier(state, n)
            if tid == 0:                                            # microseconds: not worth splitting
                rotate_and_store(qkv, cos, sin, q, k_cache, k_scales, v_cache, v_scales, pos)
            barrier(state, n)
            c0, c1 = thread_share(n_chunks, tid, n)
            for c in range(c0, c1):
                attend_chunk(q, k_cache[:S], first_rows(k_scales, S), v_cache[:S], first_rows(v_scales, S), pos,
                             c * chunk, min(S, (c + 1) * chunk), chunk_max[c], chunk_sum[c], chunk_out[c], kv_shape)
            barrier(state, n)
            h0, h1 = thread_share(H, tid, n)
            merge_chunks(chunk_max, chunk_sum, chunk_out, att, h0, h1)
            barrier(state, n)
            linear_share(wo, att.reshape(T, H * Dh), delta, int8_inputs, int_dots, tid, n)
            barrier(state, n)
            for t in range(T):
                for i in range(D):
                    xm[t, i] = x[t, i] + delta[t, i]
            # feed-forward
            rmsnorm_into(xm, ffn_norm, eps, h)
            linear_share(w_in, h, gate_up, int8_inputs, int_dots, tid, n)
            barrier(state, n)
            swiglu_into(gate_up, a)
            linear_share(w_out, a, delta, int8_inputs, int_dots, tid, n)
            barrier(state, n)
            if tid == 0:
                for t in range(T):
                    for i in range(D):
                        x[t, i] = xm[t, i] + delta[t, i]
    return njit(**PARALLEL)(named_for(threaded_block, int8_inputs))


def _named_threaded_block(int8_inputs: bool):
    """threaded_block of that setting on the plain tuples Python passes (a parallel region takes its weights named
    already). It reaches the parallel function through a global, never its closure: Numba keys a cached closure on
    its captured values, and a captured dispatcher pickles differently in every process (a recompile every run)."""
    def named_threaded_block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k_cache, k_scales, v_cache,
                             v_scales, pos, cos, sin, n_heads, eps, kv_shape, state, n):
        wqkv, wo, w_in, w_out = named(wqkv), named(wo), named(w_in), named(w_out)
        if int8_inputs:                                             # (a constant: the other branch never compiles)
            threaded_block_int8(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k_cache, k_scales, v_cache,
                                v_scales, pos, cos, sin, n_heads, eps, kv_shape, state, n)
        else:
            threaded_block_float(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int_dots, k_cache, k_scales, v_cache,
                                 v_scales, pos, cos, sin, n_heads, eps, kv_shape, state, n)
    return njit(**SERIAL)(named_for(named_threaded_block, int8_inputs))


def named_for(f, int8_inputs: bool):
    """f, named for its activations setting. Numba names a compiled function, and its disk cache file, by the
    function's qualified name: two closures of one name, both loaded from the cache into one process, ran the
    first one's code for both settings (the second setting's threaded block gave wrong logits)."""
    f.__qualname__ = f"{f.__qualname__}_{'int8' if int8_inputs else 'float'}"
    return f


BLOCKS = {False: _compile_block(False), True: _compile_block(True)}     # by activations setting
threaded_block_float, threaded_block_int8 = _compile_threaded_block(False), _compile_threaded_block(True)
THREADED_BLOCKS = {False: _named_threaded_block(False), True: _named_threaded_block(True)}
