"""Numba kernels for the hot loops of decode, each the fast twin of a numpy function in ops.py / quant.py.

Why these loops: a decode step multiplies one token's vector by every weight matrix (about 135M weights for
SmolLM2), so its time is the time to stream those bytes from memory. The kernels below read the stored
bytes (fp32, int8 or packed 4-bit) and dequantize in registers, never building an fp32 copy of a weight;
each output row is an independent dot product, spread over the cores with `prange`.

Every kernel has a parity test against its numpy twin (tests/test_kernels.py). Set NUMBA_DISABLE_JIT=1 to
step through them as plain Python. Compiled code is cached on disk (`cache=True`), so only the first run of
a fresh install pays the compile time (see `warmup`).
"""
from __future__ import annotations

import time

import numpy as np
import llvmlite.binding as llvm
from llvmlite import ir
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import ops
from .quant import BLOCK, Int8Block, Int8Channel, Q4Block, quantize, round_activations

_JIT = dict(parallel=True, fastmath=True, cache=True, nogil=True)       # loops worth both cores
_SERIAL = dict(fastmath=True, cache=True, nogil=True)                  # small loops: threads would cost more

# Used as the model's `ops` when backend="numba": every name ops.py offers, the hot ones replaced below.
layernorm, gelu_tanh, softmax, silu, rope_tables = ops.layernorm, ops.gelu_tanh, ops.softmax, ops.silu, ops.rope_tables


# --- exp that vectorises ----------------------------------------------------------------------------------------
# Without Intel's SVML library Numba turns np.exp into one call of the C library's expf per value, which also stops
# the loop around it from being vectorised: the SwiGLU of a 32-row batch and the softmaxes of its attention then
# spend milliseconds on exponentials. exp32 computes exp(x) = 2^n * e^r with n = round(x / ln 2) and
# r = x - n ln 2 in [-ln2/2, ln2/2] (Cody and Waite: ln 2 split in two constants so r keeps its precision), e^r by
# its Taylor polynomial to degree 6, and 2^n by writing n + 127 into a float's exponent bits. Plain arithmetic,
# so LLVM vectorises it: measured 10-16x faster than expf over 2.2M values, relative error 2.4e-7 (float32's
# own rounding is 6e-8). Inputs are clamped to [-87, 88], where float32 exp neither underflows nor overflows.
_NO_REASSOC = {"nnan", "ninf", "nsz", "arcp", "contract"}   # fastmath, minus reordering (it would undo the split)

if config.DISABLE_JIT:                  # stepping through as plain Python (no LLVM): the library exponential
    def exp32(x):
        return np.float32(np.exp(np.float32(x)))
else:
    @intrinsic
    def _float32_from_bits(typingctx, bits):
        """int32 -> the float32 with the same bits (a reinterpretation; no instruction is emitted)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    @njit(fastmath=_NO_REASSOC, cache=True)
    def exp32(x):
        """exp(x) for float32 x, vectorisable; see above."""
        x = min(max(x, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))            # round(x / ln 2)
        r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)         # x - n ln 2, in two parts
        e_r = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (
            np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720))))))
        two_n = _float32_from_bits(np.int32((n + np.float32(127.0)) * np.float32(2.0 ** 23)))  # exponent bits
        return e_r * two_n


# --- linear layers: out[m, o] = sum_i W[o, i] * x[m, i], for M = 1 (decode) up to SMALL_M rows ---------------
# Work is split over the cores by blocks of OUT_BLOCK weight rows. Within a block, rows go in tiles of 4 weight
# rows x 4 input rows: 16 running sums held in registers, so each loaded weight value feeds 4 multiply-adds and
# each loaded input value feeds 4 more. A one-row-at-a-time loop would load two values per multiply-add and wait
# on the load ports; the tile does 16 multiply-adds per 8 loads (measured on the model's matrices at 32 rows:
# 137 vs 77 GFLOP/s). The block's weight rows stay in cache while every input row passes over them, so a batch
# of M rows costs about one read of the weights from memory: the reason batched decode is cheap per token.
# Rows that do not fill a tile (M % 4 input rows, O % 4 weight rows) are single dot products in the int8 and 4-bit
# kernels. So are all rows when M < TILE_MIN_ROWS (plain decode, short speculative verifications): there the
# weights stream from memory, and reading one weight row after the other, each reused from L1 for the few input
# rows, kept the memory stream sequential and measured 10-25% faster at 4-5 rows than tiles that read 4 weight
# rows side by side. linear_f32_few takes the input rows two at a time against each weight row (the second pair
# reads the row from L1). Over one step's fp32 matrices, A/B in one process: at 4 rows 17.3-19.1 ms against
# 20.5-21.4 for one weight row x 4 input rows (the kernel before), at 7 rows 28.8-29.1 against 32.1-32.3; one
# row alone 16.2-16.9. The same pairs loop inside linear_f32's blocks of OUT_BLOCK rows ran 1-3 ms slower.
OUT_BLOCK = 16
TILE_MIN_ROWS = 8


@njit(**_JIT)
def linear_f32_few(w, x, out):
    """w [O, I] float32, x [M, I] -> out [M, O], for M < TILE_MIN_ROWS: each weight row against the input rows
    two at a time (the row is read from memory once, then from L1)."""
    O, I = w.shape
    M = x.shape[0]
    for o in prange(O):
        for m in range(0, M - 1, 2):
            a0 = a1 = np.float32(0.0)
            for i in range(I):
                a0 += w[o, i] * x[m, i]
                a1 += w[o, i] * x[m + 1, i]
            out[m, o], out[m + 1, o] = a0, a1
        if M % 2:
            acc = np.float32(0.0)
            for i in range(I):
                acc += w[o, i] * x[M - 1, i]
            out[M - 1, o] = acc


@njit(**_JIT)
def linear_f32(w, x, out):
    """w [O, I] float32, x [M, I] -> out [M, O], tiled: for M >= TILE_MIN_ROWS (linear_f32_few below that)"""
    O, I = w.shape
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
                    w0, w1, w2, w3 = w[o, i], w[o + 1, i], w[o + 2, i], w[o + 3, i]
                    a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2; a03 += w0 * x3      # noqa: E702
                    a10 += w1 * x0; a11 += w1 * x1; a12 += w1 * x2; a13 += w1 * x3      # noqa: E702
                    a20 += w2 * x0; a21 += w2 * x1; a22 += w2 * x2; a23 += w2 * x3      # noqa: E702
                    a30 += w3 * x0; a31 += w3 * x1; a32 += w3 * x2; a33 += w3 * x3      # noqa: E702
                out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00, a01, a02, a03
                out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1], out[m + 3, o + 1] = a10, a11, a12, a13
                out[m, o + 2], out[m + 1, o + 2], out[m + 2, o + 2], out[m + 3, o + 2] = a20, a21, a22, a23
                out[m, o + 3], out[m + 1, o + 3], out[m + 2, o + 3], out[m + 3, o + 3] = a30, a31, a32, a33
        for o in range(o0, o1):                     # what no tile covered: one weight row, 2 input rows at a time
            m = M4 if o < o4 else 0
            while m + 2 <= M:
                a0 = a1 = np.float32(0.0)
                for i in range(I):
                    a0 += w[o, i] * x[m, i]
                    a1 += w[o, i] * x[m + 1, i]
                out[m, o], out[m + 1, o] = a0, a1
                m += 2
            if m < M:
                acc = np.float32(0.0)
                for i in range(I):
                    acc += w[o, i] * x[m, i]
                out[m, o] = acc


@njit(**_JIT)
def linear_int8_channel(q, scale, x, out):
    """q [O, I] int8, scale [O] -> out [M, O]: the int8 dot product, scaled once per row. Tiled as linear_f32;
    each int8 weight is converted to float once and feeds the 4 input rows of its tile."""
    O, I = q.shape
    M = x.shape[0]
    M4 = M - M % 4 if M >= TILE_MIN_ROWS else 0                 # input rows covered by tiles
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
                    w0, w1 = np.float32(q[o, i]), np.float32(q[o + 1, i])
                    w2, w3 = np.float32(q[o + 2, i]), np.float32(q[o + 3, i])
                    a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2; a03 += w0 * x3      # noqa: E702
                    a10 += w1 * x0; a11 += w1 * x1; a12 += w1 * x2; a13 += w1 * x3      # noqa: E702
                    a20 += w2 * x0; a21 += w2 * x1; a22 += w2 * x2; a23 += w2 * x3      # noqa: E702
                    a30 += w3 * x0; a31 += w3 * x1; a32 += w3 * x2; a33 += w3 * x3      # noqa: E702
                s0, s1, s2, s3 = scale[o], scale[o + 1], scale[o + 2], scale[o + 3]
                out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00 * s0, a01 * s0, a02 * s0, a03 * s0
                out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1], out[m + 3, o + 1] = (a10 * s1, a11 * s1,
                                                                                          a12 * s1, a13 * s1)
                out[m, o + 2], out[m + 1, o + 2], out[m + 2, o + 2], out[m + 3, o + 2] = (a20 * s2, a21 * s2,
                                                                                          a22 * s2, a23 * s2)
                out[m, o + 3], out[m + 1, o + 3], out[m + 2, o + 3], out[m + 3, o + 3] = (a30 * s3, a31 * s3,
                                                                                          a32 * s3, a33 * s3)
        for o in range(o0, o1):                                 # what no tile covered: one dot at a time
            for m in range(M4 if o < o4 else 0, M):
                acc = np.float32(0.0)
                for i in range(I):
                    acc += np.float32(q[o, i]) * x[m, i]
                out[m, o] = acc * scale[o]


@njit(**_JIT)
def linear_int8_block(q, scale, x, out):
    """q [O, I] int8, scale [O, I/32] -> out [M, O]. Tiled as linear_f32.

    One flat loop over the row with the block's scale looked up per value (scale[o, i >> 5]) vectorises far
    better than a short per-block loop followed by a horizontal sum (measured: 17 vs 1.3 GB/s on one core).
    """
    O, I = q.shape
    M = x.shape[0]
    M4 = M - M % 4 if M >= TILE_MIN_ROWS else 0                 # input rows covered by tiles
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
                    b = i >> 5
                    w0, w1 = scale[o, b] * np.float32(q[o, i]), scale[o + 1, b] * np.float32(q[o + 1, i])
                    w2, w3 = scale[o + 2, b] * np.float32(q[o + 2, i]), scale[o + 3, b] * np.float32(q[o + 3, i])
                    a00 += w0 * x0; a01 += w0 * x1; a02 += w0 * x2; a03 += w0 * x3      # noqa: E702
                    a10 += w1 * x0; a11 += w1 * x1; a12 += w1 * x2; a13 += w1 * x3      # noqa: E702
                    a20 += w2 * x0; a21 += w2 * x1; a22 += w2 * x2; a23 += w2 * x3      # noqa: E702
                    a30 += w3 * x0; a31 += w3 * x1; a32 += w3 * x2; a33 += w3 * x3      # noqa: E702
                out[m, o], out[m + 1, o], out[m + 2, o], out[m + 3, o] = a00, a01, a02, a03
                out[m, o + 1], out[m + 1, o + 1], out[m + 2, o + 1], out[m + 3, o + 1] = a10, a11, a12, a13
                out[m, o + 2], out[m + 1, o + 2], out[m + 2, o + 2], out[m + 3, o + 2] = a20, a21, a22, a23
                out[m, o + 3], out[m + 1, o + 3], out[m + 2, o + 3], out[m + 3, o + 3] = a30, a31, a32, a33
        for o in range(o0, o1):                                 # what no tile covered: one dot at a time
            for m in range(M4 if o < o4 else 0, M):
                acc = np.float32(0.0)
                for i in range(I):
                    acc += scale[o, i >> 5] * np.float32(q[o, i]) * x[m, i]
                out[m, o] = acc


@njit(fastmath=True, cache=True, inline="always")
def _nibbles(byte):
    """A packed byte -> its (low, high) 4-bit values as floats: byte & 15, byte >> 4, in float arithmetic."""
    f = np.float32(byte)
    hi = np.floor(f * np.float32(0.0625))
    return f - np.float32(16.0) * hi, hi


@njit(**_JIT)
def linear_q4(packed, d, mins, x, out):
    """packed [O, I/2] uint8 (Q4_1 nibble order), d, mins [O, I/32] -> out [M, O].

    Two tricks keep the inner loop a plain contiguous multiply-add:
      * sum_j (d*q_j + m) * x_j = d * sum_j q_j x_j + m * sum_j x_j, and sum_j x_j depends only on x: it is
        computed once per input row (xsum), not once per weight row;
      * byte k of block b holds values 32b+k (low nibble) and 32b+16+k (high nibble). Rearranging x once into
        xlo[16b+k] = x[32b+k] and xhi[16b+k] = x[32b+16+k] lines both up with byte 16b+k.
    The nibbles are split in float arithmetic: integer shifts on uint8 are widened to 64-bit lanes by Numba's
    typing, which halves the vector width (measured 2x slower).
    """
    O, half = packed.shape
    M = x.shape[0]
    nb = half // 16
    xlo = np.empty((M, half), dtype=np.float32)                  # [M, I/2]
    xhi = np.empty((M, half), dtype=np.float32)                  # [M, I/2]
    xsum = np.zeros((M, nb), dtype=np.float32)                   # [M, I/32]
    for m in range(M):
        for b in range(nb):
            for k in range(16):
                xlo[m, b * 16 + k] = x[m, b * 32 + k]
                xhi[m, b * 16 + k] = x[m, b * 32 + 16 + k]
                xsum[m, b] += x[m, b * 32 + k] + x[m, b * 32 + 16 + k]
    M4 = M - M % 4 if M >= TILE_MIN_ROWS else 0                 # input rows covered by tiles
    for blk in prange((O + OUT_BLOCK - 1) // OUT_BLOCK):
        o0 = blk * OUT_BLOCK
        o1 = min(O, o0 + OUT_BLOCK)
        o2 = o0 + (o1 - o0) // 2 * 2
        for m in range(0, M4, 4):              # tiles of 2 weight rows x 4 input rows (4 x 4 runs out of registers)
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
        for o in range(o0, o1):                                 # what no tile covered: one dot at a time
            for m in range(M4 if o < o2 else 0, M):
                acc = np.float32(0.0)
                for i in range(half):
                    lo, hi = _nibbles(packed[o, i])
                    acc += d[o, i >> 4] * (lo * xlo[m, i] + hi * xhi[m, i])
                for b in range(nb):
                    acc += mins[o, b] * xsum[m, b]
                out[m, o] = acc


# --- integer dot products: int8 activations times int8 or 4-bit weights -----------------------------------------
# The float kernels above convert every quantized weight to float32 before multiplying. For int8 weights that
# conversion (widen, convert, then multiply-add) costs more than reading the byte from memory, so the step is
# bound by arithmetic, not by the bytes it reads. llama.cpp's answer, offered here as an option (the weight's
# `int8_inputs`, set by `activations="int8"`): round the input rows to int8 too (quant.quantize_activations: one
# scale per block of 32 values), so that each block's dot product is an integer sum that one instruction
# computes: AVX-512 VNNI's vpdpbusd multiplies 32 unsigned bytes by 32 signed bytes and adds each group of 4
# products into one of 8 int32 lanes. Per block of 32 weights: 2 loads, a sign fix-up, vpdpbusd, a conversion of
# the 8 lane sums to float and one multiply-add by the two scales. Measured over one decode step's 121 matrices
# (model shapes, 135 MB of int8, 2 threads): 5.6 ms (24 GB/s) converting to float, 3.7 ms (36 GB/s) in integers;
# another run 6.8 vs 5.3 ms.
#   int8:    vpdpbusd needs one unsigned operand. |xq| is unsigned, and sign(xq) moves onto the weight
#            (vpsignb: w * sign(xq)), so the product is unchanged: sum |xq| * (w * sign(xq)) = sum xq * w.
#   4-bit:   the weight nibbles q in [0, 15] are already unsigned: sum q * xq directly; the block minimum's
#            share m * sum(x) uses the rounded x's block sums, computed once per input row. Blocks go two at a
#            time: one 32-byte load holds both blocks' nibbles, and x is rearranged once per input row to match
#            them, so a pair costs one load, two masks and two vpdpbusd (`_q4_dot_codegen`). One block at a time,
#            with the nibbles shuffled into x's order in every block, the model's q4 matrices took 0.7-0.85 ns
#            per block on 2 threads with the weights in cache (bound by instructions, not memory); in pairs
#            0.55-0.6. Over a decode step's 120 matrices read from memory, A/B in one process: one input row
#            2.67-2.94 ms against 2.77-2.94 (now bound by memory), two rows (a speculative draft catching up)
#            3.98-4.32 against 4.81-5.13.
# Numba cannot express vector instructions, so `_int8_dot_codegen` and `_q4_dot_codegen` write the loop over one
# row's blocks in LLVM IR. They are used up to TILE_MIN_ROWS input rows (decode); from there the tiled float
# kernels above reuse each weight for several rows and win, and they get the rounded x (xq * xs), so every path
# computes the same products. Without VNNI (another CPU, or NUMBA_DISABLE_JIT=1 to step through) the float kernels
# run on the rounded x.
# Every 64 weight bytes the loop also asks for the bytes PREFETCH_BYTES ahead (llvm.prefetch): rows are short (576
# int8 or 288 packed 4-bit bytes), so the hardware prefetcher keeps restarting. Over a decode step's matrices, in
# the same runs: q4_1 4.6-5.7 -> 4.0-5.1 ms, int8 within noise to 10% faster (1024 and 4096 bytes were no better;
# the paired q4 kernel again: 1024-8192 bytes all within noise).
PREFETCH_BYTES = 2048
HAVE_VNNI = (not config.DISABLE_JIT and not config.CPU_NAME       # (a portable build targets no host features)
             and {"avx512vnni", "avx512vl"} <= set(f[1:] for f in llvm.get_host_cpu_features().flatten().split(",")
                                                   if f.startswith("+")))


_EXACT_DIVIDE = {"nnan", "ninf", "nsz"}   # fastmath flags that still let max() vectorise but keep x / scale exact


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True)
def quantize_rows(x):
    """x [M, I] -> (xq [M, I] int8, xabs = |xq| [M, I] int8, xs [M, nb] block scales), nb = ceil(I/32).
    The twin of quant.quantize_activations, rounding identically."""
    M, I = x.shape
    nb = (I + BLOCK - 1) // BLOCK
    xq, xabs = np.empty((M, I), np.int8), np.empty((M, I), np.int8)
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
            for j in range(n):                          # three simple loops, so that each one vectorises
                v[j] = min(max(np.rint(x[m, i0 + j] / s), np.float32(-127.0)), np.float32(127.0))
            for j in range(n):
                xq[m, i0 + j] = np.int8(v[j])
                xabs[m, i0 + j] = np.int8(abs(v[j]))
            xs[m, b] = s
    return xq, xabs, xs


@njit(fastmath=_EXACT_DIVIDE, cache=True, nogil=True)
def round_rows(x):
    """x [M, I] -> the rounded rows as float32 (xq * xs): the input the float kernels get for quantized weights."""
    xq, _, xs = quantize_rows(x)
    xr = np.empty(x.shape, np.float32)                          # [M, I]
    for m in range(x.shape[0]):
        for i in range(x.shape[1]):
            xr[m, i] = np.float32(xq[m, i]) * xs[m, i // BLOCK]
    return xr


if HAVE_VNNI:
    _i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    _V32i8, _V8i32, _V4i32 = ir.VectorType(_i8, 32), ir.VectorType(_i32, 8), ir.VectorType(_i32, 4)
    _V2f32, _V8f32 = ir.VectorType(_f32, 2), ir.VectorType(_f32, 8)

    def _llvm_call(builder, name, ret, *args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return builder.call(fn, args)

    def _load(builder, ptr, offset, vector_type):
        """vector_type's worth of values from ptr + offset (in elements of ptr), no alignment assumed."""
        return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vector_type.as_pointer()), align=1)

    def _splat(builder, value):
        """float -> <8 x float> of copies"""
        v = builder.insert_element(ir.Constant(_V8f32, ir.Undefined), value, ir.Constant(_i32, 0))
        return builder.shuffle_vector(v, ir.Constant(_V8f32, ir.Undefined), ir.Constant(_V8i32, [0] * 8))

    def _dpbusd(builder, acc, unsigned, signed):
        """acc <8 x i32> + the products of 32 unsigned by 32 signed bytes, each group of 4 summed into one lane."""
        return _llvm_call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8i32, acc, unsigned, signed)

    def _row_sum(builder, n_steps, step, row, bytes_per_step):
        """The loop both dot products share: sum over i < n_steps of step(i) (an <8 x float>), in two running
        sums (steps 2j and 2j+1), so that consecutive adds do not wait on each other; while it runs, ask for the
        weight row's bytes PREFETCH_BYTES ahead. -> the float32 total of the 8 lanes."""
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8f32, [0.0] * 8)) for _ in range(2)]

        def add(i, acc_ptr):
            builder.store(builder.fadd(builder.load(acc_ptr), step(i), flags=("fast",)), acc_ptr)

        one, two = ir.Constant(n_steps.type, 1), ir.Constant(n_steps.type, 2)
        with cgutils.for_range(builder, builder.udiv(n_steps, two)) as loop:
            i = builder.mul(loop.index, two)
            ahead = builder.gep(row, [builder.add(builder.mul(i, ir.Constant(i.type, bytes_per_step)),
                                                  ir.Constant(i.type, PREFETCH_BYTES))])
            _llvm_call(builder, "llvm.prefetch.p0", ir.VoidType(), ahead, ir.Constant(_i32, 0),
                       ir.Constant(_i32, 3), ir.Constant(_i32, 1))
            add(i, accs[0])
            add(builder.add(i, one), accs[1])
        with builder.if_then(builder.trunc(n_steps, ir.IntType(1))):                        # an odd count
            add(builder.sub(n_steps, one), accs[0])
        acc = builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=("fast",))
        half = builder.fadd(builder.shuffle_vector(acc, acc, ir.Constant(_V4i32, [0, 1, 2, 3])),        # 8 -> 4
                            builder.shuffle_vector(acc, acc, ir.Constant(_V4i32, [4, 5, 6, 7])), flags=("fast",))
        lane = [builder.extract_element(half, ir.Constant(_i32, j)) for j in range(4)]
        return builder.fadd(builder.fadd(lane[0], lane[1], flags=("fast",)),
                            builder.fadd(lane[2], lane[3], flags=("fast",)), flags=("fast",))

    def _structs(context, builder, signature, args, names):
        """The intrinsic's arguments by name: arrays as struct proxies (.data, .shape), the row index o as is."""
        return {name: val if name == "o" else cgutils.create_struct_proxy(ty)(context, builder, value=val)
                for name, ty, val in zip(names.split(), signature.args, args)}

    def _int8_dot_codegen(kind):
        """LLVM IR for one int8 weight row o against one rounded input row; kind "int8" (arguments w, o, xq,
        xabs, xs) or "int8-block" (w, o, ws, xq, xabs, xs). Returns float32:
            sum over the full blocks b of  [ws[o, b] *] xs[b] * (integer dot of block b's weights with xq)."""
        names = {"int8": "w o xq xabs xs", "int8-block": "w o ws xq xabs xs"}[kind]

        def codegen(context, builder, signature, args):
            a = _structs(context, builder, signature, args, names)
            o, xs = a["o"], a["xs"]
            row_len = builder.extract_value(a["w"].shape, 1)                 # bytes per weight row
            row = builder.gep(a["w"].data, [builder.mul(o, row_len)])
            if kind == "int8":                                               # a last short block is the caller's
                n_blocks = builder.udiv(row_len, ir.Constant(row_len.type, BLOCK))
            else:
                n_blocks = builder.extract_value(a["ws"].shape, 1)
                ws_row = builder.gep(a["ws"].data, [builder.mul(o, n_blocks)])

            def block(b):
                x_off = builder.mul(b, ir.Constant(b.type, BLOCK))
                w = _load(builder, row, x_off, _V32i8)                                   # 32 x int8
                w_signed = _llvm_call(builder, "llvm.x86.avx2.psign.b", _V32i8, w, _load(builder, a["xq"].data,
                                                                                        x_off, _V32i8))  # w * sign(x)
                isum = _dpbusd(builder, ir.Constant(_V8i32, [0] * 8), _load(builder, a["xabs"].data, x_off, _V32i8),
                               w_signed)
                scale = builder.load(builder.gep(xs.data, [b]))
                if kind == "int8-block":
                    scale = builder.fmul(scale, builder.load(builder.gep(ws_row, [b])))
                return builder.fmul(builder.sitofp(isum, _V8f32), _splat(builder, scale), flags=("fast",))
            return _row_sum(builder, n_blocks, block, row, BLOCK)
        return codegen

    def _q4_dot_codegen(context, builder, signature, args):
        """LLVM IR for one 4-bit weight row o against one rounded input row, over its blocks two at a time.
        Arguments (w, o, d, mins, xpair, xs8, xsum8), as linear_q4_vnni prepares them. Returns float32:
            sum over the pairs p of blocks (b, b+1) = (2p, 2p+1) of the 8 lanes of
                (integer dots) * d[o, b or b+1] * xs8[p]  +  mins[o, b or b+1] * xsum8[p]
        Lanes 0-3 hold block b's share, lanes 4-7 block b+1's: the layout of vpdpbusd's result when its 32
        bytes are 16 of block b and 16 of block b+1. That is how the weights lie: one 32-byte load is the two
        blocks' packed bytes; its low nibbles are values 0-15 of each block, its high nibbles values 16-31.
        linear_q4_vnni has put x in the same order (xpair), so the nibbles multiply x as they are, and a pair of
        blocks costs one load, two masks and two vpdpbusd; the scales and minimums of both blocks are spread over
        their four lanes each with one shuffle."""
        a = _structs(context, builder, signature, args, "w o d mins xpair xs8 xsum8")
        o = a["o"]
        row = builder.gep(a["w"].data, [builder.mul(o, builder.extract_value(a["w"].shape, 1))])
        n_blocks = builder.extract_value(a["d"].shape, 1)
        d_row = builder.gep(a["d"].data, [builder.mul(o, n_blocks)])
        mins_row = builder.gep(a["mins"].data, [builder.mul(o, n_blocks)])
        four_each = ir.Constant(_V8i32, [0, 0, 0, 0, 1, 1, 1, 1])

        def pair(p):
            c = lambda n: ir.Constant(p.type, n)                                        # noqa: E731
            packed = _load(builder, row, builder.mul(p, c(BLOCK)), _V32i8)             # 2 blocks x 16 bytes
            low = builder.and_(packed, ir.Constant(_V32i8, [15] * 32))                 # values 0-15 of b, b+1
            high = builder.lshr(packed, ir.Constant(_V32i8, [4] * 32))                 # values 16-31
            x_off = builder.mul(p, c(2 * BLOCK))
            isum = _dpbusd(builder, ir.Constant(_V8i32, [0] * 8), low, _load(builder, a["xpair"].data, x_off, _V32i8))
            isum = _dpbusd(builder, isum, high, _load(builder, a["xpair"].data, builder.add(x_off, c(BLOCK)), _V32i8))
            both = lambda ptr: builder.shuffle_vector(                                  # noqa: E731
                _load(builder, ptr, builder.mul(p, c(2)), _V2f32), ir.Constant(_V2f32, ir.Undefined), four_each)
            lanes = builder.mul(p, c(8))
            scale = builder.fmul(both(d_row), _load(builder, a["xs8"].data, lanes, _V8f32), flags=("fast",))
            term = builder.fmul(builder.sitofp(isum, _V8f32), scale, flags=("fast",))
            return builder.fadd(term, builder.fmul(both(mins_row), _load(builder, a["xsum8"].data, lanes, _V8f32),
                                                   flags=("fast",)), flags=("fast",))
        n_pairs = builder.udiv(n_blocks, ir.Constant(n_blocks.type, 2))      # an odd last block is the caller's
        return _row_sum(builder, n_pairs, pair, row, BLOCK)

    @intrinsic
    def _dot_int8(typingctx, w, o, xq, xabs, xs):
        return types.float32(w, o, xq, xabs, xs), _int8_dot_codegen("int8")

    @intrinsic
    def _dot_int8_block(typingctx, w, o, ws, xq, xabs, xs):
        return types.float32(w, o, ws, xq, xabs, xs), _int8_dot_codegen("int8-block")

    @intrinsic
    def _dot_q4(typingctx, w, o, d, mins, xpair, xs8, xsum8):
        return types.float32(w, o, d, mins, xpair, xs8, xsum8), _q4_dot_codegen

    @njit(**_JIT)
    def linear_int8_channel_vnni(q, scale, x, out):
        """q [O, I] int8, scale [O], x [M, I] -> out [M, O], x rounded to int8 blocks first"""
        xq, xabs, xs = quantize_rows(x)
        O, I = q.shape
        full = I // BLOCK * BLOCK
        for o in prange(O):
            for m in range(xq.shape[0]):
                acc = _dot_int8(q, o, xq[m], xabs[m], xs[m])
                if full < I:                                    # a last block shorter than 32
                    tail = 0
                    for i in range(full, I):
                        tail += np.int64(q[o, i]) * np.int64(xq[m, i])
                    acc += np.float32(tail) * xs[m, xs.shape[1] - 1]
                out[m, o] = acc * scale[o]

    @njit(**_JIT)
    def linear_int8_block_vnni(q, scale, x, out):
        """q [O, I] int8, scale [O, I/32], x [M, I] -> out [M, O], x rounded to int8 blocks first"""
        xq, xabs, xs = quantize_rows(x)
        for o in prange(q.shape[0]):
            for m in range(xq.shape[0]):
                out[m, o] = _dot_int8_block(q, o, scale, xq[m], xabs[m], xs[m])

    @njit(**_JIT)
    def linear_q4_vnni(packed, d, mins, x, out):
        """packed [O, I/2] uint8, d, mins [O, I/32], x [M, I] -> out [M, O], x rounded to int8 blocks first"""
        xq, _, xs = quantize_rows(x)
        M, nb = xs.shape
        n_pairs = nb // 2
        # What _q4_dot_codegen reads, per input row: the rounded x in the order of the weights' nibbles (in each
        # pair of blocks, 64 values, the middle two quarters swap places: [b 0-15, b+1 0-15, b 16-31, b+1 16-31]),
        # and for each pair 8 lanes of block scales and of block sums of x (for the minimums' share), lanes 0-3
        # block b's, 4-7 block b+1's; lane l sums the 8 values its vpdpbusd lane multiplies.
        xpair = xq.copy()                                       # [M, I] (an odd last block stays as it is)
        xs8 = np.empty((M, n_pairs, 8), np.float32)             # [M, I/64, 8]
        xsum8 = np.empty((M, n_pairs, 8), np.float32)           # [M, I/64, 8]
        for m in range(M):
            for p in range(n_pairs):
                i = 2 * BLOCK * p
                for j in range(16):
                    xpair[m, i + 16 + j] = xq[m, i + 32 + j]
                    xpair[m, i + 32 + j] = xq[m, i + 16 + j]
                for lane in range(8):
                    s = 0
                    for j in range(4 * lane, 4 * lane + 4):
                        s += np.int32(xpair[m, i + j]) + np.int32(xpair[m, i + 32 + j])
                    xs8[m, p, lane] = xs[m, 2 * p + lane // 4]
                    xsum8[m, p, lane] = np.float32(s) * xs8[m, p, lane]
        last = nb - 1                                           # the unpaired block when nb is odd
        for o in prange(packed.shape[0]):
            for m in range(M):
                acc = _dot_q4(packed, o, d, mins, xpair[m], xs8[m], xsum8[m])
                if nb % 2:
                    isum, xsum = 0, 0
                    for j in range(16):
                        byte = np.int32(packed[o, 16 * last + j])
                        lo, hi = np.int32(xq[m, BLOCK * last + j]), np.int32(xq[m, BLOCK * last + 16 + j])
                        isum += (byte & 15) * lo + (byte >> 4) * hi
                        xsum += lo + hi
                    acc += xs[m, last] * (d[o, last] * np.float32(isum) + mins[o, last] * np.float32(xsum))
                out[m, o] = acc
else:   # no VNNI (another CPU, or stepping through as Python): the same products from the float kernels
    @njit(**_SERIAL)
    def linear_int8_channel_vnni(q, scale, x, out):
        linear_int8_channel(q, scale, round_rows(x), out)

    @njit(**_SERIAL)
    def linear_int8_block_vnni(q, scale, x, out):
        linear_int8_block(q, scale, round_rows(x), out)

    @njit(**_SERIAL)
    def linear_q4_vnni(packed, d, mins, x, out):
        linear_q4(packed, d, mins, round_rows(x), out)


def _linear_quantized(x, w, out):
    """out [M, O] = x [M, I] (rounded to int8 blocks if w.int8_inputs) times the quantized weight w. The same rule as
    `linear_into`: the integer kernels (or, without VNNI, their stand-ins) for int8 inputs below TILE_MIN_ROWS, else
    the float kernels, on the rounded rows if the inputs are int8."""
    integer = w.int8_inputs and x.shape[0] < TILE_MIN_ROWS
    if w.int8_inputs and not integer:
        x = round_rows(x)                                                       # [M, I] on the int8 grid
    if isinstance(w, Int8Channel):
        (linear_int8_channel_vnni if integer else linear_int8_channel)(w.q, w.scale, x, out)
    elif isinstance(w, Int8Block):
        (linear_int8_block_vnni if integer else linear_int8_block)(w.q, w.scale, x, out)
    elif isinstance(w, Q4Block):
        (linear_q4_vnni if integer else linear_q4)(w.packed, w.d, w.m, x, out)
    else:
        raise TypeError(f"no kernel for weight type {type(w).__name__}")


# --- the small per-token ops: one compiled call each instead of several numpy calls --------------------------
# Each is microseconds of work, but a decode step runs about 150 of them; as chains of numpy calls they cost
# more in call overhead than in arithmetic (ops.rmsnorm alone measured ~9 us per call, 30x its arithmetic).

@njit(**_SERIAL)
def _rmsnorm(x, w, eps, out):
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0.0)
        for i in range(D):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.sqrt(ss / D + np.float32(eps))
        for i in range(D):
            out[t, i] = x[t, i] * r * w[i]


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Twin of ops.rmsnorm. [T, D] -> [T, D]"""
    out = np.empty_like(x)
    _rmsnorm(x, weight, eps, out)
    return out


@njit(**_SERIAL)
def _rope(x, cos, sin, out):
    T, nh, Dh = x.shape
    half = Dh // 2
    for t in range(T):
        for h in range(nh):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i + half] = b * cos[t, i] + a * sin[t, i]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Twin of ops.apply_rope (half-split pairs). x [T, nh, Dh], cos/sin [T, Dh/2] -> [T, nh, Dh]"""
    out = np.empty(x.shape, dtype=np.float32)
    _rope(x, cos, sin, out)
    return out


@njit(**_SERIAL)
def _swiglu_row(gate_up, out, t):
    F = out.shape[1]
    for i in range(F):
        g = gate_up[t, i]
        out[t, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[t, F + i]


@njit(**_SERIAL)
def _swiglu(gate_up, out):
    for t in range(out.shape[0]):
        _swiglu_row(gate_up, out, t)


@njit(**_JIT)
def _swiglu_rows(gate_up, out):
    """The same over rows in parallel, for batches and prompt chunks (F exponentials per row add up)."""
    for t in prange(out.shape[0]):
        _swiglu_row(gate_up, out, t)


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """Twin of ops.swiglu: silu(gate) * up. [T, 2F] -> [T, F]"""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    # threads only where the linears run in Numba too: next to BLAS (more than SMALL_M rows) the pools would fight
    (_swiglu_rows if 4 <= out.shape[0] <= SMALL_M else _swiglu)(gate_up, out)
    return out


# --- decode attention: a few new query tokens against the whole cache -----------------------------------------
ATTN_CHUNK = 32   # cache positions per task in decode attention
FEW_TOKENS = 16   # up to this many query tokens (decode, speculative verification) go to decode_attention


@njit(**_JIT)
def decode_attention(q, k, v, start, out):
    """q [T, H, Dh]: T new tokens (1 in a decode step, k+1 in a speculative verification) at positions start ..
    start+T-1; k, v [S, KVH, Dh] (the cache incl. these tokens, S = start + T) -> out [T, H, Dh]. Causal: token t
    sees positions 0 .. start+t.

    Split over positions ("flash-decoding", Dao et al. 2023): each task takes a chunk of ATTN_CHUNK cache
    positions and computes, for every query token and head, its scores, their running max m and sum of
    exponentials l, and the weighted sum of V; the chunks are merged at the end by rescaling with
    exp(m_chunk - m_global). That keeps both cores busy even with only 3 KV heads.
      * A task reads its positions' K rows, then their V rows, front to back: [s, all KV heads, Dh] is one
        contiguous 768-byte stretch for SmolLM2. Splitting by KV head as well would read every third 256 bytes,
        a stride that restarts the hardware prefetcher at each 4 KiB page; measured in a decode step at
        context 256: 1.1 ms for the attention of 30 layers read in order, 1.8 ms split by head.
      * Each K and V row is read once for all T tokens and all H heads: GQA's G query heads of a group and the
        tokens of a verification read the same rows from L1, so the cache is fetched from memory once and never
        copied. (One task per token, as causal_attention does for prompts, read it T times: a 4-token
        verification at context 300 took 3.2 ms for 30 layers that way, 2.2 ms here; one token 0.93 ms.)
    """
    T, H, Dh = q.shape
    S, KVH, _ = k.shape
    G = H // KVH
    n_chunks = (S + ATTN_CHUNK - 1) // ATTN_CHUNK
    scale = np.float32(1.0 / np.sqrt(Dh))
    chunk_max = np.empty((n_chunks, T, H), dtype=np.float32)
    chunk_sum = np.empty((n_chunks, T, H), dtype=np.float32)
    chunk_out = np.empty((n_chunks, T, H, Dh), dtype=np.float32)
    for c in prange(n_chunks):
        s0, s1 = c * ATTN_CHUNK, min(S, (c + 1) * ATTN_CHUNK)
        scores = np.empty((T, H, ATTN_CHUNK), dtype=np.float32)
        acc = np.zeros((T, H, Dh), dtype=np.float32)            # this chunk's weighted sum of v, per token and head
        for s in range(s0, s1):                                  # q . k, one pass over k[s0:s1]
            for t in range(max(0, s - start), T):                # the tokens that see position s
                for h in range(H):
                    kvh = h // G
                    a = np.float32(0.0)
                    for j in range(Dh):
                        a += q[t, h, j] * k[s, kvh, j]
                    scores[t, h, s - s0] = a * scale
        for t in range(T):                                       # this chunk's softmax statistics
            n = min(s1, start + t + 1) - s0                      # how many of its positions token t sees
            for h in range(H):
                if n <= 0:                                       # none: a chunk that adds nothing in the merge
                    chunk_max[c, t, h], chunk_sum[c, t, h] = np.float32(-1e30), np.float32(0.0)
                    continue
                m = scores[t, h, 0]
                for i in range(1, n):
                    m = max(m, scores[t, h, i])
                total = np.float32(0.0)
                for i in range(n):
                    e = exp32(scores[t, h, i] - m)
                    scores[t, h, i] = e
                    total += e
                chunk_max[c, t, h], chunk_sum[c, t, h] = m, total
        for s in range(s0, s1):                                  # weighted sum of v, one pass over v[s0:s1]
            for t in range(max(0, s - start), T):
                for h in range(H):
                    kvh = h // G
                    p = scores[t, h, s - s0]
                    for j in range(Dh):
                        acc[t, h, j] += p * v[s, kvh, j]
        chunk_out[c] = acc
    for t in range(T):                                           # merge the chunks of each token and head
        for h in range(H):
            m = chunk_max[0, t, h]
            for c in range(1, n_chunks):
                m = max(m, chunk_max[c, t, h])
            total = np.float32(0.0)
            for j in range(Dh):
                out[t, h, j] = 0.0
            for c in range(n_chunks):
                w = exp32(chunk_max[c, t, h] - m)
                total += w * chunk_sum[c, t, h]
                for j in range(Dh):
                    out[t, h, j] += w * chunk_out[c, t, h, j]
            inv = np.float32(1.0) / total
            for j in range(Dh):
                out[t, h, j] *= inv


@njit(**_SERIAL)
def softmax_in_place(row):
    """row [n] float32 <- softmax(row): subtract the max (no overflow), exponentiate, normalise."""
    m = row[0]
    for s in range(1, row.shape[0]):
        m = max(m, row[s])
    total = np.float32(0.0)
    for s in range(row.shape[0]):
        e = exp32(row[s] - m)
        row[s] = e
        total += e
    inv = np.float32(1.0) / total
    for s in range(row.shape[0]):
        row[s] *= inv


@njit(**_JIT)
def causal_attention(q, k, v, start, out):
    """q [T, H, Dh] at positions start .. start+T-1, k, v [S, KVH, Dh] (S = start + T) -> out [T, H, Dh].

    More than FEW_TOKENS query tokens: a prompt or a prompt chunk. One task per (query token, KV head); the
    token at position start+t sees cache positions 0 .. start+t (causal), and each K/V row read serves the G
    query heads of the group. The arithmetic is the same as the numpy twin's batched matmuls; the point is to
    keep BLAS, whose threads fight Numba's for the 2 cores, out of the forward pass (see `linear`).
    """
    T, H, Dh = q.shape
    KVH = k.shape[1]
    G = H // KVH
    scale = np.float32(1.0 / np.sqrt(Dh))
    for task in prange(T * KVH):
        t, kvh = task // KVH, task % KVH
        n = start + t + 1                                        # positions this token may attend to
        scores = np.empty((G, n), dtype=np.float32)             # [G, n]
        for s in range(n):
            for g in range(G):
                acc = np.float32(0.0)
                for j in range(Dh):
                    acc += q[t, kvh * G + g, j] * k[s, kvh, j]
                scores[g, s] = acc * scale
        for g in range(G):
            softmax_in_place(scores[g])
            for j in range(Dh):
                out[t, kvh * G + g, j] = 0.0
            for s in range(n):
                p = scores[g, s]
                for j in range(Dh):
                    out[t, kvh * G + g, j] += p * v[s, kvh, j]


# --- a whole block of a decode step in one call -------------------------------------------------------------------
# Called op by op from Python (model._block), a decode step makes about 13 kernel calls per layer, 390 for SmolLM2,
# plus the numpy glue between them; each call costs microseconds of argument checking and unboxing: time in which
# no weight byte is read. decode_block makes the same calls from compiled code, one Python call per layer, as
# llama2.c's forward() does in C. It is the fast twin of Transformer._block for the common case (a Llama block, a
# few new tokens, a contiguous cache), and gives bit for bit the same logits (tests/test_model.py). Weights come in
# as tuples of their arrays (`weight_arrays`), so one compiled version serves each weight format. Measured, A/B in
# one process, decode step at context 256: int8+a8 6.04 -> 5.75 ms, q4_1+a8 (native) 5.76 -> 5.13, fp32 19.14 ->
# 18.70; the same 30 layers with dim-64 matrices (what a step costs besides its arithmetic) 0.94 -> 0.59 ms.

def weight_arrays(w) -> tuple:
    """A weight as the tuple of arrays the compiled code takes: (w,) for float32, (q, scale) for int8 and
    int8-block (scale [O] or [O, I/32]), (packed, d, m) for q4_1."""
    return (w,) if isinstance(w, np.ndarray) else tuple(w._arrays())


def linear_into(w, x, out, int8_inputs):
    """out [M, O] = x [M, I] times w, given as `weight_arrays(w)`, M <= SMALL_M: the dispatch of `linear` and
    `_linear_quantized`, for compiled callers (the format is chosen when the caller compiles, the kernel for M
    when it runs)."""
    raise NotImplementedError("linear_into is called from compiled code only")


@overload(linear_into, jit_options=dict(fastmath=True, nogil=True))
def _linear_into_typed(w, x, out, int8_inputs):
    parts = w.types
    if len(parts) == 1:                                                          # float32
        def f32(w, x, out, int8_inputs):
            if x.shape[0] < TILE_MIN_ROWS:
                linear_f32_few(w[0], x, out)
            else:
                linear_f32(w[0], x, out)
        return f32
    # the quantized formats: the integer kernels for int8 inputs below TILE_MIN_ROWS, else the float kernels, on
    # the rounded rows if the inputs are int8
    if len(parts) == 2:                                  # int8: one scale per row (scale [O]) or per block of 32
        integer, floats = ((linear_int8_channel_vnni, linear_int8_channel) if parts[1].ndim == 1
                           else (linear_int8_block_vnni, linear_int8_block))

        def int8(w, x, out, int8_inputs):
            if int8_inputs and x.shape[0] < TILE_MIN_ROWS:
                integer(w[0], w[1], x, out)
            else:
                floats(w[0], w[1], round_rows(x) if int8_inputs else x, out)
        return int8

    def q4(w, x, out, int8_inputs):                                              # q4_1
        if int8_inputs and x.shape[0] < TILE_MIN_ROWS:
            linear_q4_vnni(w[0], w[1], w[2], x, out)
        else:
            linear_q4(w[0], w[1], w[2], round_rows(x) if int8_inputs else x, out)
    return q4


@njit(**_SERIAL)
def decode_block(x, attn_norm, ffn_norm, wqkv, wo, w_in, w_out, int8_inputs, k_cache, v_cache, pos, cos, sin,
                 n_heads, eps):
    """One Llama block for the T new tokens of a step (1 in a decode step, k+1 in a speculative verification,
    T <= FEW_TOKENS) at positions pos .. pos+T-1; x [T, D] is updated in place.
    Matrices as `weight_arrays` tuples, int8_inputs: for each of the four, whether it rounds its input to int8;
    k_cache, v_cache [S_max, KVH, Dh]: this layer's cache, where the tokens' K and V go; cos, sin [T, Dh/2]: the
    rotations of their positions."""
    T, D = x.shape
    KVH, Dh = k_cache.shape[1], k_cache.shape[2]
    H, half = n_heads, Dh // 2
    h = np.empty((T, D), np.float32)                            # [T, D] normed x
    delta = np.empty((T, D), np.float32)                        # [T, D] what a sub-block adds to x

    # attention
    _rmsnorm(x, attn_norm, eps, h)
    qkv = np.empty((T, (H + 2 * KVH) * Dh), np.float32)         # [T, (H + 2*KVH) * Dh]
    linear_into(wqkv, h, qkv, int8_inputs[0])
    q = np.empty((T, H, Dh), np.float32)                        # [T, H, Dh]
    for t in range(T):
        for head in range(H + KVH):                             # rotate q and k (half-split pairs, ops.apply_rope)
            for i in range(half):
                a, b = qkv[t, head * Dh + i], qkv[t, head * Dh + half + i]
                ra, rb = a * cos[t, i] - b * sin[t, i], b * cos[t, i] + a * sin[t, i]
                if head < H:
                    q[t, head, i], q[t, head, half + i] = ra, rb
                else:                                           # k goes straight into the cache at pos + t
                    k_cache[pos + t, head - H, i], k_cache[pos + t, head - H, half + i] = ra, rb
        for kvh in range(KVH):
            for j in range(Dh):
                v_cache[pos + t, kvh, j] = qkv[t, (H + KVH + kvh) * Dh + j]
    att = np.empty((T, H, Dh), np.float32)                      # [T, H, Dh]
    decode_attention(q, k_cache[:pos + T], v_cache[:pos + T], pos, att)
    linear_into(wo, att.reshape(T, H * Dh), delta, int8_inputs[1])
    for t in range(T):
        for i in range(D):
            x[t, i] += delta[t, i]

    # feed-forward
    _rmsnorm(x, ffn_norm, eps, h)
    gate_up = np.empty((T, w_in[0].shape[0]), np.float32)       # [T, 2F]
    linear_into(w_in, h, gate_up, int8_inputs[2])
    act = np.empty((T, gate_up.shape[1] // 2), np.float32)     # [T, F]
    if T >= 4:                                                  # as `swiglu` chooses
        _swiglu_rows(gate_up, act)
    else:
        _swiglu(gate_up, act)
    linear_into(w_out, act, delta, int8_inputs[3])
    for t in range(T):
        for i in range(D):
            x[t, i] += delta[t, i]


# --- dispatch --------------------------------------------------------------------------------------------------
# Up to SMALL_M rows (decode batches, speculative verification, prompts and prompt chunks of up to 128 tokens) the
# kernels above run, and attention and SwiGLU stay in Numba too; more rows go to BLAS sgemm and numpy attention.
# Mixing the two in one forward pass is the thing to avoid: OpenBLAS's and Numba's threads spin-wait on the same 2
# cores, and a 128-token fp32 prefill ran at 182 tok/s with Numba linears beside numpy attention, 215 with BLAS
# linears beside a parallel SwiGLU, 500 with either path alone. Measured 128-token prefill, Numba vs BLAS path:
# fp32 545-561 vs 492-504 tok/s, int8 573-596 vs 374-413, q4_1 374-392 vs 220 (each BLAS call on a quantized
# weight first dequantizes it, which costs the same whatever the number of rows). At 256 tokens: fp32 equal,
# int8 515-521 vs 458-467, q4_1 331-370 vs 391-423; at 512 BLAS wins (fp32 425-465 vs 367-376).
# The same holds for a pass of several sequences: its linears see all the rows, so past SMALL_M they run on BLAS,
# while each sequence's attention sees only its own. Transformer._block then sends attention to numpy as well:
# 8 prompts of 20 tokens in one pass (the engine's static batch) took 1012 ms with Numba attention beside the
# BLAS linears, 288 ms with numpy attention.
SMALL_M = 128
FUSED_DECODE = not config.DISABLE_JIT     # decode_block needs compiled code (linear_into has no Python body)
TILE_ROWS = 512   # rows of a quantized weight dequantized at a time for the BLAS path (fits in L2)


def linear(x: np.ndarray, w, b: np.ndarray | None = None) -> np.ndarray:
    """The fast twin of ops.linear: x [M, I] times w (float32 array or a quantized weight) -> [M, O].

    Up to SMALL_M rows (decode, batches, speculative verification, short prompts): the kernels above, which
    read each weight once. More (long prompts): numpy's BLAS sgemm, on float32 weights directly, or on quantized
    weights dequantized TILE_ROWS rows at a time, so no full fp32 copy of the weight is ever made.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, O = x.shape[0], w.shape[0]
    if M > SMALL_M:
        if isinstance(w, np.ndarray):
            out = x @ w.T                                                       # [M, O]
        else:
            if w.int8_inputs:
                x = round_activations(x)                                        # [M, I] on the int8 grid
            out = np.empty((M, O), dtype=np.float32)
            for r in range(0, O, TILE_ROWS):
                out[:, r:r + TILE_ROWS] = x @ w.dequantize(slice(r, r + TILE_ROWS)).T
    else:
        out = np.empty((M, O), dtype=np.float32)
        if isinstance(w, np.ndarray):
            (linear_f32_few if M < TILE_MIN_ROWS else linear_f32)(w, x, out)
        else:
            _linear_quantized(x, w, out)
    return out if b is None else out + b


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Twin of ops.attention. q [T, H, Dh], k, v [S, KVH, Dh] -> [T, H*Dh]. Up to FEW_TOKENS query tokens (decode,
    verification): the flash-decoding kernel. More: the causal kernel while the rows are few enough for the Numba
    linears (SMALL_M), numpy's batched matmuls (BLAS) beyond, where the linears use BLAS too."""
    T, H, Dh = q.shape
    if T > SMALL_M:
        return ops.attention(q, k, v, start)
    out = np.empty((T, H, Dh), dtype=np.float32)                              # [T, H, Dh]
    # contiguous operands, one compiled version each: a cache's k, v already are; without a cache v is a strided
    # view of the qkv rows, and a second version of each kernel for it cost ~6 s of compiling on a first run
    q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    (decode_attention if T <= FEW_TOKENS else causal_attention)(q, k, v, start, out)
    return out.reshape(T, H * Dh)


_warmed: set = set()


def _warm_decode_block(weight) -> None:
    """Compile decode_block for one weight format. weight(rows) -> a [rows, 32] matrix of that format."""
    H, KVH, Dh = 2, 1, BLOCK // 2                                   # so every matrix is [*, 32]: one block wide
    x, norm, trig = np.ones((1, BLOCK), np.float32), np.ones(BLOCK, np.float32), np.ones((1, Dh // 2), np.float32)
    kv = np.zeros((4, KVH, Dh), np.float32)                         # [S_max, KVH, Dh]
    mats = [weight(rows) for rows in ((H + 2 * KVH) * Dh, BLOCK, 2 * BLOCK, BLOCK)]   # wqkv, wo, w_in, w_out
    decode_block(x, norm, norm, *(weight_arrays(w) for w in mats), (False,) * 4, kv, kv, 0, trig, trig, H, 1e-5)


def warmup(weight_types=(np.ndarray, Int8Channel, Int8Block, Q4Block)) -> float:
    """Compile (or load from Numba's on-disk cache) the kernels a model needs, on tiny inputs shaped and laid out
    as the model passes them (a new array layout would mean a new compile in the middle of a request).
    weight_types: the weight classes the model holds. -> seconds it took (0 if nothing was left to do)."""
    t0 = time.perf_counter()
    x = np.ones((1, BLOCK), dtype=np.float32)
    formats = {np.ndarray: None, Int8Channel: "int8", Int8Block: "int8-block", Q4Block: "q4_1"}
    for t in weight_types:
        if t not in _warmed:
            w = np.ones((2, BLOCK), np.float32)
            if formats[t] is not None:
                w = quantize(w, formats[t])
            for int8_inputs in (False, True) if formats[t] else (False,):   # either activations setting
                if formats[t]:
                    w.int8_inputs = int8_inputs
                for rows in (1, TILE_MIN_ROWS):                             # the decode and the tiled kernels
                    linear(np.ones((rows, BLOCK), np.float32), w)
            if FUSED_DECODE:                                                # a decode step's fused blocks
                _warm_decode_block(lambda rows: np.ones((rows, BLOCK), np.float32) if formats[t] is None
                                   else quantize(np.ones((rows, BLOCK), np.float32), formats[t]))
            _warmed.add(t)
    if "ops" not in _warmed:
        for T in (2, FEW_TOKENS + 1):                               # decode_attention, then causal_attention
            kv = np.ones((T + 1, 1, 4), dtype=np.float32)
            attention(np.ones((T, 2, 4), np.float32), kv, kv, 1)
        rmsnorm(x, x[0], 1e-5)
        for T in (1, 2):            # q and k are views of the qkv rows: contiguous for one row, strided for more
            qkv = np.ones((T, 16), dtype=np.float32)
            apply_rope(qkv[:, :8].reshape(T, 2, 4), np.ones((T, 2), np.float32), np.ones((T, 2), np.float32))
        swiglu(np.ones((1, 4), np.float32))
        swiglu(np.ones((4, 4), np.float32))                        # the parallel form, for batches
        _warmed.add("ops")
    return time.perf_counter() - t0


def warmup_paged() -> float:
    """Compile (or load) the batched paged-attention kernel; PagedKVCache calls it when a pool is made, so
    only users of a paged pool pay for it (~2 s on a first run). -> seconds it took (0 if done already)."""
    if "paged" in _warmed:
        return 0.0
    t0 = time.perf_counter()
    from . import paged                                             # (imported here: paged imports this module)
    blocks = np.ones((2, 2, 1, 4), dtype=np.float32)                # [NB, BS, KVH, Dh]
    paged.paged_decode_attention(np.ones((2, 2, 4), np.float32), blocks, blocks,
                                 np.zeros((2, 1), np.int32), np.ones(2, np.int32))
    _warmed.add("paged")
    return time.perf_counter() - t0
