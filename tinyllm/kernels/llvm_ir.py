"""Pieces of LLVM IR that the hand-written kernels share: intdot.py's integer dot products and kv_rows.py's
attention rows (Numba cannot express vector instructions, so both write IR through llvmlite)."""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

_i32 = ir.IntType(32)


def call(builder, name, result_type, *args):
    """A call of the LLVM intrinsic `name` (declared in the module on first use)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result_type, [a.type for a in args]), name)
    return builder.call(fn, args)


def prefetch(builder, address, into_l2: bool = False):
    """Ask for the cache line at `address` (an i8*) to be read into the cache, for reading; no fault if it is not
    mapped (rows past the end of an array). into_l2: only as far as L2 (x86's prefetcht1, where prefetcht0 brings
    it into L1 too): the L1 tracks few misses at a time, and prefetches queued there hold up the loads behind them."""
    call(builder, "llvm.prefetch.p0", ir.VoidType(), address, ir.Constant(_i32, 0),
         ir.Constant(_i32, 2 if into_l2 else 3), ir.Constant(_i32, 1))


def lane_total(builder, v):
    """<n x float> -> the float32 sum of its lanes, halving the vector (n a power of two)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, n), list(range(n)))),
                         builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, n), list(range(n, 2 * n)))),
                         flags=("fast",))
    return builder.extract_element(v, ir.Constant(_i32, 0))
