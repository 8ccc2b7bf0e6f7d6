"""Linear kernels: out[m, o] = sum_i W[o, i] * x[m, i] for a few rows of x (decode, batches, short prompts).

Why they are hot: a decode step multiplies one token's vector by every weight matrix, so its time is the time to
stream the weights from memory. These kernels read the stored bytes (fp32, int8 or packed 4-bit) and dequantize in
registers, never building an fp32 copy of a weight; output rows are independent dot products spread over the cores.

A weight comes in as a named tuple of its arrays (weight_formats.py: Float32Weight, Int8Weight, Int8BlockWeight,
Q4Weight). The kernels, by input and by weight format:
  * float inputs: `linear_rows` / `linear_tiled` here (fp32 and both int8 formats, "the 8-bit family": the format
    is picked when they compile) and `linear_q4` (q4_kernels.py); for a prompt chunk, `linear_panels`
    (panel_kernels.py: any format, rows dequantized once, the products in register tiles);
  * inputs rounded to int8 blocks (`quantize_rows`, here): `linear_int8_a8` here and `linear_q4_a8`
    (q4_kernels.py), whose per-row dot products are the integer ones of intdot.py; for a prompt chunk,
    `linear_integer_panels` (panel_kernels.py: int8_tiles.py's integer register tiles).
This file holds what they share (the split of the work into tasks, the rounding of the inputs) and the 8-bit family.
Which kernel runs for how many rows is decided in dispatch.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from ..quant import BLOCK
from .dot_tiles import DOT_INPUTS, DOT_ROWS, dot_tile
from .intdot import dot_int8, dot_int8_block, dot_int8_block_reference, dot_int8_reference
from .numerics import PARALLEL, SERIAL
from .weight_formats import Float32Weight, Int8BlockWeight, Int8Weight, typed_as


# Work is split over the cores by blocks of OUT_BLOCK weight rows; a block's rows stay in cache while every input
# row passes over them, so a batch of M rows costs about one read of the weights.
OUT_BLOCK = 16
# From this many input rows on, the 8-bit family works in 4 x 4 tiles (16 sums in registers: each loaded weight
# feeds 4 multiply-adds). Below it one weight row streams at a time, reused from L1 for the few input rows, which
# keeps the read of the weights sequential (docs/design/kernels.md, "Linear layers").
TILE_MIN_ROWS = 8


@njit(fastmath=True, cache=True, inline="always")
def n_tasks(O):
    """How many tasks of OUT_BLOCK weight rows cover O rows (the last may be short). The kernels below for fewer
    than TILE_MIN_ROWS input rows are each a preparation of the input and then a `*_task` function per task,
    which is what the threaded block (block.py) calls too, for its share of the tasks."""
    return (O + OUT_BLOCK - 1) // OUT_BLOCK


# --- the 8-bit family: what differs between fp32, int8 per row and int8 per block ----------------------------
# Each helper below is written twice: its Python body runs under NUMBA_DISABLE_JIT=1, and its @overload is the
# version compiled code calls, specialised to the weight's format when the kernel compiles.
def weight_at(w, o, i):
    """W[o, i] as float32, before the row's scale (`row_scale`)."""
    if isinstance(w, Float32Weight):
        return w.w[o, i]
    return np.float32(w.q[o, i]) if isinstance(w, Int8Weight) else w.scale[o, i >> 5] * np.float32(w.q[o, i])


def row_scale(w, o):
    """The factor every dot product of row o is multiplied by at the end."""
    return w.scale[o] if isinstance(w, Int8Weight) else np.float32(1.0)


@overload(weight_at, inline="always")
def _weight_at_typed(w, o, i):
    if typed_as(w, Float32Weight):
        return lambda w, o, i: w.w[o, i]
    if typed_as(w, Int8Weight):                                          # one scale per row
        return lambda w, o, i: np.float32(w.q[o, i])
    if typed_as(w, Int8BlockWeight):                                     # one scale per block of 32
        return lambda w, o, i: w.scale[o, i >> 5] * np.float32(w.q[o, i])


@overload(row_scale, inline="always")
def _row_scale_typed(w, o):
    if typed_as(w, Int8Weight):
        return lambda w, o: w.scale[o]
    return lambda w, o: np.float32(1.0)


@njit(fastmath=True, cache=True, inline="always")
def _rows_from(w, x, out, o, m):
    """out[m:, o]: weight row o against input rows m .. M-1, two at a time (the second reads the row from L1)."""
    M, I = x.shape
    s = row_scale(w, o)
    while m + 2 <= M:
        a0 = a1 = np.float32(0.0)
        for i in range(I):
            wi = weight_at(w, o, i)
            a0 += wi * x[m, i]
            a1 += wi * x[m + 1, i]
        out[m, o], out[m + 1, o] = a0 * s, a1 * s
        m += 2
    if m < M:
        acc = np.float32(0.0)
        for i in range(I):
            acc += weight_at(w, o, i) * x[m, i]
        out[m, o] = acc * s


@njit(**SERIAL)
def rows_task(w, x, out, o0, o1):
    """linear_rows' task: out[:, o0:o1], weight rows o0 .. o1-1 in turn."""
    for o in range(o0, o1):
        _rows_from(w, x, out, o, 0)


@njit(**PARALLEL)
def linear_rows(w, x, out):
    """w: a Float32Weight, Int8Weight or Int8BlockWeight [O, I]; x [M, I] -> out [M, O], for M < TILE_MIN_ROWS: one
    weight row at a time, streamed from memory once for all the input rows; tasks of OUT_BLOCK rows."""
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))


@njit(**PARALLEL)
def linear_tiled(w, x, out):
    """The same for M >= TILE_MIN_ROWS, in tiles of a few weight rows x a few input rows within blocks of OUT_BLOCK
    weight rows (fp32: dot_tiles.py's, else 4 x 4 here); the rows no tile covers as in linear_rows."""
    O = w[0].shape[0]
    for blk in prange((O + OUT_BLOCK - 1) // OUT_BLOCK):
        _tiled_task(w, x, out, blk * OUT_BLOCK, min(O, blk * OUT_BLOCK + OUT_BLOCK))


def _tiled_task(w, x, out, o0, o1):
    """linear_tiled's task: out[:, o0:o1]."""
    if isinstance(w, Float32Weight):
        return _dot_tiles_task(w, x, out, o0, o1)
    return _int8_tiles_task(w, x, out, o0, o1)


@overload(_tiled_task, inline="always")
def _tiled_task_typed(w, x, out, o0, o1):
    task = _dot_tiles_task if typed_as(w, Float32Weight) else _int8_tiles_task
    return lambda w, x, out, o0, o1: task(w, x, out, o0, o1)


@njit(**SERIAL)
def _dot_tiles_task(w, x, out, o0, o1):
    """fp32: each DOT_ROWS weight rows against every DOT_INPUTS input rows in turn (the rows stay in L1)."""
    M = x.shape[0]
    m_tiled = M - M % DOT_INPUTS                                # input rows covered by tiles
    o_tiled = o0 + (o1 - o0) // DOT_ROWS * DOT_ROWS             # weight rows covered by tiles
    for o in range(o0, o_tiled, DOT_ROWS):
        for m in range(0, m_tiled, DOT_INPUTS):
            dot_tile(w.w, o, x, m, out)
    for o in range(o0, o1):                                     # what no tile covered
        _rows_from(w, x, out, o, m_tiled if o < o_tiled else 0)


@njit(**SERIAL)
def _int8_tiles_task(w, x, out, o0, o1):
    """int8 weights: 4 x 4 tiles, each weight converted to float as it is read."""
    O, I = w[0].shape
    M = x.shape[0]
    M4 = M - M % 4                                              # input rows covered by tiles
    o4 = o0 + (o1 - o0) // 4 * 4
    for m in range(0, M4, 4):                                   # 4 x 4 tiles
        for o in range(o0, o4, 4):
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
            for i in range(I):
                x0, x1, x2, x3 = x[m, i], x[m + 1, i], x[m + 2, i], x[m + 3, i]
                w0, w1 = weight_at(w, o, i), weight_at(w, o + 1, i)
                w2, w3 = weight_at(w, o + 2, i), weight_at(w, o + 3, i)
                a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2; a03 += w0 * x3      # noqa: E702
                a10 += w1 * x0; a11 += w1 * x1; a12 += w1 * x2; a13 += w1 * x3      # noqa: E702
                a20 += w2 * x0; a21 += w2 * x1; a22 += w2 * x2; a23 += w2 * x3      # noqa: E702
                a30 += w3 * x0; a31 += w3 * x1; a32 += w3 * x2; a33 += w3 * x3      # noqa: E702
            s0, s1, s2, s3 = row_scale(w, o), row_scale(w, o + 1), row_scale(w, o + 2), row_scale(w, o + 3)
            out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00 * s0, a01 * s0, a02 * s0, a03 * s0
            out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1] = a10 * s1, a11 * s1, a12 * s1
            out[m + 3, o + 1], out[m, o + 2], out[m + 1, o + 2] = a13 * s1, a20 * s2, a21 * s2
            out[m + 2, o + 2], out[m + 3, o + 2], out[m, o + 3] = a22 * s2, a23 * s2, a30 * s3
            out[m + 1, o + 3], out[m + 2, o + 3], out[m + 3, o + 3] = a31 * s3, a32 * s3, a33 * s3
    for o in range(o0, o1):                                     # what no tile covered
        _rows_from(w, x, out, o, M4 if o < o4 else 0)



# --- inputs rounded to int8 blocks ------------------------------------------------------------------------------
# fastmath flags that still let max() vectorise but keep x / scale exact, so rounding matches quant.py's
_EXACT_DIVIDE = {"nnan", "ninf", "nsz"}


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True, error_model="numpy")
def quantize_rows(x):
    """x [M, I] -> (xq [M, I] int8, xstart [M, I // 32 * 8] int32, xs [M, ceil(I/32)] block scales): the twin of
    quant.quantize_activations, rounding identically. xstart, for intdot's int8 dots: over the full blocks,
    -128 times the sum of each 4 consecutive values of xq."""
    M, I = x.shape
    nb = (I + BLOCK - 1) // BLOCK
    full = I // BLOCK
    xq = np.empty((M, I), np.int8)
    xstart = np.empty((M, full * (BLOCK // 4)), np.int32)
    xs = np.empty((M, nb), np.float32)
    for m in range(M):
        for b in range(full):                           # a constant size: loops LLVM writes out as vector code
            i0 = b * BLOCK
            xs[m, b] = s = _block_scale(_block_amax(x[m, i0:i0 + BLOCK]))
            for j in range(BLOCK):
                xq[m, i0 + j] = _rounded(x[m, i0 + j], s)
            for lane in range(BLOCK // 4):
                xstart[m, b * (BLOCK // 4) + lane] = np.int32(-128) * (
                    np.int32(xq[m, i0 + 4 * lane]) + np.int32(xq[m, i0 + 4 * lane + 1])
                    + np.int32(xq[m, i0 + 4 * lane + 2]) + np.int32(xq[m, i0 + 4 * lane + 3]))
        if nb > full:                                   # a shorter last block (I not a multiple of 32)
            i0 = full * BLOCK
            xs[m, full] = s = _block_scale(_block_amax(x[m, i0:]))
            for j in range(I - i0):
                xq[m, i0 + j] = _rounded(x[m, i0 + j], s)
    return xq, xstart, xs


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True, error_model="numpy", inline="always")
def _block_amax(values):
    """max |values|, in four running maxima (one chain of dependent max instructions took most of a block's
    time; max is exact in any order)."""
    n = values.shape[0]
    m0 = m1 = m2 = m3 = np.float32(0.0)
    for j in range(0, n - n % 4, 4):
        m0, m1 = max(m0, abs(values[j])), max(m1, abs(values[j + 1]))
        m2, m3 = max(m2, abs(values[j + 2])), max(m3, abs(values[j + 3]))
    for j in range(n - n % 4, n):
        m0 = max(m0, abs(values[j]))
    return max(max(m0, m1), max(m2, m3))


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True, error_model="numpy", inline="always")
def _block_scale(amax):
    """A block's int8 step: its largest magnitude over 127; 1 for a block of zeros."""
    return amax / np.float32(127.0) if amax > 0 else np.float32(1.0)


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True, error_model="numpy", inline="always")
def _rounded(value, s):
    """value / s to the nearest int8 level (half to even, as np.rint), clipped to +-127."""
    return np.int8(min(max(np.rint(value / s), np.float32(-127.0)), np.float32(127.0)))


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True, error_model="numpy")
def round_rows(x):
    """x [M, I] -> the rounded rows as float32 (xq * xs): what the float kernels multiply for int8 inputs."""
    xq, _, xs = quantize_rows(x)
    xr = np.empty(x.shape, np.float32)                          # [M, I]
    for m in range(x.shape[0]):
        for i in range(x.shape[1]):
            xr[m, i] = np.float32(xq[m, i]) * xs[m, i // BLOCK]
    return xr


def _int8_row_dot(w, o, xq, xstart, xs, int_dots):
    """Row o of an int8 weight (Int8Weight or Int8BlockWeight) times one rounded input row, scales applied (Python
    body: the reference dot products, as a CPU without VNNI or AVX2 runs them)."""
    if isinstance(w, Int8BlockWeight):
        return dot_int8_block_reference(w.q, o, w.scale, xq, xstart, xs)
    return (dot_int8_reference(w.q, o, xq, xstart, xs) + _int8_short_block(w.q, o, xq, xs)) * w.scale[o]


@overload(_int8_row_dot, inline="always")
def _int8_row_dot_typed(w, o, xq, xstart, xs, int_dots):
    if typed_as(w, Int8BlockWeight):
        def per_block(w, o, xq, xstart, xs, int_dots):
            if int_dots:
                return dot_int8_block(w.q, o, w.scale, xq, xstart, xs)
            return dot_int8_block_reference(w.q, o, w.scale, xq, xstart, xs)
        return per_block

    def per_row(w, o, xq, xstart, xs, int_dots):                       # Int8Weight: one scale per row; any width
        short = w.q.shape[1] % BLOCK != 0                               # (returns only: no merged variables)
        if int_dots and short:
            return (dot_int8(w.q, o, xq, xstart, xs) + _int8_short_block(w.q, o, xq, xs)) * w.scale[o]
        if int_dots:
            return dot_int8(w.q, o, xq, xstart, xs) * w.scale[o]
        if short:
            return (dot_int8_reference(w.q, o, xq, xstart, xs) + _int8_short_block(w.q, o, xq, xs)) * w.scale[o]
        return dot_int8_reference(w.q, o, xq, xstart, xs) * w.scale[o]
    return per_row


@njit(**SERIAL)
def _int8_short_block(q, o, xq, xs):
    """The last block when it is shorter than 32 (a row width not a multiple of 32), in integers, scaled."""
    I = q.shape[1]
    full = I // BLOCK * BLOCK
    tail = 0
    for i in range(full, I):
        tail += np.int64(q[o, i]) * np.int64(xq[i])
    return np.float32(tail) * xs[xs.shape[0] - 1] if full < I else np.float32(0.0)


@njit(**SERIAL)
def int8_a8_task(w, xq, xstart, xs, out, o0, o1, int_dots):
    """linear_int8_a8's task: out[:, o0:o1], each input row's views taken once for the task's rows."""
    for m in range(xq.shape[0]):
        q_m, start_m, s_m = xq[m], xstart[m], xs[m]
        if int_dots:                           # two loops with a constant each, so that neither carries a branch
            for o in range(o0, o1):
                out[m, o] = _int8_row_dot(w, o, q_m, start_m, s_m, True)
        else:
            for o in range(o0, o1):
                out[m, o] = _int8_row_dot(w, o, q_m, start_m, s_m, False)


@njit(**PARALLEL)
def linear_int8_a8(w, x, out, int_dots):
    """w: an Int8Weight or Int8BlockWeight [O, I]; x [M, I] is rounded to int8 blocks here -> out [M, O], each
    dot product in integers (intdot's VNNI or AVX2 versions if int_dots, else their reference bodies)."""
    xq, xstart, xs = quantize_rows(x)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        int8_a8_task(w, xq, xstart, xs, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)


