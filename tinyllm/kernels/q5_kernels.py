"""Q5_0 as a Q4_K_M file holds it (quant.Q5Block: 4-bit values packed as Q4_1's, a fifth bit per value in a uint32
per block of 32, an fp16 scale d widened to float32): W = d (q - 16), q = nibble + 16 fifth bit in [0, 31].

`linear_q5_a8`, for a few rows of x rounded to int8 blocks, is Q4_1's kernel (q4_kernels.py) with a 5-bit dot:
intdot.dot_q5 (VNNI) or dot_q5_blocks (AVX2) put each block's fifth bits into its bytes (16 or 0 by a mask of
i1) before the integer multiply, and take the block's minimum as -16 d, so the inputs are laid out as Q4_1's
(q4_kernels.q4_inputs). That is llama.cpp's idea too (ggml_vec_dot_q5_0_q8_0: the bits expanded to bytes, OR-ed
into the nibbles), with Q4_1's minimum term for ggml's -16 (which ggml subtracts from each byte instead).
`linear_q5_panels`, a prompt chunk rounded to int8 blocks (from dispatch.Q5_INTEGER_TILES_FROM rows), runs the
integer tiles of int8 blocks (panel_kernels.py): each task's 16 weight rows unpacked to q - 16 (int8 in [-16, 15])
under their scales d, then interleaved into a panel as an Int8BlockWeight's are.
`linear_q5`, float inputs (the float activations setting; rounded ones from 8 rows on a CPU with neither VNNI nor
AVX2), dequantizes each weight row once and takes one plain dot product per input row, as
Q6_K's float kernel does: no tiles.
Their numpy twin is the numpy backend's linear of the dequantized weight (rounding x first for int8 inputs).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import BLOCK
from .int8_tiles import PANEL_ROWS, pack_panel
from .int8_tiles_avx2 import TILE_COLS
from .intdot import Q4_BY_BLOCKS, dot_q5, dot_q5_blocks, dot_q5_reference, fifth_bits
from .linear_kernels import OUT_BLOCK, n_tasks, quantize_rows
from .numerics import PARALLEL, SERIAL
from .panel_kernels import _tiles_of_panel, tile_inputs
from .q4_kernels import last_block_sums, q4_inputs


@njit(**SERIAL)
def q5_a8_task(w, xq, xs, xg, scales, sums, out, o0, o1, int_dots):
    """linear_q5_a8's task: out[:, o0:o1], from q4_kernels.q4_inputs' layout (the 5-bit dot called directly in the
    row loop, as q4_a8_task does); an odd last block is added after, in integers."""
    packed, d, high = w
    for m in range(xq.shape[0]):
        g, s, sm = xg[m], scales[m], sums[m]
        if int_dots and Q4_BY_BLOCKS:          # loops with a constant each, so that none carries a branch
            for o in range(o0, o1):
                out[m, o] = dot_q5_blocks(packed, o, d, high, g, s, sm)
        elif int_dots:
            for o in range(o0, o1):
                out[m, o] = dot_q5(packed, o, d, high, g, s, sm)
        else:
            for o in range(o0, o1):
                out[m, o] = dot_q5_reference(packed, o, d, high, g, s, sm)
    last = xs.shape[1] - 1
    if last % 2 == 0:                          # an odd block count: the last block, in integers
        for o in range(o0, o1):
            for m in range(xq.shape[0]):
                isum, xsum = last_block_sums(packed, o, xq, m, last)
                for j in range(BLOCK):         # the fifth bits' share
                    isum += fifth_bits(high, o, last, j) * np.int32(xq[m, BLOCK * last + j])
                out[m, o] += xs[m, last] * d[o, last] * np.float32(isum - 16 * xsum)


@njit(**PARALLEL)
def linear_q5_a8(w, x, out, int_dots):
    """w: a Q5Weight [O, I] (I a multiple of 32); x [M, I] is rounded to int8 blocks here -> out [M, O]. int_dots:
    whether the vector dots may run (intdot.USE_INT_DOTS)."""
    xq, _, xs = quantize_rows(x)
    xg, scales, sums = q4_inputs(xq, xs, int_dots)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q5_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)


@njit(**SERIAL)
def q5_rows_task(w, x, out, o0, o1):
    """linear_q5's rows o0 .. o1-1 against every input row: each weight row dequantized once (Q5Block.dequantize's
    values), then one plain dot product per input row."""
    packed, d, high = w
    I = 2 * packed.shape[1]
    row = np.empty(I, np.float32)                                   # [I] the weight row's values
    for o in range(o0, o1):
        for b in range(d.shape[1]):
            for j in range(16):
                byte = np.int32(packed[o, 16 * b + j])
                row[BLOCK * b + j] = d[o, b] * np.float32((byte & 15) + fifth_bits(high, o, b, j) - 16)
                row[BLOCK * b + 16 + j] = d[o, b] * np.float32((byte >> 4) + fifth_bits(high, o, b, j + 16) - 16)
        for m in range(x.shape[0]):
            acc = np.float32(0.0)
            for i in range(I):
                acc += row[i] * x[m, i]
            out[m, o] = acc


@njit(**PARALLEL)
def linear_q5(w, x, out):
    """w: a Q5Weight [O, I]; x [M, I] float32 -> out [M, O]."""
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q5_rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))


@njit(**SERIAL)
def q5_values(w, o0, o1, values):
    """values [o1 - o0, I] int8 <- rows o0 .. o1-1 of a Q5Weight as whole numbers q - 16 (W = d * them)."""
    packed, d, high = w
    for o in range(o0, o1):
        for b in range(d.shape[1]):
            for k in range(16):
                byte = np.int32(packed[o, 16 * b + k])
                values[o - o0, BLOCK * b + k] = (byte & 15) + fifth_bits(high, o, b, k) - 16
                values[o - o0, BLOCK * b + 16 + k] = (byte >> 4) + fifth_bits(high, o, b, k + 16) - 16


@njit(**PARALLEL)
def q5_panels_into(w, xq, xcorr, xs, xsum, out):
    """out [M, O] from panel_kernels.tile_inputs' rounded rows and a Q5Weight w: per task of 16 weight rows, their
    values q - 16 and scales d packed as an int8-block weight's panel, then every input row meets it."""
    O = out.shape[1]
    I = xq.shape[1]
    for task in prange((O + PANEL_ROWS - 1) // PANEL_ROWS):
        o0 = task * PANEL_ROWS
        n = min(O, o0 + PANEL_ROWS) - o0
        values = np.empty((n, I), np.int8)                           # [n, I] the rows' q - 16
        q5_values(w, o0, o0 + n, values)
        panel = np.empty((I // 4, 4 * PANEL_ROWS), np.int8)          # [I/4, 64]
        scales = np.empty((I // BLOCK, PANEL_ROWS), np.float32)      # [I/32, 16]
        pack_panel(values, w[1][o0:o0 + n], 0, panel, scales)
        _tiles_of_panel(panel, scales, scales, xq, xcorr, xs, xsum, out, o0, False)


def linear_q5_panels(w, x, out):
    """w: a Q5Weight [O, I]; x [M, I] (a prompt chunk) -> out [M, O], x rounded to int8 blocks, in the target's
    integer register tiles (VNNI or AVX2)."""
    q5_panels_into(w, *tile_inputs(x, TILE_COLS), out)
