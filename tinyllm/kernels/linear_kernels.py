"""Linear kernels: out[m, o] = sum_i W[o, i] * x[m, i] for a few rows of x (decode, batches, short prompts).

Why they are hot: a decode step multiplies one token's vector by every weight matrix, so its time is the time to
stream the weights from memory. These kernels read the stored bytes (fp32, int8 or packed 4-bit) and dequantize in
registers, never building an fp32 copy of a weight; output rows are independent dot products spread over the cores.

A weight comes in as the tuple of its arrays (`weight_arrays`): (w,) fp32, (q, scale [O]) int8 per row,
(q, scale [O, I/32]) int8 per block, (packed, d, m) 4-bit. Two kernel families by input:
  * float inputs: `linear_rows` / `linear_tiled` (fp32 and both int8 formats: the format is picked when they
    compile) and `linear_q4`; for a prompt chunk, `linear_panels` (any format: rows dequantized once, the
    products in register tiles);
  * inputs rounded to int8 blocks: `linear_int8_a8` and `linear_q4_a8`, whose per-row dot products are the
    integer ones of intdot.py; for a prompt chunk, `linear_integer_panels` (int8_tiles.py's integer register
    tiles).
Which kernel runs for how many rows is decided in dispatch.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from ..quant import BLOCK
from .int8_tiles import PANEL_ROWS as INT8_PANEL_ROWS
from .int8_tiles import TILE_COLS, int8_tile, pack_panel, pack_q4_panel
from .intdot import (Q4_BY_BLOCKS, dot_int8, dot_int8_block, dot_int8_block_reference, dot_int8_reference, dot_q4,
                     dot_q4_blocks, dot_q4_reference, q4_group)
from .numerics import EXACT_PER_VALUE, PARALLEL, SERIAL
from .register_tiles import LANES, WIDE, product

# Work is split over the cores by blocks of OUT_BLOCK weight rows; a block's rows stay in cache while every input
# row passes over them, so a batch of M rows costs about one read of the weights.
OUT_BLOCK = 16
# From this many input rows on, the 8-bit family works in 4 x 4 tiles (16 sums in registers: each loaded weight
# feeds 4 multiply-adds). Below it one weight row streams at a time, reused from L1 for the few input rows, which
# keeps the read of the weights sequential (RESULTS.md, "Kernel design measurements").
TILE_MIN_ROWS = 8


@njit(fastmath=True, cache=True, inline="always")
def n_tasks(O):
    """How many tasks of OUT_BLOCK weight rows cover O rows (the last may be short). The kernels below for fewer
    than TILE_MIN_ROWS input rows are each a preparation of the input and then a `*_task` function per task,
    which is what the threaded block (block.py) calls too, for its share of the tasks."""
    return (O + OUT_BLOCK - 1) // OUT_BLOCK


def weight_arrays(w) -> tuple:
    """A weight (a float32 array or a quant.QuantizedWeight) as the tuple of arrays the compiled code takes."""
    return (w,) if isinstance(w, np.ndarray) else w.arrays


# --- the 8-bit family: what differs between fp32, int8 per row and int8 per block ----------------------------
# Each helper below is written twice: its Python body runs under NUMBA_DISABLE_JIT=1, and its @overload is the
# version compiled code calls, specialised to the weight's format when the kernel compiles.
def _weight(w, o, i):
    """W[o, i] as float32, before the row's scale (`_row_scale`)."""
    if len(w) == 1:
        return w[0][o, i]
    return np.float32(w[0][o, i]) if w[1].ndim == 1 else w[1][o, i >> 5] * np.float32(w[0][o, i])


def _row_scale(w, o):
    """The factor every dot product of row o is multiplied by at the end."""
    return w[1][o] if len(w) == 2 and w[1].ndim == 1 else np.float32(1.0)


@overload(_weight, inline="always")
def _weight_typed(w, o, i):
    if len(w.types) == 1:                                               # fp32
        return lambda w, o, i: w[0][o, i]
    if w.types[1].ndim == 1:                                            # int8, one scale per row
        return lambda w, o, i: np.float32(w[0][o, i])
    return lambda w, o, i: w[1][o, i >> 5] * np.float32(w[0][o, i])    # int8, one scale per block of 32


@overload(_row_scale, inline="always")
def _row_scale_typed(w, o):
    if len(w.types) == 2 and w.types[1].ndim == 1:
        return lambda w, o: w[1][o]
    return lambda w, o: np.float32(1.0)


@njit(fastmath=True, cache=True, inline="always")
def _rows_from(w, x, out, o, m):
    """out[m:, o]: weight row o against input rows m .. M-1, two at a time (the second reads the row from L1)."""
    M, I = x.shape
    s = _row_scale(w, o)
    while m + 2 <= M:
        a0 = a1 = np.float32(0.0)
        for i in range(I):
            wi = _weight(w, o, i)
            a0 += wi * x[m, i]
            a1 += wi * x[m + 1, i]
        out[m, o], out[m + 1, o] = a0 * s, a1 * s
        m += 2
    if m < M:
        acc = np.float32(0.0)
        for i in range(I):
            acc += _weight(w, o, i) * x[m, i]
        out[m, o] = acc * s


@njit(**SERIAL)
def rows_task(w, x, out, o0, o1):
    """linear_rows' task: out[:, o0:o1], weight rows o0 .. o1-1 in turn."""
    for o in range(o0, o1):
        _rows_from(w, x, out, o, 0)


@njit(**PARALLEL)
def linear_rows(w, x, out):
    """w: an fp32, int8 or int8-block [O, I] weight's arrays; x [M, I] -> out [M, O], for M < TILE_MIN_ROWS: one
    weight row at a time, streamed from memory once for all the input rows; tasks of OUT_BLOCK rows."""
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))


@njit(**PARALLEL)
def linear_tiled(w, x, out):
    """The same for M >= TILE_MIN_ROWS, in 4 x 4 tiles (4 weight rows x 4 input rows) within blocks of OUT_BLOCK
    weight rows; the rows no tile covers as in linear_rows."""
    O, I = w[0].shape
    M = x.shape[0]
    M4 = M - M % 4                                              # input rows covered by tiles
    for blk in prange((O + OUT_BLOCK - 1) // OUT_BLOCK):
        o0 = blk * OUT_BLOCK
        o1 = min(O, o0 + OUT_BLOCK)
        o4 = o0 + (o1 - o0) // 4 * 4
        for m in range(0, M4, 4):                               # 4 x 4 tiles
            for o in range(o0, o4, 4):
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
                a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
                for i in range(I):
                    x0, x1, x2, x3 = x[m, i], x[m + 1, i], x[m + 2, i], x[m + 3, i]
                    w0, w1 = _weight(w, o, i), _weight(w, o + 1, i)
                    w2, w3 = _weight(w, o + 2, i), _weight(w, o + 3, i)
                    a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2; a03 += w0 * x3      # noqa: E702
                    a10 += w1 * x0; a11 += w1 * x1; a12 += w1 * x2; a13 += w1 * x3      # noqa: E702
                    a20 += w2 * x0; a21 += w2 * x1; a22 += w2 * x2; a23 += w2 * x3      # noqa: E702
                    a30 += w3 * x0; a31 += w3 * x1; a32 += w3 * x2; a33 += w3 * x3      # noqa: E702
                s0, s1, s2, s3 = _row_scale(w, o), _row_scale(w, o + 1), _row_scale(w, o + 2), _row_scale(w, o + 3)
                out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00 * s0, a01 * s0, a02 * s0, a03 * s0
                out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1] = a10 * s1, a11 * s1, a12 * s1
                out[m + 3, o + 1], out[m, o + 2], out[m + 1, o + 2] = a13 * s1, a20 * s2, a21 * s2
                out[m + 2, o + 2], out[m + 3, o + 2], out[m, o + 3] = a22 * s2, a23 * s2, a30 * s3
                out[m + 1, o + 3], out[m + 2, o + 3], out[m + 3, o + 3] = a31 * s3, a32 * s3, a33 * s3
        for o in range(o0, o1):                                 # what no tile covered
            _rows_from(w, x, out, o, M4 if o < o4 else 0)


# --- 4-bit weights, float inputs --------------------------------------------------------------------------------
@njit(fastmath=True, cache=True, inline="always")
def _nibbles(byte):
    """A packed byte -> its (low, high) 4-bit values as floats. In float arithmetic: Numba widens integer shifts
    on uint8 to 64-bit lanes, which halves the vector width."""
    f = np.float32(byte)
    hi = np.floor(f * np.float32(0.0625))
    return f - np.float32(16.0) * hi, hi


@njit(**PARALLEL)
def linear_q4(w, x, out):
    """w = (packed [O, I/2] uint8 in Q4_1 nibble order, d, mins [O, I/32]); x [M, I] -> out [M, O].

    Two rearrangements keep the inner loop a plain contiguous multiply-add:
      * sum_j (d*q_j + m) * x_j = d * sum_j q_j x_j + m * sum_j x_j: the block sums of x are computed once per
        input row (xsum), not once per weight row;
      * byte k of block b holds values 32b+k (low nibble) and 32b+16+k (high): x is split once into
        xlo[16b+k] = x[32b+k] and xhi[16b+k] = x[32b+16+k], which line up with byte 16b+k.
    From TILE_MIN_ROWS rows on, tiles of 2 weight rows x 4 input rows (4 x 4 runs out of registers).
    """
    packed, d, mins = w
    O, half = packed.shape
    M = x.shape[0]
    nb = half // 16
    xlo, xhi, xsum = split_halves(x, nb)
    M4 = M - M % 4 if M >= TILE_MIN_ROWS else 0                 # input rows covered by tiles
    for blk in prange(n_tasks(O)):
        o0 = blk * OUT_BLOCK
        o1 = min(O, o0 + OUT_BLOCK)
        o2 = o0 + (o1 - o0) // 2 * 2
        for m in range(0, M4, 4):
            for o in range(o0, o2, 2):
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
                for i in range(half):
                    lo0, hi0 = _nibbles(packed[o, i])
                    lo1, hi1 = _nibbles(packed[o + 1, i])
                    d0, d1 = d[o, i >> 4], d[o + 1, i >> 4]
                    lo0, hi0, lo1, hi1 = d0 * lo0, d0 * hi0, d1 * lo1, d1 * hi1     # the weights, minus m
                    a00 += lo0 * xlo[m, i] + hi0 * xhi[m, i]
                    a01 += lo0 * xlo[m + 1, i] + hi0 * xhi[m + 1, i]
                    a02 += lo0 * xlo[m + 2, i] + hi0 * xhi[m + 2, i]
                    a03 += lo0 * xlo[m + 3, i] + hi0 * xhi[m + 3, i]
                    a10 += lo1 * xlo[m, i] + hi1 * xhi[m, i]
                    a11 += lo1 * xlo[m + 1, i] + hi1 * xhi[m + 1, i]
                    a12 += lo1 * xlo[m + 2, i] + hi1 * xhi[m + 2, i]
                    a13 += lo1 * xlo[m + 3, i] + hi1 * xhi[m + 3, i]
                for b in range(nb):                             # the minimums' share: m * sum of x over the block
                    a00 += mins[o, b] * xsum[m, b]
                    a01 += mins[o, b] * xsum[m + 1, b]
                    a02 += mins[o, b] * xsum[m + 2, b]
                    a03 += mins[o, b] * xsum[m + 3, b]
                    a10 += mins[o + 1, b] * xsum[m, b]
                    a11 += mins[o + 1, b] * xsum[m + 1, b]
                    a12 += mins[o + 1, b] * xsum[m + 2, b]
                    a13 += mins[o + 1, b] * xsum[m + 3, b]
                out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00, a01, a02, a03
                out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1], out[m + 3, o + 1] = a10, a11, a12, a13
        q4_rows_task(w, xlo, xhi, xsum, out, o0, o2, M4)       # what no tile covered: one dot at a time
        q4_rows_task(w, xlo, xhi, xsum, out, o2, o1, 0)


@njit(fastmath=EXACT_PER_VALUE, cache=True, nogil=True, error_model="numpy")
def split_halves(x, nb):
    """linear_q4's input preparation: x [M, I] -> xlo, xhi [M, I/2] (each block's first and second 16 values)
    and xsum [M, I/32] (each block's sum, added in order: with reassociation its rounding depended on the caller,
    and the threaded block's 4-bit shares would differ from linear_q4's)."""
    M = x.shape[0]
    xlo = np.empty((M, 16 * nb), dtype=np.float32)              # [M, I/2]
    xhi = np.empty((M, 16 * nb), dtype=np.float32)              # [M, I/2]
    xsum = np.zeros((M, nb), dtype=np.float32)                  # [M, I/32]
    for m in range(M):
        for b in range(nb):
            for k in range(16):
                xlo[m, b * 16 + k] = x[m, b * 32 + k]
                xhi[m, b * 16 + k] = x[m, b * 32 + 16 + k]
                xsum[m, b] += x[m, b * 32 + k] + x[m, b * 32 + 16 + k]
    return xlo, xhi, xsum


@njit(**SERIAL)
def q4_rows_task(w, xlo, xhi, xsum, out, o0, o1, m0):
    """linear_q4's rows o0 .. o1-1 against input rows m0 .. M-1, one dot product at a time."""
    packed, d, mins = w
    half, nb = packed.shape[1], d.shape[1]
    for o in range(o0, o1):
        for m in range(m0, xlo.shape[0]):
            acc = np.float32(0.0)
            for i in range(half):
                lo, hi = _nibbles(packed[o, i])
                acc += d[o, i >> 4] * (lo * xlo[m, i] + hi * xhi[m, i])
            for b in range(nb):
                acc += mins[o, b] * xsum[m, b]
            out[m, o] = acc


# --- many rows: weight rows dequantized once, input columns in register tiles ---------------------------------
# From this many input rows on (a prompt chunk), `linear_panels` beats the tiles above: with AVX-512's wide register
# tiles for fp32 and 4-bit weights from 64 rows (int8 even: RESULTS.md, "Prefill in register tiles"); with the
# narrow tiles of a CPU without AVX-512 for every format from 32 rows (RESULTS.md, "A CPU without AVX-512")
PANEL_MIN_ROWS = 64 if WIDE else 32
PANELS_FOR_INT8 = not WIDE
PANEL_ROWS = 16   # weight rows per task: a whole 64-byte line of each of out's rows


def _dequantize_row(w, o, row):
    """row [I] <- W[o, :] as float32, before the row's scale (`_row_scale`), in any weight format."""
    if len(w) < 3:
        for i in range(row.shape[0]):
            row[i] = _weight(w, o, i)
        return
    packed, d, mins = w                                              # 4-bit: byte k of block b, both nibbles
    for b in range(d.shape[1]):
        for k in range(16):
            lo, hi = _nibbles(packed[o, 16 * b + k])
            row[32 * b + k], row[32 * b + 16 + k] = d[o, b] * lo + mins[o, b], d[o, b] * hi + mins[o, b]


@overload(_dequantize_row, inline="always")
def _dequantize_row_typed(w, o, row):
    if len(w.types) == 1 or w.types[1].ndim == 1:                      # fp32, int8 with one scale per row
        def each(w, o, row):
            for i in range(row.shape[0]):
                row[i] = _weight(w, o, i)
        return each
    if len(w.types) == 2:                                               # int8, one scale per block of 32
        def per_block(w, o, row):
            for b in range(w[1].shape[1]):
                s = w[1][o, b]
                for i in range(BLOCK * b, BLOCK * b + BLOCK):
                    row[i] = s * np.float32(w[0][o, i])
        return per_block

    def four_bit(w, o, row):
        packed, d, mins = w
        for b in range(d.shape[1]):
            scale, low = d[o, b], mins[o, b]
            for k in range(16):
                lo, hi = _nibbles(packed[o, 16 * b + k])
                row[32 * b + k] = scale * lo + low
                row[32 * b + 16 + k] = scale * hi + low
    return four_bit


@njit(**PARALLEL)
def linear_panels(w, x, out):
    """out [M, O] = x [M, I] times W^T for a prompt chunk's M rows, in any weight format (w: its arrays).

    The product is taken transposed, out^T = W . x^T, so that it runs as register_tiles' tiles with no weight
    ever transposed: x^T [I, M16] is made once per call (M rounded up to whole 16-float vectors, zeros past M);
    then, per task, PANEL_ROWS weight rows are dequantized once into a float32 scratch [PANEL_ROWS, I] and
    multiplied by every column of x^T, each weight value broadcast against 16 input rows at a time with the sums
    in registers; the [PANEL_ROWS, M16] result is written into out's columns. The 4 x 4 tiles of
    linear_tiled instead convert each weight once per 4 input rows and end each dot product with a sum across
    a vector's lanes."""
    M, I = x.shape
    O = out.shape[1]
    M16 = (M + LANES - 1) // LANES * LANES
    xt = np.empty((I, M16), dtype=np.float32)                   # [I, M16] the input rows as columns
    for i0 in prange((I + LANES - 1) // LANES):
        for i in range(LANES * i0, min(I, LANES * i0 + LANES)):  # (written along its rows: reads are cheaper)
            for m in range(M):
                xt[i, m] = x[m, i]
            for m in range(M, M16):
                xt[i, m] = 0.0
    for task in prange((O + PANEL_ROWS - 1) // PANEL_ROWS):
        o0 = task * PANEL_ROWS
        n = min(O, o0 + PANEL_ROWS) - o0                        # weight rows of this task (the last may be short)
        rows = np.empty((PANEL_ROWS, I), dtype=np.float32)      # [16, I] W[o0:o0+n], dequantized
        for r in range(n):
            _dequantize_row(w, o0 + r, rows[r])
        for r in range(n, PANEL_ROWS):
            for i in range(I):
                rows[r, i] = 0.0
        tile = np.empty((PANEL_ROWS, M16), dtype=np.float32)    # [16, M16] = rows . x^T
        product(rows, xt, tile, False)
        for m in range(M):                                      # along out's rows (down its columns, each
            for r in range(n):                                  # write missed L1: rows 12 KiB apart at O = 3072)
                out[m, o0 + r] = tile[r, m] * _row_scale(w, o0 + r)


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
    xq = np.empty((M, I), np.int8)
    xstart = np.empty((M, I // BLOCK * (BLOCK // 4)), np.int32)
    xs = np.empty((M, nb), np.float32)
    v = np.empty(BLOCK, np.float32)
    for m in range(M):
        for b in range(nb):
            i0 = b * BLOCK
            n = min(I - i0, BLOCK)
            amax = np.float32(0.0)
            for j in range(n):
                amax = max(amax, abs(x[m, i0 + j]))
            s = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
            for j in range(n):                          # simple loops, so that each one vectorises
                v[j] = min(max(np.rint(x[m, i0 + j] / s), np.float32(-127.0)), np.float32(127.0))
            for j in range(n):
                xq[m, i0 + j] = np.int8(v[j])
            if n == BLOCK:
                for lane in range(BLOCK // 4):
                    xstart[m, b * (BLOCK // 4) + lane] = np.int32(-128) * np.int32(
                        v[4 * lane] + v[4 * lane + 1] + v[4 * lane + 2] + v[4 * lane + 3])
            xs[m, b] = s
    return xq, xstart, xs


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
    """Row o of an int8 weight (w = (q, scale)) times one rounded input row, scales applied (Python body: the
    reference dot products, as a CPU without VNNI or AVX2 runs them)."""
    if w[1].ndim == 2:
        return dot_int8_block_reference(w[0], o, w[1], xq, xstart, xs)
    return (dot_int8_reference(w[0], o, xq, xstart, xs) + _int8_short_block(w[0], o, xq, xs)) * w[1][o]


@overload(_int8_row_dot, inline="always")
def _int8_row_dot_typed(w, o, xq, xstart, xs, int_dots):
    if w.types[1].ndim == 2:                                            # one scale per block
        def per_block(w, o, xq, xstart, xs, int_dots):
            if int_dots:
                return dot_int8_block(w[0], o, w[1], xq, xstart, xs)
            return dot_int8_block_reference(w[0], o, w[1], xq, xstart, xs)
        return per_block

    def per_row(w, o, xq, xstart, xs, int_dots):                       # one scale per row; any width
        short = w[0].shape[1] % BLOCK != 0                              # (returns only: no merged variables)
        if int_dots and short:
            return (dot_int8(w[0], o, xq, xstart, xs) + _int8_short_block(w[0], o, xq, xs)) * w[1][o]
        if int_dots:
            return dot_int8(w[0], o, xq, xstart, xs) * w[1][o]
        if short:
            return (dot_int8_reference(w[0], o, xq, xstart, xs) + _int8_short_block(w[0], o, xq, xs)) * w[1][o]
        return dot_int8_reference(w[0], o, xq, xstart, xs) * w[1][o]
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
    """w = (q [O, I] int8, scale [O] or [O, I/32]); x [M, I] is rounded to int8 blocks here -> out [M, O], each
    dot product in integers (intdot's VNNI or AVX2 versions if int_dots, else their reference bodies)."""
    xq, xstart, xs = quantize_rows(x)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        int8_a8_task(w, xq, xstart, xs, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)


@njit(**PARALLEL)
def tile_inputs(x, cols):
    """linear_integer_panels' input preparation: x [M, I] rounded to int8 blocks as int8_tiles.py reads them, in
    whole tiles of `cols` rows (zero rows past M) -> xq [M', I] int8, xcorr [M', I/32] int32 (-128 times each
    block's sum), xs [M', I/32] block scales, xsum [M', I/32] (each block's sum times its scale)."""
    M, I = x.shape
    n_blocks = I // BLOCK
    padded = (M + cols - 1) // cols * cols
    xq = np.zeros((padded, I), np.int8)                        # [M', I]
    xcorr = np.zeros((padded, n_blocks), np.int32)             # [M', I/32]
    xs = np.zeros((padded, n_blocks), np.float32)              # [M', I/32]
    xsum = np.zeros((padded, n_blocks), np.float32)            # [M', I/32]
    for m in prange(M):
        q_m, _, s_m = quantize_rows(x[m:m + 1])
        for b in range(n_blocks):
            total = 0
            for j in range(BLOCK * b, BLOCK * b + BLOCK):
                xq[m, j] = q_m[0, j]
                total += np.int32(q_m[0, j])
            xcorr[m, b] = -128 * total
            xs[m, b] = s_m[0, b]
            xsum[m, b] = np.float32(total) * s_m[0, b]
    return xq, xcorr, xs, xsum


@njit(fastmath=True, cache=True, inline="always")
def _tiles_of_panel(panel, scales, minimums, xq, xcorr, xs, xsum, out, o0, with_minimums):
    """out[:, o0:o0+16] from one panel, TILE_COLS input rows at a time: straight into out where a tile lies
    wholly inside it, else through a scratch tile."""
    M, O = out.shape
    n = min(O, o0 + INT8_PANEL_ROWS) - o0
    for c0 in range(0, xq.shape[0], TILE_COLS):
        inside = n == INT8_PANEL_ROWS and c0 + TILE_COLS <= M
        dest, m0, d0 = ((out, c0, o0) if inside                   # else a scratch [cols, 16] tile, copied after
                        else (np.empty((TILE_COLS, INT8_PANEL_ROWS), np.float32), 0, 0))
        if with_minimums:                                          # (constants: one tile body each)
            int8_tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, dest, m0, d0, TILE_COLS, True)
        else:
            int8_tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, dest, m0, d0, TILE_COLS, False)
        if not inside:
            for m in range(c0, min(M, c0 + TILE_COLS)):
                for r in range(n):
                    out[m, o0 + r] = dest[m - c0, r]


@njit(**PARALLEL)
def int8_panels_into(w, xq, xcorr, xs, xsum, out):
    """out [M, O] from tile_inputs' rounded rows (M <= their padded count) and an int8 weight w = (q [O, I],
    scale [O] or [O, I/32]): per task of 16 weight rows the rows are interleaved into a panel once, then every
    input row meets it TILE_COLS at a time."""
    O = out.shape[1]
    I = xq.shape[1]
    q, s = w[0], w[1].reshape(O, -1)                           # s [O, 1] or [O, I/32]
    for task in prange((O + INT8_PANEL_ROWS - 1) // INT8_PANEL_ROWS):
        o0 = task * INT8_PANEL_ROWS
        panel = np.empty((I // 4, 4 * INT8_PANEL_ROWS), np.int8)     # [I/4, 64] 16 rows, 4 bytes at a time
        scales = np.empty((I // BLOCK, INT8_PANEL_ROWS), np.float32)  # [I/32, 16]
        pack_panel(q, s, o0, panel, scales)
        _tiles_of_panel(panel, scales, scales, xq, xcorr, xs, xsum, out, o0, False)


@njit(**PARALLEL)
def q4_panels_into(w, xq, xcorr, xs, xsum, out):
    """The same for a 4-bit weight w = (packed [O, I/2], d, mins [O, I/32]): each panel holds the 4-bit values
    (0..15) as int8, and the tile adds the blocks' minimums times the inputs' block sums."""
    packed, d, mins = w
    O = out.shape[1]
    I = xq.shape[1]
    for task in prange((O + INT8_PANEL_ROWS - 1) // INT8_PANEL_ROWS):
        o0 = task * INT8_PANEL_ROWS
        values = np.empty((INT8_PANEL_ROWS, I), np.int8)             # [16, I] the rows' 4-bit values
        panel = np.empty((I // 4, 4 * INT8_PANEL_ROWS), np.int8)     # [I/4, 64]
        scales = np.empty((I // BLOCK, INT8_PANEL_ROWS), np.float32)  # [I/32, 16]
        minimums = np.empty((I // BLOCK, INT8_PANEL_ROWS), np.float32)
        pack_q4_panel(packed, d, mins, o0, values, panel, scales, minimums)
        _tiles_of_panel(panel, scales, minimums, xq, xcorr, xs, xsum, out, o0, True)


def linear_integer_panels(w, x, out):
    """w = an int8 (q [O, I], scale [O] or [O, I/32]) or 4-bit (packed, d, mins) weight's arrays, I a multiple of
    32; x [M, I] -> out [M, O]: a prompt chunk rounded to int8 blocks and multiplied in int8_tiles.py's integer
    register tiles (VNNI only)."""
    (q4_panels_into if len(w) == 3 else int8_panels_into)(w, *tile_inputs(x, TILE_COLS), out)


@njit(**SERIAL)
def _group_layout(xq, xs, per_lane):
    """What the 4-bit dots read, per rounded input row (see intdot.py) -> (xg, scales, sums). xg [M, I]: the values
    of each group of blocks (intdot.q4_group), reordered as the nibbles of the group's bytes (an odd last block as it
    is). per_lane (dot_q4 and its reference body): scales and sums [M, 4 * the even block count], each lane's block
    scale and the sum of the 8 values the lane multiplies, times that scale; else (dot_q4_blocks): xs itself and
    [M, blocks] each block's sum times its scale."""
    M, nb = xs.shape
    n_even = nb - nb % 2
    xg = xq.copy()                                                  # [M, I]
    lanes = 4 if per_lane else 1
    scales = np.empty((M, 4 * n_even), np.float32) if per_lane else xs   # [M, 4 * blocks] or [M, blocks]
    sums = np.empty((M, lanes * n_even), np.float32)                # [M, 4 * blocks] or [M, blocks]
    for m in range(M):
        for b in range(n_even):
            first, size = q4_group(b, nb)
            low = BLOCK * first + 16 * (b - first)
            for j in range(16):
                xg[m, low + j] = xq[m, BLOCK * b + j]
                xg[m, low + 16 * size + j] = xq[m, BLOCK * b + 16 + j]
            for lane in range(lanes):
                s = 0
                for j in range(4 * lane, 4 * lane + 16 // lanes):
                    s += np.int32(xq[m, BLOCK * b + j]) + np.int32(xq[m, BLOCK * b + 16 + j])
                if per_lane:
                    scales[m, 4 * b + lane] = xs[m, b]
                sums[m, lanes * b + lane] = np.float32(s) * xs[m, b]
    return xg, scales, sums


@njit(fastmath=True, cache=True, inline="always")
def q4_inputs(xq, xs, int_dots):
    """The rounded input rows laid out for the 4-bit dot that int_dots selects (_group_layout)."""
    return _group_layout(xq, xs, not (int_dots and Q4_BY_BLOCKS))


@njit(**SERIAL)
def q4_a8_task(w, xq, xs, xg, scales, sums, out, o0, o1, int_dots):
    """linear_q4_a8's task: out[:, o0:o1], from q4_inputs' layout. The 4-bit dot is called directly in the row loop,
    with each input row's views taken once per task (through an inlined helper holding both dot_q4 and its
    reference body the loop ran 1.2-1.4x slower: RESULTS.md, "The 4-bit dot product called directly"); an odd last
    block is added after."""
    packed, d, mins = w
    for m in range(xq.shape[0]):
        g, s, sm = xg[m], scales[m], sums[m]
        if int_dots and Q4_BY_BLOCKS:          # loops with a constant each, so that none carries a branch
            for o in range(o0, o1):
                out[m, o] = dot_q4_blocks(packed, o, d, mins, g, s, sm)
        elif int_dots:
            for o in range(o0, o1):
                out[m, o] = dot_q4(packed, o, d, mins, g, s, sm)
        else:
            for o in range(o0, o1):
                out[m, o] = dot_q4_reference(packed, o, d, mins, g, s, sm)
    last = xs.shape[1] - 1
    if last % 2 == 0:                          # an odd block count: the last block, in integers
        for o in range(o0, o1):
            for m in range(xq.shape[0]):
                isum, xsum = 0, 0
                for j in range(16):
                    byte = np.int32(packed[o, 16 * last + j])
                    lo, hi = np.int32(xq[m, BLOCK * last + j]), np.int32(xq[m, BLOCK * last + 16 + j])
                    isum += (byte & 15) * lo + (byte >> 4) * hi
                    xsum += lo + hi
                out[m, o] += xs[m, last] * (d[o, last] * np.float32(isum) + mins[o, last] * np.float32(xsum))


@njit(**PARALLEL)
def linear_q4_a8(w, x, out, int_dots):
    """w = (packed [O, I/2], d, mins [O, I/32]); x [M, I] is rounded to int8 blocks here -> out [M, O]."""
    xq, _, xs = quantize_rows(x)
    xg, scales, sums = q4_inputs(xq, xs, int_dots)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q4_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)
