"""The 4-bit family of linear kernels: Q4Weight (Q4_1's blocks of 32 4-bit values, a scale and a minimum each)
times a few rows of x, for float inputs (`linear_q4`) and for inputs rounded to int8 blocks (`linear_q4_a8`, with
intdot.py's integer dot products).

What they share with the 8-bit family (tasks of OUT_BLOCK rows, the rounding of the inputs) is in
linear_kernels.py; prompt chunks go to panel_kernels.py. Left out: choosing between them (dispatch.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import BLOCK
from .intdot import Q4_BY_BLOCKS, dot_q4, dot_q4_blocks, dot_q4_reference, q4_group
from .linear_kernels import OUT_BLOCK, TILE_MIN_ROWS, n_tasks, quantize_rows
from .numerics import EXACT_PER_VALUE, PARALLEL, SERIAL


# --- float inputs -----------------------------------------------------------------------------------------------
@njit(fastmath=True, cache=True, inline="always")
def nibbles(byte):
    """A packed byte -> its (low, high) 4-bit values as floats. In float arithmetic: Numba widens integer shifts
    on uint8 to 64-bit lanes, which halves the vector width."""
    f = np.float32(byte)
    hi = np.floor(f * np.float32(0.0625))
    return f - np.float32(16.0) * hi, hi


@njit(**PARALLEL)
def linear_q4(w, x, out):
    """w: a Q4Weight (packed [O, I/2] uint8 in Q4_1 nibble order, d, mins [O, I/32]); x [M, I] -> out [M, O].

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
                    lo0, hi0 = nibbles(packed[o, i])
                    lo1, hi1 = nibbles(packed[o + 1, i])
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
                lo, hi = nibbles(packed[o, i])
                acc += d[o, i >> 4] * (lo * xlo[m, i] + hi * xhi[m, i])
            for b in range(nb):
                acc += mins[o, b] * xsum[m, b]
            out[m, o] = acc


# --- inputs rounded to int8 blocks ------------------------------------------------------------------------------
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
    reference body the loop ran 1.2-1.4x slower: docs/design/kernels.md); an odd last
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
                isum, xsum = last_block_sums(packed, o, xq, m, last)
                out[m, o] += xs[m, last] * (d[o, last] * np.float32(isum) + mins[o, last] * np.float32(xsum))


@njit(**SERIAL)
def last_block_sums(packed, o, xq, m, last):
    """Block `last` of 4-bit row o against rounded input row m -> (sum of its 4-bit values times the inputs, sum of
    the inputs), in integers: the odd last block the 4-bit dots leave to their callers."""
    isum, xsum = 0, 0
    for j in range(16):
        byte = np.int32(packed[o, 16 * last + j])
        lo, hi = np.int32(xq[m, BLOCK * last + j]), np.int32(xq[m, BLOCK * last + 16 + j])
        isum += (byte & 15) * lo + (byte >> 4) * hi
        xsum += lo + hi
    return isum, xsum


@njit(**PARALLEL)
def linear_q4_a8(w, x, out, int_dots):
    """w: a Q4Weight [O, I]; x [M, I] is rounded to int8 blocks here -> out [M, O]."""
    xq, _, xs = quantize_rows(x)
    xg, scales, sums = q4_inputs(xq, xs, int_dots)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q4_a8_task(w, xq, xs, xg, scales, sums, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)
