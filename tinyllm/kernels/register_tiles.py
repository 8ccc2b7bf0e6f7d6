"""Small matrix products C = A @ B a tile at a time, the tile's sums held in vector registers: the two products of
prefill attention (prefill_attention.py), scores = K . Q^T and P . V, each 64 deep, and a prompt chunk's linears
(panel_kernels.linear_panels: a few weight rows times the chunk's rows, transposed).

    product_tile(a, b, c, r0, n0, rows, vectors, a_transposed)
        c[r0 + i, n0 + j] = sum over k of A[r0 + i, k] * b[k, n0 + j]     for i < rows, j < 16 * vectors
        A is a ([M, K], a_transposed False) or a.T (a [K, M], True); b [K, N]; c [M, N]; float32, C-contiguous.
        rows, vectors and a_transposed are compile-time constants: one body per combination.

Why not the 4 x 4 tiles of linear_kernels.linear_tiled: they take dot products along K, 16 values at a time, and
each of a tile's 16 sums ends with an add across its vector's lanes. At K = 576 and more (a weight row) that end
is cheap; at K = 64 (a head's size, a key block) it cost about as much as the products. Here a tile walks K one
step at a time: b's row k is loaded once as `vectors` 16-float vectors, each A[r0 + i, k] is broadcast to a vector,
and the rows x vectors sums are multiply-adds into registers: nothing is ever added across lanes (the BLAS
micro-kernel's way: Goto and van de Geijn, "Anatomy of high-performance matrix multiplication", 2008). With
rows = 8 and up to 3 vectors a tile keeps 24 sums of the 32 AVX-512 registers busy. A CPU without AVX-512 has 16
registers of 8 floats, where such a tile's sums no longer fit and spill to memory (2.4-3.7x slower, one thread:
docs/design/kernels.md): there `product` takes tiles of 6 rows and 1 vector (12 registers of sums).

`product_tile_reference` is the same contract in plain loops: what runs with NUMBA_DISABLE_JIT=1 and what the tests
hold the IR to. The IR uses only generic vector operations, so it compiles for any CPU (narrower ones split each
16-float vector into smaller ones).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .isa import FEATURES
from .llvm_ir import call
from .numerics import SERIAL

LANES = 16           # float32 values per vector (one AVX-512 register)
TILE_ROWS = 8        # `product`'s rows of C come in multiples of this
# 32 vector registers of 16 floats (AVX-512), or fewer and narrower: which tiles `product` takes
WIDE = "avx512f" in FEATURES                 # (isa.py: none under NUMBA_DISABLE_JIT, AVX2's with TINYLLM_ISA=avx2)


@njit(**SERIAL)
def product_tile_reference(a, b, c, r0, n0, rows, vectors, a_transposed):
    for i in range(rows):
        for j in range(n0, n0 + LANES * vectors):
            total = np.float32(0.0)
            for k in range(b.shape[0]):
                total += (a[k, r0 + i] if a_transposed else a[r0 + i, k]) * b[k, j]
            c[r0 + i, j] = total


_i64, _f32 = ir.IntType(64), ir.FloatType()
_V16f32 = ir.VectorType(_f32, LANES)


def _tile_codegen(rows: int, vectors: int, a_transposed: bool):
    def codegen(context, builder, signature, args):
        a, b, c = (cgutils.create_struct_proxy(t)(context, builder, value=v)
                   for t, v in zip(signature.args[:3], args[:3]))
        r0, n0 = (context.cast(builder, v, t, types.int64) for v, t in zip(args[3:5], signature.args[3:5]))
        a_cols = cgutils.unpack_tuple(builder, a.shape, 2)[1]
        depth, b_cols = cgutils.unpack_tuple(builder, b.shape, 2)
        c_cols = cgutils.unpack_tuple(builder, c.shape, 2)[1]

        def vector_at(pointer, offset):                             # 16 floats from pointer + offset, unaligned
            return builder.load(builder.bitcast(builder.gep(pointer, [offset]), _V16f32.as_pointer()), align=4)

        def splat(x):
            one = builder.insert_element(ir.Constant(_V16f32, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

        sums = [[cgutils.alloca_once_value(builder, ir.Constant(_V16f32, [0.0] * LANES)) for _ in range(vectors)]
                for _ in range(rows)]
        with cgutils.for_range(builder, depth) as loop:
            k = loop.index
            b_row = builder.add(builder.mul(k, b_cols), n0)
            b_vectors = [vector_at(b.data, builder.add(b_row, ir.Constant(_i64, LANES * v))) for v in range(vectors)]
            for i in range(rows):
                r = builder.add(r0, ir.Constant(_i64, i))
                at = builder.add(builder.mul(k, a_cols), r) if a_transposed else builder.add(builder.mul(r, a_cols), k)
                a_value = splat(builder.load(builder.gep(a.data, [at])))
                for v in range(vectors):
                    s = sums[i][v]
                    builder.store(call(builder, "llvm.fma.v16f32", _V16f32, a_value, b_vectors[v], builder.load(s)), s)
        for i in range(rows):
            c_row = builder.add(builder.mul(builder.add(r0, ir.Constant(_i64, i)), c_cols), n0)
            for v in range(vectors):
                at = builder.gep(c.data, [builder.add(c_row, ir.Constant(_i64, LANES * v))])
                builder.store(builder.load(sums[i][v]), builder.bitcast(at, _V16f32.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic(prefer_literal=True)
def _product_tile_ir(typingctx, a, b, c, r0, n0, rows, vectors, a_transposed):
    constants = (rows, vectors, a_transposed)
    if not all(isinstance(t, (types.IntegerLiteral, types.BooleanLiteral)) for t in constants):
        return None                                                 # rows, vectors, a_transposed must be constants
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.ndim == 2 and t.layout == "C"
               for t in (a, b, c)):
        return None
    return (types.none(a, b, c, r0, n0, rows, vectors, a_transposed),
            _tile_codegen(rows.literal_value, vectors.literal_value, a_transposed.literal_value))


product_tile = product_tile_reference if config.DISABLE_JIT else _product_tile_ir


@njit(**SERIAL)
def product_wide(a, b, c, a_transposed):
    """c [M, N] = A @ b (A = a, or a.T with a_transposed) in tiles of TILE_ROWS rows and up to 3 vectors: M a
    multiple of TILE_ROWS, N of LANES. (The constants of each call below compile one tile body apiece.)"""
    M, N = c.shape
    for r0 in range(0, M, TILE_ROWS):
        n0 = 0
        while n0 < N:
            left = (N - n0) // LANES
            width = 3 if left % 3 == 0 or left > 4 else min(left, 2)   # 4 vectors as 2 + 2, not 3 + 1
            if width == 3:
                if a_transposed:
                    product_tile(a, b, c, r0, n0, 8, 3, True)
                else:
                    product_tile(a, b, c, r0, n0, 8, 3, False)
            elif width == 2:
                if a_transposed:
                    product_tile(a, b, c, r0, n0, 8, 2, True)
                else:
                    product_tile(a, b, c, r0, n0, 8, 2, False)
            else:
                if a_transposed:
                    product_tile(a, b, c, r0, n0, 8, 1, True)
                else:
                    product_tile(a, b, c, r0, n0, 8, 1, False)
            n0 += LANES * width


@njit(**SERIAL)
def product_narrow(a, b, c, a_transposed):
    """product_wide's contract for CPUs with 16 vector registers of 8 floats (AVX2): tiles of 6 rows and 1 vector
    (12 registers of sums, as BLIS's Haswell kernel keeps), then one of 4 and one of 2 for the rows left. A strip
    of 16 columns is done before the next, so its b values come from L1 for every tile of rows."""
    M, N = c.shape
    for n0 in range(0, N, LANES):
        r0 = 0
        while r0 + 6 <= M:
            if a_transposed:
                product_tile(a, b, c, r0, n0, 6, 1, True)
            else:
                product_tile(a, b, c, r0, n0, 6, 1, False)
            r0 += 6
        if r0 + 4 <= M:
            if a_transposed:
                product_tile(a, b, c, r0, n0, 4, 1, True)
            else:
                product_tile(a, b, c, r0, n0, 4, 1, False)
            r0 += 4
        if r0 < M:                                              # M is a multiple of 8: 2 rows are left, or none
            if a_transposed:
                product_tile(a, b, c, r0, n0, 2, 1, True)
            else:
                product_tile(a, b, c, r0, n0, 2, 1, False)


product = product_wide if WIDE else product_narrow
