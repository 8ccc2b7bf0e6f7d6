"""int8_tiles.py's integer register tiles in AVX2's instructions, and which tile a prompt chunk runs.

Without VNNI there is no vpdpbusd. The tile here keeps int8_tiles.py's panel layout and its `int8_tile` contract
(the panel's 16 weight rows are two ymm registers of 8 int32 lanes per step of 4 bytes) and multiplies as
intdot.py's AVX2 dots do, with llama.cpp's AVX2 kernels (ggml's mul_sum_i8_pairs, llamafile's tinyBLAS_Q0_AVX):
vpmaddubsw multiplies 32 unsigned by 32 signed bytes into 16-bit sums of adjacent pairs, vpmaddwd by ones adds
those pairs into the 4-product int32 lanes that vpdpbusd fills. 16-bit sums saturate past 32,767, hence:

  * int8 weights go in as |w| against sign(w) * x (vpsignb; at most 2 x 128 x 127 per pair), so the products are
    those of w and xq themselves and xcorr (VNNI's correction of w + 128) is not read: by its definition the
    contract's sum is the same;
  * 4-bit weights (with_minimums: panel values 0..15) go in unsigned as they are, and a block's 8 steps are added
    in 16 bits (at most 8 x 2 x 15 x 127 = 30,480) before one vpmaddwd widens them.

Tile shape: 16 weight rows (two ymm) x 4 input rows, because AVX2 has 16 ymm registers: 8 int32 sums, the 2 weight
vectors and their 2 magnitudes, a broadcast input and 2 temporaries (15; the float sums, touched once per block,
are the ones LLVM may keep in memory). Per step of 4 bytes: 2 loads and 2 vpsignb for the weights, then per input
row a broadcast and, per half, vpsignb, vpmaddubsw, vpmaddwd and an add (the 4-bit tile: vpmaddubsw and an add).
"""
from __future__ import annotations

from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import BLOCK
from .int8_tiles import PANEL_ROWS, TILE_COLS as VNNI_COLS, int8_tile, int8_tile_reference
from .intdot import HAVE_AVX2, HAVE_VNNI, INT_DOTS
from .llvm_ir import call

AVX2_COLS = 4        # input rows per AVX2 tile (see above)
HALF = 8             # weight rows per ymm: one int32 lane each

_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V32i8, _V16i16 = ir.VectorType(_i8, 32), ir.VectorType(_i16, 16)
_V8i32, _V8f32 = ir.VectorType(_i32, HALF), ir.VectorType(_f32, HALF)


def _tile_codegen(cols: int, with_minimums: bool):
    def codegen(context, builder, signature, args):
        panel, scales, minimums, xq, xs, xsum, out = (                            # (xcorr, args[4], unread)
            cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i])
            for i in (0, 1, 2, 3, 5, 6, 8))
        c0, m0, o0 = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (7, 9, 10))
        out_width = cgutils.unpack_tuple(builder, out.shape, 2)[1]
        width = cgutils.unpack_tuple(builder, xq.shape, 2)[1]                      # I
        n_blocks = cgutils.unpack_tuple(builder, xs.shape, 2)[1]                  # I / 32
        const = lambda n: ir.Constant(_i64, n)                                     # noqa: E731
        ones = ir.Constant(_V16i16, [1] * 16)

        def load(base, offset, type_, align):              # a type_ from base + offset (in base's elements)
            return builder.load(builder.bitcast(builder.gep(base, [offset]), type_.as_pointer()), align=align)

        def splat(value, vector_type):
            one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_i32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_i32, vector_type.count),
                                                                [0] * vector_type.count))

        def pairs(unsigned, signed):                       # vpmaddubsw: <32 x i8> x2 -> <16 x i16>
            return call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16i16, unsigned, signed)

        def quads(sums16):                                 # vpmaddwd by ones: <16 x i16> -> <8 x i32>
            return call(builder, "llvm.x86.avx2.pmadd.wd", _V8i32, sums16, ones)

        def sign(v, of):                                   # vpsignb: v negated where `of` < 0, zero where 0
            return call(builder, "llvm.x86.avx2.psign.b", _V32i8, v, of)

        rows = [builder.add(c0, const(c)) for c in range(cols)]
        halves = range(PANEL_ROWS // HALF)
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(_V8f32, [0.0] * HALF)) for _ in halves] for _ in rows]
        with cgutils.for_range(builder, n_blocks) as loop:
            b = loop.index
            at_b = [builder.add(builder.mul(c, n_blocks), b) for c in rows]         # [c, b] in xs and xsum
            zero = ir.Constant(_V16i16 if with_minimums else _V8i32, None)
            isums = [[zero for _ in halves] for _ in rows]  # 4-bit: 16-bit sums of the block, else int32
            for k in range(BLOCK // 4):
                step = builder.mul(builder.add(builder.mul(b, const(BLOCK // 4)), const(k)), const(4 * PANEL_ROWS))
                weights = [load(panel.data, builder.add(step, const(4 * HALF * h)), _V32i8, 1) for h in halves]
                if not with_minimums:
                    magnitudes = [sign(w, w) for w in weights]
                for i, c in enumerate(rows):
                    at = builder.add(builder.mul(c, width), builder.add(builder.mul(b, const(BLOCK)), const(4 * k)))
                    x = builder.bitcast(splat(load(xq.data, at, _i32, 1), _V8i32), _V32i8)   # 4 bytes, every lane
                    for h in halves:
                        if with_minimums:
                            isums[i][h] = builder.add(isums[i][h], pairs(weights[h], x))
                        else:
                            isums[i][h] = builder.add(isums[i][h], quads(pairs(magnitudes[h], sign(x, weights[h]))))
            for h in halves:
                block_scales = load(scales.data, builder.add(builder.mul(b, const(PANEL_ROWS)), const(HALF * h)),
                                    _V8f32, 4)
                if with_minimums:
                    block_minimums = load(minimums.data, builder.add(builder.mul(b, const(PANEL_ROWS)),
                                                                     const(HALF * h)), _V8f32, 4)
                for i, at in enumerate(at_b):
                    isum = quads(isums[i][h]) if with_minimums else isums[i][h]
                    scale = builder.fmul(block_scales, splat(builder.load(builder.gep(xs.data, [at])), _V8f32))
                    total = builder.fadd(builder.load(sums[i][h]), builder.fmul(builder.sitofp(isum, _V8f32), scale))
                    if with_minimums:
                        total = builder.fadd(total, builder.fmul(block_minimums, splat(
                            builder.load(builder.gep(xsum.data, [at])), _V8f32)))
                    builder.store(total, sums[i][h])
        for i in range(cols):
            row = builder.add(builder.mul(builder.add(m0, const(i)), out_width), o0)
            for h in halves:
                address = builder.gep(out.data, [builder.add(row, const(HALF * h))])
                builder.store(builder.load(sums[i][h]), builder.bitcast(address, _V8f32.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic(prefer_literal=True)
def int8_tile_avx2(typingctx, panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, with_minimums):
    """int8_tiles.int8_tile's contract in AVX2 (xcorr unread; with_minimums: panel values 0..15)."""
    if not (isinstance(cols, types.IntegerLiteral) and isinstance(with_minimums, types.BooleanLiteral)):
        return None                                           # cols and with_minimums must be compile-time constants
    arrays = ((panel, types.int8), (scales, types.float32), (minimums, types.float32), (xq, types.int8),
              (xcorr, types.int32), (xs, types.float32), (xsum, types.float32), (out, types.float32))
    if not all(isinstance(a, types.Array) and a.dtype == t and a.ndim == 2 and a.layout == "C" for a, t in arrays):
        return None
    return (types.none(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, with_minimums),
            _tile_codegen(cols.literal_value, with_minimums.literal_value))


# each instruction set's tile the host can run -> (tile, input rows per tile); the tests hold each to the reference
TILES = {} if config.DISABLE_JIT else {isa: tile for isa, have, tile in (
    ("vnni", HAVE_VNNI, (int8_tile, VNNI_COLS)), ("avx2", HAVE_AVX2, (int8_tile_avx2, AVX2_COLS))) if have}
# what prompt chunks run: the target's tile (TINYLLM_ISA=avx2: AVX2's), else the plain loops in VNNI's shape
INTEGER_TILE, TILE_COLS = TILES.get(INT_DOTS, (int8_tile_reference, VNNI_COLS))
