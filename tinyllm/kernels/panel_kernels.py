"""Linear kernels for a prompt chunk (PANEL_MIN_ROWS .. SMALL_M rows of x): each task's weight rows are prepared
once as a panel and every input row meets it in register tiles.

  * float inputs, any format: `linear_panels` dequantizes PANEL_ROWS weight rows to float32 and multiplies them
    in register_tiles.py's tiles;
  * inputs rounded to int8 blocks (VNNI or AVX2): `linear_integer_panels` interleaves 16 int8 (or 4-bit) weight
    rows into a panel and multiplies it by the rounded rows in integer tiles (int8_tiles.py, int8_tiles_avx2.py).
Left out: a few rows (linear_kernels.py, q4_kernels.py) and when a chunk comes here (dispatch.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from ..quant import BLOCK
from .int8_tiles import PANEL_ROWS as INT8_PANEL_ROWS
from .int8_tiles import pack_panel, pack_q4_panel
from .int8_tiles_avx2 import INTEGER_TILE as int8_tile
from .int8_tiles_avx2 import TILE_COLS
from .linear_kernels import quantize_rows, row_scale, weight_at
from .numerics import PARALLEL
from .q4_kernels import nibbles
from .register_tiles import LANES, WIDE, product
from .weight_formats import Float32Weight, Int8BlockWeight, Int8Weight, Q4Weight, typed_as

# --- float inputs: weight rows dequantized once, input columns in register tiles ------------------------------
# From this many input rows on (a prompt chunk, a batch of 32), `linear_panels` beats linear_kernels.py's tiles:
# with AVX-512 for 4-bit weights (int8 even; fp32's dot tiles stay ahead up to 128 rows); with the narrow tiles of
# a CPU without AVX-512 for every format (docs/design/kernels.md, "Prompt chunks")
PANEL_MIN_ROWS = 32
PANELS_FOR_INT8 = PANELS_FOR_FP32 = not WIDE
PANEL_ROWS = 16   # weight rows per task: a whole 64-byte line of each of out's rows
STRIP = 2 * LANES if WIDE else LANES   # input rows per strip of x^T: the widest tile of 8 x 2 vectors, or 6 x 1


def _dequantize_row(w, o, row):
    """row [I] <- W[o, :] as float32, before the row's scale (`row_scale`), in any weight format."""
    if not isinstance(w, Q4Weight):
        for i in range(row.shape[0]):
            row[i] = weight_at(w, o, i)
        return
    packed, d, mins = w                                              # 4-bit: byte k of block b, both nibbles
    for b in range(d.shape[1]):
        for k in range(16):
            lo, hi = nibbles(packed[o, 16 * b + k])
            row[32 * b + k], row[32 * b + 16 + k] = d[o, b] * lo + mins[o, b], d[o, b] * hi + mins[o, b]


@overload(_dequantize_row, inline="always")
def _dequantize_row_typed(w, o, row):
    if typed_as(w, (Float32Weight, Int8Weight)):                       # fp32, int8 with one scale per row
        def each(w, o, row):
            for i in range(row.shape[0]):
                row[i] = weight_at(w, o, i)
        return each
    if typed_as(w, Int8BlockWeight):                                   # int8, one scale per block of 32
        def per_block(w, o, row):
            for b in range(w.scale.shape[1]):
                s = w.scale[o, b]
                for i in range(BLOCK * b, BLOCK * b + BLOCK):
                    row[i] = s * np.float32(w.q[o, i])
        return per_block

    def four_bit(w, o, row):                                            # Q4Weight
        packed, d, mins = w
        for b in range(d.shape[1]):
            scale, low = d[o, b], mins[o, b]
            for k in range(16):
                lo, hi = nibbles(packed[o, 16 * b + k])
                row[32 * b + k] = scale * lo + low
                row[32 * b + 16 + k] = scale * hi + low
    return four_bit


@njit(**PARALLEL)
def linear_panels(w, x, out):
    """out [M, O] = x [M, I] times W^T for a prompt chunk's M rows, in any weight format (weight_formats.py).

    The product is taken transposed, out^T = W . x^T, so that it runs as register_tiles' tiles with no weight ever
    transposed: x^T is made once per call, in strips of STRIP input rows (xt [strips, I, STRIP], zeros past M), so
    that a tile reads one contiguous strip, not a few values of each of I rows M apart (as a BLAS packs B; on AVX2
    up to 2x faster at 512 rows). Then, per task, PANEL_ROWS weight rows are dequantized once into a float32
    scratch [PANEL_ROWS, I] and multiplied by every strip, each weight value broadcast against 16 input rows at a
    time with the sums in registers; the [PANEL_ROWS, STRIP] results are written into out's columns. The 4 x 4 tiles of
    linear_kernels.linear_tiled instead convert each weight once per 4 input rows and end each dot product with a
    sum across a vector's lanes."""
    M, I = x.shape
    O = out.shape[1]
    strips = (M + STRIP - 1) // STRIP
    xt = np.empty((strips, I, STRIP), dtype=np.float32)        # [strips, I, STRIP] the input rows as columns
    for s in prange(strips):
        for i in range(I):
            for j in range(STRIP):
                m = STRIP * s + j
                xt[s, i, j] = x[m, i] if m < M else np.float32(0.0)
    for task in prange((O + PANEL_ROWS - 1) // PANEL_ROWS):
        o0 = task * PANEL_ROWS
        n = min(O, o0 + PANEL_ROWS) - o0                        # weight rows of this task (the last may be short)
        rows = np.empty((PANEL_ROWS, I), dtype=np.float32)      # [16, I] W[o0:o0+n], dequantized
        for r in range(n):
            _dequantize_row(w, o0 + r, rows[r])
        for r in range(n, PANEL_ROWS):
            for i in range(I):
                rows[r, i] = 0.0
        tile = np.empty((strips, PANEL_ROWS, STRIP), dtype=np.float32)   # [strips, 16, STRIP] = rows . each strip
        for s in range(strips):
            product(rows, xt[s], tile[s], False)
        for m in range(M):                                      # along out's rows (down its columns, each
            for r in range(n):                                  # write missed L1: rows 12 KiB apart at O = 3072)
                out[m, o0 + r] = tile[m // STRIP, r, m % STRIP] * row_scale(w, o0 + r)


# --- inputs rounded to int8 blocks: integer register tiles ----------------------------------------------------
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
    """out [M, O] from tile_inputs' rounded rows (M <= their padded count) and an Int8Weight or Int8BlockWeight w:
    per task of 16 weight rows the rows are interleaved into a panel once, then every input row meets it TILE_COLS
    at a time."""
    O = out.shape[1]
    I = xq.shape[1]
    q, s = w.q, w.scale.reshape(O, -1)                         # s [O, 1] or [O, I/32]
    for task in prange((O + INT8_PANEL_ROWS - 1) // INT8_PANEL_ROWS):
        o0 = task * INT8_PANEL_ROWS
        panel = np.empty((I // 4, 4 * INT8_PANEL_ROWS), np.int8)     # [I/4, 64] 16 rows, 4 bytes at a time
        scales = np.empty((I // BLOCK, INT8_PANEL_ROWS), np.float32)  # [I/32, 16]
        pack_panel(q, s, o0, panel, scales)
        _tiles_of_panel(panel, scales, scales, xq, xcorr, xs, xsum, out, o0, False)


@njit(**PARALLEL)
def q4_panels_into(w, xq, xcorr, xs, xsum, out):
    """The same for a Q4Weight w (packed [O, I/2], d, mins [O, I/32]): each panel holds the 4-bit values
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
    """w: an Int8Weight, Int8BlockWeight or Q4Weight [O, I], I a multiple of 32; x [M, I] -> out [M, O]: a prompt
    chunk rounded to int8 blocks and multiplied in the target's integer register tiles (VNNI or AVX2)."""
    (q4_panels_into if isinstance(w, Q4Weight) else int8_panels_into)(w, *tile_inputs(x, TILE_COLS), out)


