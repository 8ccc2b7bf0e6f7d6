"""Integer register tiles: a prompt chunk's linears with int8 or 4-bit weights and int8-rounded inputs (VNNI).

Why: with quantized weights a prompt chunk's linears are bound by arithmetic, not memory, and the float tiles
convert every weight to float first (linear_kernels.linear_tiled and panel_kernels.linear_panels on
quant.round_activations' rows). vpdpbusd instead multiplies 64 byte pairs and adds them into 16 int32 sums in one
instruction, four times the products of a float multiply-add. intdot.py uses it along one weight row (a dot product
per output, its lanes added at the end); here the lanes are 16 different weight rows, as in a BLAS micro-kernel:
each step broadcasts 4 bytes of one input row to every lane and multiplies them by the same 4 bytes of 16 weight
rows, so a block's 32 products for 16 outputs are 8 instructions and nothing is ever added across lanes.

That needs the 16 rows interleaved 4 bytes at a time, a "panel" (`pack_panel`, `pack_q4_panel`: made once per
chunk and weight-row task, then used by every input row). With Q the stored integers (int8, or the 4-bit values
0..15 of W = scale * Q + minimum):

    panel [I/4, 64] int8      panel[k, 4r + j] = Q[o0 + r, 4k + j]        (r < 16)
    scales [I/32, 16] f32     scales[b, r] = row r's scale for block b (int8 per row: the row's one scale)
    minimums [I/32, 16] f32   minimums[b, r] = row r's minimum for block b (4-bit only)

and the input rows rounded to int8 blocks (panel_kernels.tile_inputs): xq [C, I] int8, xs [C, I/32] their block
scales, xcorr [C, I/32] int32 = -128 times each block's sum of xq (what the weights' +128 adds, taken back) and
xsum [C, I/32] = xs times each block's sum of xq (what a minimum multiplies).

    int8_tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, with_minimums)
        out[m0 + c, o0 + r] = sum over blocks b of  scales[b, r] * xs[c0 + c, b] * isum(b, c, r)
                                                  (+ minimums[b, r] * xsum[c0 + c, b] if with_minimums)  for c < cols
        isum(b, c, r) = xcorr[c0 + c, b] + sum over j < 32 of  (P[8b + j // 4, 4r + j % 4] + 128) * xq[c0 + c, 32b + j]
        with P the panel: the integer dot product of Q[o0 + r] and input row c0 + c over block b (vpdpbusd takes
        one operand as unsigned bytes, so the tile adds 128 to each weight and xcorr takes back what that adds);
        cols and with_minimums compile-time constants.

`int8_tile_reference` is that contract in plain loops (NUMBA_DISABLE_JIT=1, and what the tests hold the IR to).
The tile's IR here needs VNNI; int8_tiles_avx2.py has the same contract in AVX2 and says which tile runs. Why:
docs/design/kernels.md, "Prompt chunks".
"""
from __future__ import annotations

import numpy as np
from numba import config, njit, types
from numba.extending import intrinsic

from ..quant import BLOCK
from .intdot import HAVE_VNNI, INT_DOTS
from .numerics import SERIAL

PANEL_ROWS = 16      # weight rows per panel: one int32 lane each
TILE_COLS = 8        # input rows per tile: 8 integer and 8 float sums of 16 lanes in registers


@njit(**SERIAL)
def pack_words_reference(q, o0, panel):
    """panel <- the weights of pack_panel's layout; rows past O are zeros."""
    O, I = q.shape
    n = min(O, o0 + PANEL_ROWS) - o0
    words = q.view(np.int32)                                    # [O, I/4] each 4 weights as one int32
    panel_words = panel.view(np.int32)                          # [I/4, 16]
    for k in range(I // 4):
        for r in range(n):
            panel_words[k, r] = words[o0 + r, k]
        for r in range(n, PANEL_ROWS):
            panel_words[k, r] = 0


pack_words = pack_words_reference


@njit(**SERIAL)
def pack_panel(q, s, o0, panel, scales):
    """panel, scales <- weight rows o0 .. o0+15 of an int8 weight (q [O, I], s [O, 1] one scale per row or
    [O, I/32] per block) in the layout above, the weights as they are (the tile adds the 128); rows past O are
    zero weights with zero scales."""
    O, I = q.shape
    n = min(O, o0 + PANEL_ROWS) - o0
    if n == PANEL_ROWS and I % 64 == 0:
        pack_words(q, o0, panel)
    else:
        pack_words_reference(q, o0, panel)
    per_row = s.shape[1] == 1
    for r in range(n):                          # along s's rows: each row's scales are adjacent there
        for b in range(I // BLOCK):
            scales[b, r] = s[o0 + r, 0 if per_row else b]
    for r in range(n, PANEL_ROWS):
        for b in range(I // BLOCK):
            scales[b, r] = 0.0


@njit(**SERIAL)
def pack_q4_panel(packed, d, mins, o0, values, panel, scales, minimums):
    """panel, scales, minimums <- weight rows o0 .. o0+15 of a 4-bit weight (packed [O, I/2] in Q4_1's nibble
    order, d and mins [O, I/32]) in the layout above, through values [16, I] int8 (the rows' 4-bit values
    unpacked in order); rows past O are zeros with zero scales and minimums."""
    O, half = packed.shape
    n = min(O, o0 + PANEL_ROWS) - o0
    for r in range(n):
        for b in range(half // 16):
            for k in range(16):                 # byte k of block b: value k low, value k + 16 high
                byte = packed[o0 + r, 16 * b + k]
                values[r, BLOCK * b + k] = byte & 15
                values[r, BLOCK * b + 16 + k] = byte >> 4
            scales[b, r], minimums[b, r] = d[o0 + r, b], mins[o0 + r, b]
    for r in range(n, PANEL_ROWS):
        for i in range(2 * half):
            values[r, i] = 0
        for b in range(half // 16):
            scales[b, r], minimums[b, r] = 0.0, 0.0
    if 2 * half % 64 == 0:
        pack_words(values, 0, panel)
    else:
        pack_words_reference(values, 0, panel)


@njit(**SERIAL)
def int8_tile_reference(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, with_minimums):
    for c in range(c0, c0 + cols):
        for r in range(PANEL_ROWS):
            total = np.float32(0.0)
            for b in range(xs.shape[1]):
                isum = np.int32(xcorr[c, b])
                for j in range(BLOCK):
                    weight = np.int32(panel[8 * b + j // 4, 4 * r + j % 4]) + 128      # as vpdpbusd's unsigned
                    isum += weight * np.int32(xq[c, BLOCK * b + j])
                total += np.float32(isum) * (scales[b, r] * xs[c, b])
                if with_minimums:
                    total += minimums[b, r] * xsum[c, b]
            out[m0 + c - c0, o0 + r] = total


int8_tile = int8_tile_reference

if INT_DOTS and not config.DISABLE_JIT:          # the tile's IR needs VNNI; the panel's is plain vectors
    from llvmlite import ir
    from numba.core import cgutils

    from .llvm_ir import call, prefetch

    _i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    _V16i32, _V16f32 = ir.VectorType(_i32, PANEL_ROWS), ir.VectorType(_f32, PANEL_ROWS)

    def _tile_codegen(cols: int, with_minimums: bool):
        def codegen(context, builder, signature, args):
            panel, scales, minimums, xq, xcorr, xs, xsum, out = (
                cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i])
                for i in (0, 1, 2, 3, 4, 5, 6, 8))
            c0, m0, o0 = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (7, 9, 10))
            out_width = cgutils.unpack_tuple(builder, out.shape, 2)[1]
            width = cgutils.unpack_tuple(builder, xq.shape, 2)[1]                  # I
            n_blocks = cgutils.unpack_tuple(builder, xs.shape, 2)[1]              # I / 32
            const = lambda n: ir.Constant(_i64, n)                                 # noqa: E731

            def load(base, offset, type_, align):          # a type_ from base + offset (in base's elements)
                return builder.load(builder.bitcast(builder.gep(base, [offset]), type_.as_pointer()), align=align)

            def splat(value, vector_type):
                one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_i32, 0))
                return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_i32, PANEL_ROWS),
                                                                    [0] * PANEL_ROWS))

            plus_128 = ir.Constant(_V16i32, [-0x7F7F7F80] * PANEL_ROWS)           # 0x80808080: each byte's top bit
            rows = [builder.add(c0, const(c)) for c in range(cols)]
            sums = [cgutils.alloca_once_value(builder, ir.Constant(_V16f32, [0.0] * PANEL_ROWS)) for _ in rows]
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                at_b = [builder.add(builder.mul(c, n_blocks), b) for c in rows]     # [c, b] in xcorr and xs
                isums = [splat(builder.load(builder.gep(xcorr.data, [at])), _V16i32) for at in at_b]
                for k in range(BLOCK // 4):
                    weights = load(panel.data, builder.mul(builder.add(builder.mul(b, const(8)), const(k)),
                                                           const(4 * PANEL_ROWS)), _V16i32, 1)
                    weights = builder.xor(weights, plus_128)                # + 128: unsigned bytes for vpdpbusd
                    for i, c in enumerate(rows):
                        at = builder.add(builder.mul(c, width), builder.add(builder.mul(b, const(BLOCK)),
                                                                            const(4 * k)))
                        inputs = splat(load(xq.data, at, _i32, 1), _V16i32)     # 4 input bytes in every lane
                        isums[i] = call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16i32, isums[i], weights,
                                        inputs)
                block_scales = load(scales.data, builder.mul(b, const(PANEL_ROWS)), _V16f32, 4)
                if with_minimums:
                    block_minimums = load(minimums.data, builder.mul(b, const(PANEL_ROWS)), _V16f32, 4)
                for i, at in enumerate(at_b):
                    scale = builder.fmul(block_scales, splat(builder.load(builder.gep(xs.data, [at])), _V16f32))
                    term = builder.fmul(builder.sitofp(isums[i], _V16f32), scale)
                    total = builder.fadd(builder.load(sums[i]), term)
                    if with_minimums:
                        total = builder.fadd(total, builder.fmul(block_minimums, splat(
                            builder.load(builder.gep(xsum.data, [at])), _V16f32)))
                    builder.store(total, sums[i])
            for i in range(cols):
                address = builder.gep(out.data, [builder.add(builder.mul(builder.add(m0, const(i)), out_width), o0)])
                builder.store(builder.load(sums[i]), builder.bitcast(address, _V16f32.as_pointer()), align=4)
            return context.get_dummy_value()
        return codegen

    def _pack_codegen(context, builder, signature, args):
        """Whole panels only (16 rows, I a multiple of 64): each 16 x 16 block of 4-byte words (16 rows' next 64
        bytes) is read as 16 vectors and transposed in registers, halving the block size each round: at size h,
        rows i and i + h swap their off-diagonal h x h blocks (4 rounds of 16 two-vector shuffles). The same 64
        bytes of the next panel's rows, if q has them, are asked for into L2 meanwhile: 16 rows read side by side
        are short streams the hardware prefetcher keeps restarting (dot_tiles.py says more)."""
        q, panel = (cgutils.create_struct_proxy(t)(context, builder, value=v)
                    for t, v in zip((signature.args[0], signature.args[2]), (args[0], args[2])))
        o0 = context.cast(builder, args[1], signature.args[1], types.int64)
        n_rows, width = cgutils.unpack_tuple(builder, q.shape, 2)                  # O, I
        const = lambda n: ir.Constant(_i64, n)                                     # noqa: E731
        first_row = builder.gep(q.data, [builder.mul(o0, width)])
        next_panel = builder.icmp_signed("<=", builder.add(o0, const(2 * PANEL_ROWS)), n_rows)
        with cgutils.for_range(builder, builder.udiv(width, const(64))) as loop:
            at = builder.mul(loop.index, const(64))                                # this block's first byte
            with builder.if_then(next_panel):
                for r in range(PANEL_ROWS, 2 * PANEL_ROWS):
                    prefetch(builder, builder.gep(first_row, [builder.add(builder.mul(const(r), width), at)]),
                             into_l2=True)
            words = [builder.load(builder.bitcast(builder.gep(first_row, [builder.add(builder.mul(const(r), width),
                                                                                      at)]),
                                                  _V16i32.as_pointer()), align=1) for r in range(PANEL_ROWS)]
            h = PANEL_ROWS // 2
            while h:
                keep = [j if j & h == 0 else PANEL_ROWS + j - h for j in range(PANEL_ROWS)]
                take = [j + h if j & h == 0 else PANEL_ROWS + j for j in range(PANEL_ROWS)]
                for i in range(PANEL_ROWS):
                    if i & h == 0:
                        a, b = words[i], words[i + h]
                        words[i] = builder.shuffle_vector(a, b, ir.Constant(_V16i32, keep))
                        words[i + h] = builder.shuffle_vector(a, b, ir.Constant(_V16i32, take))
                h //= 2
            for k in range(PANEL_ROWS):                                        # panel rows at/4 .. at/4 + 15
                address = builder.gep(panel.data, [builder.add(builder.mul(at, const(PANEL_ROWS)),
                                                               const(4 * PANEL_ROWS * k))])
                builder.store(words[k], builder.bitcast(address, _V16i32.as_pointer()), align=1)
        return context.get_dummy_value()

    @intrinsic
    def _pack_words_ir(typingctx, q, o0, panel):
        if not all(isinstance(a, types.Array) and a.dtype == types.int8 and a.ndim == 2 and a.layout == "C"
                   for a in (q, panel)):
            return None
        return types.none(q, o0, panel), _pack_codegen

    @intrinsic(prefer_literal=True)
    def _int8_tile_ir(typingctx, panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols,
                      with_minimums):
        if not (isinstance(cols, types.IntegerLiteral) and isinstance(with_minimums, types.BooleanLiteral)):
            return None                                       # cols and with_minimums must be compile-time constants
        arrays = ((panel, types.int8), (scales, types.float32), (minimums, types.float32), (xq, types.int8),
                  (xcorr, types.int32), (xs, types.float32), (xsum, types.float32), (out, types.float32))
        if not all(isinstance(a, types.Array) and a.dtype == t and a.ndim == 2 and a.layout == "C"
                   for a, t in arrays):
            return None
        return (types.none(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, with_minimums),
                _tile_codegen(cols.literal_value, with_minimums.literal_value))

    pack_words = _pack_words_ir
    if HAVE_VNNI:
        int8_tile = _int8_tile_ir
