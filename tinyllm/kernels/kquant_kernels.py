"""Q4_K's super-blocks read as they are (quant.Q4KBlock: 4-bit values, a 6-bit scale and minimum per block of 32,
an fp16 d and dmin per 8 blocks) times a few rows of x rounded to int8 blocks: `linear_q4k_a8`. Its numpy twin is
the numpy backend's linear with int8 inputs (round x, dequantize the weight, multiply: backend.NumpyOps.linear).

Per block b of 32 the product is an integer dot product scaled twice, as for Q4_1 (q4_kernels.py), except that the
block's scale and minimum are made from their 6-bit integers on the way:
    sum_j W[o, j] xq[j] xs[b] = xs[b] (d[b // 8] scales[b] sum_j q[j] xq[j] - dmin[b // 8] mins[b] sum_j xq[j])
so each task expands its rows' scales into a scratch of Q4_1's form and runs Q4_1's task on them: the same numbers
as the Q4_1 arrays a Q4KBlock equals (to the last bit or so: fastmath may order a sum differently in each compile),
from 0.6 bytes a weight instead of 0.75.
Not wired into dispatch.py or the fused block yet: a model still runs a Q4KBlock as those Q4_1 arrays
(weight_formats.kernel_weight), which is faster today: expanding the scales costs about as much per block as the
vector dot itself (4096 x 4096, one row, one thread: 0.71 ms here, 0.46 ms on the Q4_1 arrays). The fast design is
ggml's: round the activations with one scale per 256 (Q8_K), so that a super-block's 8 blocks add up in integers,
sum_b scales[b] * isum[b], and take two float multiplies per 256 values. Left out: float inputs, tiles for many
input rows.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import SUPER
from .linear_kernels import OUT_BLOCK, n_tasks, quantize_rows
from .numerics import PARALLEL, SERIAL
from .q4_kernels import q4_a8_task, q4_inputs


@njit(**SERIAL)
def q4k_a8_task(w, xq, xs, xg, xscales, sums, out, o0, o1, int_dots):
    """linear_q4k_a8's rows o0 .. o1-1: their blocks' scales and minimums made from the 6-bit integers into a small
    scratch (OUT_BLOCK rows: it stays in L1), then q4_kernels.q4_a8_task on those rows, with intdot.py's dots."""
    packed, scales, mins, d, dmin = w
    nb = scales.shape[1]
    block_d = np.empty((o1 - o0, nb), np.float32)                   # [rows, I/32] d * scale, as ggml rounds it
    block_m = np.empty((o1 - o0, nb), np.float32)                   # [rows, I/32] -(dmin * min)
    for o in range(o0, o1):
        for b in range(nb):
            block_d[o - o0, b] = d[o, b // SUPER] * np.float32(scales[o, b])
            block_m[o - o0, b] = -(dmin[o, b // SUPER] * np.float32(mins[o, b]))
    q4_a8_task((packed[o0:o1], block_d, block_m), xq, xs, xg, xscales, sums, out[:, o0:o1], 0, o1 - o0, int_dots)


@njit(**PARALLEL)
def linear_q4k_a8(w, x, out, int_dots):
    """w: a Q4KBlock's arrays (packed [O, I/2], scales, mins [O, I/32] uint8, d, dmin [O, I/256] float32);
    x [M, I] is rounded to int8 blocks here (as quant.quantize_activations) -> out [M, O]. int_dots: whether
    intdot.py's vector dots may run (intdot.USE_INT_DOTS)."""
    xq, _, xs = quantize_rows(x)
    xg, xscales, sums = q4_inputs(xq, xs, int_dots)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q4k_a8_task(w, xq, xs, xg, xscales, sums, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK),
                    int_dots)
