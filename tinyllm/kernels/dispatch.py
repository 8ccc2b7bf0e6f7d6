"""Which kernel runs: the one place that decides by row count, weight format and activations setting.

    rows in the pass     linears                                 attention
    1 .. FEW_TOKENS      linear_kernels.py, q4_kernels.py        decode_attention (flash-decoding)
                         (see linear_into)
    .. SMALL_M           the same (panel_kernels.py from         tiled_causal_attention (prefill_attention.py)
                         PANEL_MIN_ROWS, fp32 and 4-bit, and
                         int8 without AVX-512; with int8 inputs,
                         from integer_tiles_from(w): the integer
                         tiles, VNNI's or AVX2's)
    more                 BLAS sgemm (blas.py)                    numpy (backend.NumpyOps.attention)

A prompt longer than SMALL_M tokens is prefilled in chunks of PREFILL_CHUNK (model.prefill), so it stays in the
first two rows. Past SMALL_M rows in one pass (a batch of prompts, a no-cache pass) BLAS's sgemm is faster than
the Numba kernels, and then everything else in the pass leaves Numba too: OpenBLAS's and Numba's threads would
spin-wait on the same 2 cores and take turns (`for_rows` hands the model the ops of such a pass). A step of a Llama
block on a contiguous cache runs as one compiled call (block.py) for up to FUSED_ROWS tokens; below TILE_MIN_ROWS
tokens that call is one parallel region, whose threads take their shares of each linear through `linear_share`.
"""
from __future__ import annotations

import numpy as np
from numba import config, njit
from numba.core.errors import TypingError
from numba.extending import overload

from ..backend import NumpyOps
from ..quant import BLOCK
from . import blas, intdot
from .attention_kernels import decode_attention, decode_attention_one_thread, paged_decode_attention
from .kv_formats import kernel_operands
from .kv_rows import row_shape_of
from .kquant_kernels import (as_q4_weight, linear_q4k, linear_q4k_a8, linear_q6k, linear_q6k_a8, q4k_a8_task,
                             q4k_rows_task, q6k_a8_task, q6k_rows_task)
from .linear_kernels import (OUT_BLOCK, TILE_MIN_ROWS, int8_a8_task, linear_int8_a8, linear_rows, linear_tiled, n_tasks,
                             quantize_rows, round_rows, rows_task)
from .panel_kernels import PANEL_MIN_ROWS, PANELS_FOR_FP32, PANELS_FOR_INT8, linear_integer_panels, linear_panels
from .q4_kernels import linear_q4, linear_q4_a8, q4_a8_task, q4_inputs, q4_rows_task, split_halves
from .q5_kernels import linear_q5, linear_q5_a8, linear_q5_panels, q5_a8_task, q5_rows_task
from .pointwise import swiglu_into, swiglu_rows_into
from .prefill_attention import tiled_causal_attention
from .weight_formats import (INT8, QUANTIZED, Float32Weight, Q4KWeight, Q4Weight, Q5Weight, Q6KWeight, kernel_weight,
                             typed_as)

SMALL_M = 128     # up to this many rows the Numba linears beat BLAS (docs/design/kernels.md)
FEW_TOKENS = 16   # up to this many query tokens attention splits over positions (decode, verification)
FUSED_ROWS = 0 if config.DISABLE_JIT else FEW_TOKENS   # the fused block needs compiled code (linear_into)
PREFILL_CHUNK = SMALL_M   # a longer prompt is prefilled in chunks this long: every pass stays in these kernels
one_thread_attention = False   # a first run's, until the parallel decode attention is compiled (warmup.py)
# With int8 inputs, from this many rows the integer tiles; below, the integer row dots. 8-bit weights: a batch of 8
# too (VNNI or AVX2); 4-bit ones: past FEW_TOKENS, as a tile's 4-bit panels
# cost more to pack; Q5_0 (its panels are int8 blocks) in between (docs/design/kernels.md, "Prompt chunks"); Q6_K
# has no tiles: past FEW_TOKENS, the float kernels
INTEGER_TILES_FROM = TILE_MIN_ROWS
Q4_INTEGER_TILES_FROM = FEW_TOKENS + 1
Q5_INTEGER_TILES_FROM = 12


def integer_tiles_from(w) -> int:
    """From how many input rows a quantized weight w multiplies int8-rounded inputs in integer tiles (Q6_K: where its
    row dots stop)."""
    return (Q4_INTEGER_TILES_FROM if isinstance(w, (Q4Weight, Q6KWeight)) else Q5_INTEGER_TILES_FROM if isinstance(
        w, Q5Weight) else INTEGER_TILES_FROM)


# --- linear -----------------------------------------------------------------------------------------------------
def linear_into(w, x, out, int8_inputs: bool, int_dots: bool) -> None:
    """out [M, O] = x [M, I] times the weight w (a weight_formats named tuple), M <= SMALL_M. int8_inputs: round x to
    int8 blocks first (quantized weights only); int_dots: whether the integer dot products may use their vector
    versions (intdot.USE_INT_DOTS), as may the integer tiles of a prompt chunk.
    This Python body is what `linear` runs (so a first run compiles only the kernels it meets); compiled callers
    (the fused block) get the overload below: the same rule, specialised to the format when they compile, for
    their at most FEW_TOKENS rows (a block compiles no integer tile: 8-bit weights from INTEGER_TILES_FROM take
    the float tiles)."""
    if isinstance(w, Q4KWeight):     # Q4_K's super-blocks where few rows read them, else the Q4_1 arrays they equal
        if int8_inputs and x.shape[0] < (Q4_INTEGER_TILES_FROM if intdot.USE_INT_DOTS else TILE_MIN_ROWS):
            return linear_q4k_a8(w, x, out, int_dots)
        if not int8_inputs and x.shape[0] < TILE_MIN_ROWS:
            return linear_q4k(w, x, out)
        w = as_q4_weight(w)
    few, many, integer = ((linear_q4, linear_q4, linear_q4_a8) if isinstance(w, Q4Weight)
                          else (linear_q6k, linear_q6k, linear_q6k_a8) if isinstance(w, Q6KWeight)   # (no tiles)
                          else (linear_q5, linear_q5, linear_q5_a8) if isinstance(w, Q5Weight)       # (no tiles)
                          else (linear_rows, linear_tiled, linear_int8_a8))
    k_quant, five_bit = isinstance(w, Q6KWeight), isinstance(w, Q5Weight)
    panels = (PANELS_FOR_INT8 if isinstance(w, INT8) else PANELS_FOR_FP32 if isinstance(w, Float32Weight)
              else not (k_quant or five_bit))
    if x.shape[0] >= PANEL_MIN_ROWS and panels:
        many = linear_panels                                 # a prompt chunk (fp32, int8: only without AVX-512)
    rounded = int8_inputs and isinstance(w, QUANTIZED)
    tiles_from = integer_tiles_from(w)
    row_dots_below = tiles_from if intdot.USE_INT_DOTS else TILE_MIN_ROWS
    if rounded and x.shape[0] < row_dots_below:                          # a few rows: integer dot products
        integer(w, x, out, int_dots)
    elif rounded and intdot.USE_INT_DOTS and x.shape[0] >= tiles_from and x.shape[1] % BLOCK == 0 and not k_quant:
        (linear_q5_panels if five_bit else linear_integer_panels)(w, x, out)   # many rows: integer tiles
    else:                                                                # float kernels (on the rounded rows)
        (few if x.shape[0] < TILE_MIN_ROWS else many)(w, round_rows(x) if rounded else x, out)


@overload(linear_into, jit_options=dict(fastmath=True, nogil=True, error_model="numpy"), prefer_literal=True)
def _linear_into_typed(w, x, out, int8_inputs, int_dots):
    if typed_as(w, Q4Weight):                                           # 4-bit: one kernel for any M
        few, many, integer = linear_q4, linear_q4, linear_q4_a8
    elif typed_as(w, Q4KWeight):                                        # Q4_K: the same, on its super-blocks
        few, many, integer = linear_q4k, linear_q4k, linear_q4k_a8
    elif typed_as(w, Q6KWeight):                                        # Q6_K: the same
        few, many, integer = linear_q6k, linear_q6k, linear_q6k_a8
    elif typed_as(w, Q5Weight):                                         # Q5_0: the same
        few, many, integer = linear_q5, linear_q5, linear_q5_a8
    else:                                                                # fp32, int8, int8-block
        few, many, integer = linear_rows, linear_tiled, linear_int8_a8

    def floats(w, x, out, int8_inputs, int_dots):                        # fp32 weights: the inputs as they are
        if x.shape[0] < TILE_MIN_ROWS:
            few(w, x, out)
        else:
            many(w, x, out)

    row_dots_below = (Q4_INTEGER_TILES_FROM if typed_as(w, (Q4Weight, Q4KWeight, Q5Weight, Q6KWeight))
                      else INTEGER_TILES_FROM if intdot.USE_INT_DOTS else TILE_MIN_ROWS)

    def rounded(w, x, out, int8_inputs, int_dots):                       # quantized weights, int8 activations
        if x.shape[0] < row_dots_below:
            integer(w, x, out, int_dots)
        else:
            many(w, round_rows(x), out)

    # The activations setting is a constant of the caller (block.py compiles one block per setting), so a block
    # compiles only its own setting's kernels.
    setting = getattr(int8_inputs, "literal_value", None)
    if setting is None:
        raise TypingError("linear_into: int8_inputs must be a compile-time constant in compiled code")
    return rounded if setting and typed_as(w, QUANTIZED) else floats


@njit(fastmath=True, cache=True, inline="always")
def thread_share(n_items, tid, n):
    """Thread tid's contiguous share of n_items (tasks, chunks or heads) split between n threads -> (first,
    end)."""
    return n_items * tid // n, n_items * (tid + 1) // n


def linear_share(w, x, out, int8_inputs: bool, int_dots: bool, tid: int, n: int) -> None:
    """Thread tid of n's share of linear_into(w, x, out) for M < TILE_MIN_ROWS rows: its contiguous run of the
    kernel's tasks (OUT_BLOCK weight rows each), after preparing the input as the kernel does (every thread
    prepares its own copy: microseconds, no waiting). Each task is computed by the very function the kernel's
    parallel loop calls, so the result is bit for bit linear_into's. For block.py's threaded block."""
    O = w[0].shape[0]
    first, end = thread_share(n_tasks(O), tid, n)
    four_bit, int8, six_bit = isinstance(w, Q4Weight), isinstance(w, INT8), isinstance(w, Q6KWeight)
    five_bit, k_four_bit = isinstance(w, Q5Weight), isinstance(w, Q4KWeight)
    if int8_inputs and (four_bit or five_bit or k_four_bit):
        xq, _, xs = quantize_rows(x)
        xg, scales, sums = q4_inputs(xq, xs, int_dots)
    elif int8_inputs and (int8 or six_bit):
        xq, xstart, xs = quantize_rows(x)
    elif four_bit or k_four_bit:
        xlo, xhi, xsum = split_halves(x, w[1].shape[1])
    for task in range(first, end):
        o0, o1 = task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK)
        if int8_inputs and four_bit:
            q4_a8_task(w, xq, xs, xg, scales, sums, out, o0, o1, int_dots)
        elif int8_inputs and five_bit:
            q5_a8_task(w, xq, xs, xg, scales, sums, out, o0, o1, int_dots)
        elif int8_inputs and k_four_bit:
            q4k_a8_task(w, xq, xs, xg, scales, sums, out, o0, o1, int_dots)
        elif int8_inputs and int8:
            int8_a8_task(w, xq, xstart, xs, out, o0, o1, int_dots)
        elif int8_inputs and six_bit:
            q6k_a8_task(w, xq, xstart, xs, out, o0, o1, int_dots)
        elif four_bit:
            q4_rows_task(w, xlo, xhi, xsum, out, o0, o1, 0)
        elif k_four_bit:
            q4k_rows_task(w, xlo, xhi, xsum, out, o0, o1)
        elif six_bit:
            q6k_rows_task(w, x, out, o0, o1)
        elif five_bit:
            q5_rows_task(w, x, out, o0, o1)
        else:
            rows_task(w, x, out, o0, o1)


@njit(fastmath=True, cache=True, inline="always")
def _tasks_of_thread(w, tid, n):
    """-> (w's row count, thread tid's first task, its end)"""
    O = w[0].shape[0]
    first, end = thread_share(n_tasks(O), tid, n)
    return O, first, end


@overload(linear_share, jit_options=dict(fastmath=True, nogil=True, error_model="numpy"), prefer_literal=True)
def _linear_share_typed(w, x, out, int8_inputs, int_dots, tid, n):
    setting = getattr(int8_inputs, "literal_value", None)
    if setting is None:
        raise TypingError("linear_share: int8_inputs must be a compile-time constant in compiled code")
    four_bit, rounded = typed_as(w, Q4Weight), setting and typed_as(w, QUANTIZED)
    tasks = _tasks_of_thread
    if rounded and four_bit:
        def q4_a8(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            xq, _, xs = quantize_rows(x)
            xg, scales, sums = q4_inputs(xq, xs, int_dots)
            for task in range(first, end):
                q4_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK),
                           int_dots)
        return q4_a8
    if typed_as(w, Q4KWeight):
        def q4k(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            if rounded:
                xq, _, xs = quantize_rows(x)
                xg, scales, sums = q4_inputs(xq, xs, int_dots)
                for task in range(first, end):
                    q4k_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK,
                                min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)
            else:
                xlo, xhi, xsum = split_halves(x, w[1].shape[1])
                for task in range(first, end):
                    q4k_rows_task(w, xlo, xhi, xsum, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))
        return q4k
    if typed_as(w, Q5Weight):
        def q5(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            if rounded:
                xq, _, xs = quantize_rows(x)
                xg, scales, sums = q4_inputs(xq, xs, int_dots)
                for task in range(first, end):
                    q5_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK,
                               min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)
            else:
                for task in range(first, end):
                    q5_rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))
        return q5
    if typed_as(w, Q6KWeight):
        def q6k(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            if rounded:
                xq, xstart, xs = quantize_rows(x)
                for task in range(first, end):
                    q6k_a8_task(w, xq, xstart, xs, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK),
                                int_dots)
            else:
                for task in range(first, end):
                    q6k_rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))
        return q6k
    if rounded:
        def int8_a8(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            xq, xstart, xs = quantize_rows(x)
            for task in range(first, end):
                int8_a8_task(w, xq, xstart, xs, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)
        return int8_a8
    if four_bit:
        def q4(w, x, out, int8_inputs, int_dots, tid, n):
            O, first, end = tasks(w, tid, n)
            xlo, xhi, xsum = split_halves(x, w.d.shape[1])
            for task in range(first, end):
                q4_rows_task(w, xlo, xhi, xsum, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), 0)
        return q4

    def rows(w, x, out, int8_inputs, int_dots, tid, n):                  # fp32, int8, int8-block: float inputs
        O, first, end = tasks(w, tid, n)
        for task in range(first, end):
            rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))
    return rows


def linear(x: np.ndarray, w, b: np.ndarray | None = None, int8_inputs: bool = False) -> np.ndarray:
    """The fast twin of ops.linear: x [M, I] times w (float32 array or a quantized weight) -> [M, O]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[0] > SMALL_M:
        return blas.linear(x, w, b, int8_inputs)
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)        # [M, O]
    weight = kernel_weight(w)
    linear_into(weight, x, out, int8_inputs and not isinstance(weight, Float32Weight), intdot.USE_INT_DOTS)
    return out if b is None else out + b


# --- attention --------------------------------------------------------------------------------------------------
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Twin of ops.attention. q [T, H, Dh], k, v [S, KVH, Dh] in any stored format (kv_cache.py) -> [T, H*Dh]."""
    T, H, Dh = q.shape
    if T > SMALL_M:
        return NumpyOps.attention(q, k, v, start)
    out = np.empty((T, H, Dh), dtype=np.float32)                              # [T, H, Dh]
    (k, ks), (v, vs) = kernel_operands(k), kernel_operands(v)                # values [S, KVH, Dh], scales or None
    # contiguous operands, one compiled version per kernel (without a cache v is a strided view of the qkv rows)
    q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    if T <= FEW_TOKENS:
        (decode_attention_one_thread if one_thread_attention else decode_attention)(
            q, k, ks, v, vs, start, out, row_shape_of(k, ks, H // k.shape[1]))
    else:
        tiled_causal_attention(q, k, ks, v, vs, start, out)
    return out.reshape(T, H * Dh)


def paged_attention(q, k_blocks, v_blocks, block_tables, context_lens) -> np.ndarray:
    """Twin of ops.paged_attention: q [B, H, Dh] against each sequence's blocks [NB, BS, KVH, Dh] (any stored
    format), read in place. -> [B, H*Dh]"""
    B, H, Dh = q.shape
    NB, BS, KVH, _ = k_blocks.shape
    out = np.empty((B, H, Dh), dtype=np.float32)                              # [B, H, Dh]
    (k, ks), (v, vs) = (kernel_operands(kv.reshape(NB * BS, KVH, Dh)) for kv in (k_blocks, v_blocks))
    paged_decode_attention(np.ascontiguousarray(q, dtype=np.float32), k, ks, v, vs, BS,
                           np.ascontiguousarray(block_tables, dtype=np.int32),
                           np.ascontiguousarray(context_lens, dtype=np.int32), out, row_shape_of(k, ks, H // KVH))
    return out.reshape(B, H * Dh)


# --- the small per-token ops -----------------------------------------------------------------------------------
def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """Twin of ops.swiglu: silu(gate) * up. [T, 2F] -> [T, F]"""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    # threads only where the linears run in Numba too: next to BLAS (more than SMALL_M rows) the pools would fight
    (swiglu_rows_into if 4 <= out.shape[0] <= SMALL_M else swiglu_into)(gate_up, out)
    return out
