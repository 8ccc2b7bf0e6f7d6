"""What every kernel module shares: the compile options, an exponential that vectorises, an in-place softmax.

Why exp32: without Intel's SVML library Numba turns np.exp into one call of the C library's expf per value, which
also stops the loop around it from vectorising (the SwiGLU of a batch and the softmaxes of attention would spend
their time there). exp32 is plain arithmetic that LLVM vectorises; its accuracy is tested against np.exp.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.extending import intrinsic

# error_model="numpy": a division by zero gives inf or NaN, as in numpy (the sampler refuses NaN or infinite logits
# with a clear error), instead of raising, which code inside a parallel region must not do: the other threads of
# block.py's threaded block would wait at its next barrier forever
PARALLEL = dict(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")   # loops worth both cores
SERIAL = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")   # small loops: threads would cost more
# fastmath without reassociation: exp32's two-part ln 2 would be folded back into one constant
NO_REASSOC = {"nnan", "ninf", "nsz", "arcp", "contract"}
# nor reciprocals or fused multiply-adds: each value is computed the same whether a loop is vectorised or not, so
# a per-value op gives the same bits from every caller (block.py's threaded block against the kernels)
EXACT_PER_VALUE = {"nnan", "ninf", "nsz"}

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

    @njit(fastmath=NO_REASSOC, cache=True, error_model="numpy")
    def exp32(x):
        """exp(x) for float32 x = 2^n * e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2].

        ln 2 is split in two constants so r keeps its precision (Cody and Waite); e^r is its Taylor polynomial to
        degree 6; 2^n is n + 127 written into a float's exponent bits. Inputs are clamped to [-87, 88], where
        float32 exp neither underflows nor overflows.
        """
        x = min(max(x, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))            # round(x / ln 2)
        r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)         # x - n ln 2, in two parts
        e_r = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (
            np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720))))))
        two_n = _float32_from_bits(np.int32((n + np.float32(127.0)) * np.float32(2.0 ** 23)))  # exponent bits
        return e_r * two_n


@njit(**SERIAL)
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


@njit(fastmath=EXACT_PER_VALUE, cache=True, nogil=True, error_model="numpy")
def ordered_sum(row, n):
    """row[:n].sum() in an order that no compiler changes: each 16 values added as a fixed tree of pairs, those
    sums one after another, then the last n % 16 values. With fastmath's reassociation LLVM picks a sum's order by
    how it vectorises the loop, which depends on where the loop is compiled (inlined into a caller, or loaded from
    the disk cache); the callers that must agree bit for bit (block.py's threaded block and the kernels) share this
    instead. (No scratch array: an allocation per call cost attention more than the sums of a short chunk.)"""
    total = np.float32(0.0)
    for i in range(0, n - n % 16, 16):
        r = row[i:i + 16]
        total += ((((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])))
                  + (((r[8] + r[9]) + (r[10] + r[11])) + ((r[12] + r[13]) + (r[14] + r[15]))))
    for i in range(n - n % 16, n):
        total += row[i]
    return total
