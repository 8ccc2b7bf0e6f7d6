"""Float32 dot-product tiles: a few weight rows times a few input rows, for linears of 8 to 31 input rows (a batch
of sequences decoding together, a short prompt) with fp32 weights.

    dot_tile(w, o, x, m, out)
        out[m + c, o + r] = sum over i of w[o + r, i] * x[m + c, i]      for r < DOT_ROWS, c < DOT_INPUTS
        w [O, I], x [M, I], out [M, O]: float32, C-contiguous; the tile's rows must exist.

Each of the tile's DOT_ROWS x DOT_INPUTS sums is a vector register of partial sums along I, added across its lanes
once at the end (at I = 576 and more that end is cheap: register_tiles.py says why the products of attention, 64
deep, do the opposite). Each step loads one vector of every weight row and every input row: DOT_ROWS + DOT_INPUTS
loads feed DOT_ROWS x DOT_INPUTS multiply-adds. 4 x 4 tiles of 16 floats with AVX-512 (16 of its 32 registers
hold sums); 2 x 4 of 8 floats with AVX2's 16 registers, where 4 x 4 spills.

Why in IR and not in Numba's loops (linear_kernels.linear_tiled, which int8 weights still take): the step also asks
for the next tile's weight rows, at the same place along I, to be brought into L2 (x86's prefetcht1). A tile reads
DOT_ROWS rows side by side, short streams the hardware prefetcher keeps restarting, and without this the read of
the weights from memory and the arithmetic took turns instead of overlapping (docs/design/kernels.md, "Linear
layers"). Into L2 only: prefetches into L1 as well held up the tile's own loads and bought nothing.

`dot_tile_reference` is the contract in plain loops: what runs under NUMBA_DISABLE_JIT=1 and what the tests hold
the IR to.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .llvm_ir import call, lane_total, prefetch
from .numerics import SERIAL
from .register_tiles import WIDE

DOT_ROWS, DOT_INPUTS = (4, 4) if WIDE else (2, 4)
_LANES = 16 if WIDE else 8                # floats per vector of partial sums


@njit(**SERIAL)
def dot_tile_reference(w, o, x, m, out):
    for r in range(DOT_ROWS):
        for c in range(DOT_INPUTS):
            total = np.float32(0.0)
            for i in range(w.shape[1]):
                total += w[o + r, i] * x[m + c, i]
            out[m + c, o + r] = total


_i64, _f32 = ir.IntType(64), ir.FloatType()
_VECTOR = ir.VectorType(_f32, _LANES)


def _dot_tile_codegen(context, builder, signature, args):
    w, x, out = (cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]) for i in (0, 2, 4))
    o, m = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 3))
    n_cols = builder.extract_value(w.shape, 1)                                    # I
    out_cols = builder.extract_value(out.shape, 1)                                # O
    const = lambda v: ir.Constant(_i64, v)                                        # noqa: E731
    w_rows = [builder.gep(w.data, [builder.mul(builder.add(o, const(r)), n_cols)]) for r in range(DOT_ROWS)]
    x_rows = [builder.gep(x.data, [builder.mul(builder.add(m, const(c)), n_cols)]) for c in range(DOT_INPUTS)]
    next_tile = builder.mul(n_cols, const(DOT_ROWS))                              # floats from a row to its twin
    sums = [[cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [0.0] * _LANES)) for _ in x_rows]
            for _ in w_rows]
    whole = builder.sub(n_cols, builder.urem(n_cols, const(_LANES)))              # columns in whole vectors

    def vector(row, i):
        return builder.load(builder.bitcast(builder.gep(row, [i]), _VECTOR.as_pointer()), align=4)

    with cgutils.for_range_slice(builder, const(0), whole, const(_LANES)) as (i, _):
        for row in w_rows:              # the next tile's row here (AVX2: each line asked for twice, which costs little)
            prefetch(builder, builder.bitcast(builder.gep(row, [builder.add(i, next_tile)]), ir.IntType(8).as_pointer()),
                     into_l2=True)
        w_vectors, x_vectors = [vector(row, i) for row in w_rows], [vector(row, i) for row in x_rows]
        for r, wv in enumerate(w_vectors):
            for c, xv in enumerate(x_vectors):
                s = sums[r][c]
                builder.store(call(builder, f"llvm.fma.v{_LANES}f32", _VECTOR, wv, xv, builder.load(s)), s)
    totals = [[cgutils.alloca_once_value(builder, lane_total(builder, builder.load(s))) for s in row] for row in sums]
    with cgutils.for_range_slice(builder, whole, n_cols, const(1)) as (i, _):   # the columns past the last vector
        for r, w_row in enumerate(w_rows):
            wi = builder.load(builder.gep(w_row, [i]))
            for c, x_row in enumerate(x_rows):
                t = totals[r][c]
                builder.store(builder.fadd(builder.load(t), builder.fmul(wi, builder.load(builder.gep(x_row, [i])))),
                              t)
    for r in range(DOT_ROWS):
        for c in range(DOT_INPUTS):
            at = builder.add(builder.mul(builder.add(m, const(c)), out_cols), builder.add(o, const(r)))
            builder.store(builder.load(totals[r][c]), builder.gep(out.data, [at]))
    return context.get_dummy_value()


@intrinsic
def _dot_tile_ir(typingctx, w, o, x, m, out):
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.ndim == 2 and t.layout == "C"
               for t in (w, x, out)):
        return None
    return types.none(w, o, x, m, out), _dot_tile_codegen


dot_tile = dot_tile_reference if config.DISABLE_JIT else _dot_tile_ir
