"""Integer dot products of one quantized weight row with one input row rounded to int8 blocks.

Converting every int8 or 4-bit weight to float costs more than reading it from memory, so a quantized decode step
would be bound by arithmetic. With the input rounded to int8 too (quant.quantize_activations: one scale per block
of 32 values), each block's dot product is an integer sum that AVX-512 VNNI computes in one instruction: vpdpbusd
multiplies 32 unsigned bytes by 32 signed bytes and adds each group of 4 products into one of 8 int32 lanes.

The contract (what every function here returns, as float32; the callers in linear_kernels.py prepare the inputs):

    dot_int8(w, o, xq, xabs, xs)
        w [O, I] int8 weights, o a row of w, xq [I] int8 rounded input, xabs [I] = |xq|, xs [ceil(I/32)] scales.
        -> sum over the FULL blocks b < I // 32 of  xs[b] * sum_j w[o, 32b+j] * xq[32b+j]   (a short last block
           is the caller's)
    dot_int8_block(w, o, ws, xq, xabs, xs)
        as dot_int8, ws [O, I/32] the weight's block scales (I a multiple of 32).
        -> sum over b of  ws[o, b] * xs[b] * sum_j w[o, 32b+j] * xq[32b+j]
    dot_q4(w, o, d, mins, xpair, xs8, xsum8)
        w [O, I/2] packed 4-bit (Q4_1 order: byte j of a block holds value j low, value j+16 high), d, mins
        [O, I/32]; for each PAIR p of blocks (b, b+1) = (2p, 2p+1): xpair[64p : 64p+64] the rounded input in the
        order of the nibbles of the pair's 32 bytes (values 0-15 of b, 0-15 of b+1, 16-31 of b, 16-31 of b+1),
        xs8[p, lane] the input scale of lane's block (lanes 0-3: block b, 4-7: b+1), xsum8[p, lane] the rounded
        input summed over the 8 values that lane multiplies, times that scale.
        -> sum over pairs p and lanes l of  isum[p, l] * d[o, b_l] * xs8[p, l] + mins[o, b_l] * xsum8[p, l],
           b_l = 2p + l // 4, isum[p, l] = the integer dot of the 4 bytes 4l..4l+3 of the pair (both nibbles) with
           their 8 input values. (An odd last block is the caller's.)

Each has a plain-Numba `*_reference` body with the same contract. The VNNI versions are LLVM IR written here
(Numba cannot express vector instructions); where the CPU lacks VNNI, or with NUMBA_DISABLE_JIT=1, the plain names
are the reference bodies. `USE_VNNI` is what the dispatch passes as `vnni` to the kernels that call these; the
environment variable TINYLLM_NO_VNNI=1 forces the reference bodies on a VNNI host too.
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import BLOCK
from .numerics import SERIAL

HAVE_VNNI = (not config.DISABLE_JIT and not config.CPU_NAME       # (a portable build targets no host features)
             and {"avx512vnni", "avx512vl"} <= set(f[1:] for f in llvm.get_host_cpu_features().flatten().split(",")
                                                   if f.startswith("+")))
USE_VNNI = HAVE_VNNI and os.environ.get("TINYLLM_NO_VNNI", "") in ("", "0")
# Rows are short (576 int8 or 288 packed bytes), so the hardware prefetcher keeps restarting: ask this far ahead.
PREFETCH_BYTES = 2048


# --- the reference bodies ----------------------------------------------------------------------------------------
@njit(**SERIAL)
def _int8_block_sum(w, o, xq, b):
    """sum_j w[o, 32b+j] * xq[32b+j] in int32"""
    s = np.int32(0)
    for j in range(b * BLOCK, (b + 1) * BLOCK):
        s += np.int32(w[o, j]) * np.int32(xq[j])
    return s


@njit(**SERIAL)
def dot_int8_reference(w, o, xq, xabs, xs):
    acc = np.float32(0.0)
    for b in range(w.shape[1] // BLOCK):
        acc += np.float32(_int8_block_sum(w, o, xq, b)) * xs[b]
    return acc


@njit(**SERIAL)
def dot_int8_block_reference(w, o, ws, xq, xabs, xs):
    acc = np.float32(0.0)
    for b in range(ws.shape[1]):
        acc += np.float32(_int8_block_sum(w, o, xq, b)) * (xs[b] * ws[o, b])
    return acc


@njit(**SERIAL)
def dot_q4_reference(w, o, d, mins, xpair, xs8, xsum8):
    acc = np.float32(0.0)
    for p in range(d.shape[1] // 2):
        for lane in range(8):
            isum = np.int32(0)
            for k in range(4 * lane, 4 * lane + 4):
                byte = np.int32(w[o, BLOCK * p + k])              # the pair's 32 bytes
                isum += (byte & 15) * np.int32(xpair[64 * p + k]) + (byte >> 4) * np.int32(xpair[64 * p + 32 + k])
            b = 2 * p + lane // 4
            acc += np.float32(isum) * (d[o, b] * xs8[p, lane]) + mins[o, b] * xsum8[p, lane]
    return acc


dot_int8, dot_int8_block, dot_q4 = dot_int8_reference, dot_int8_block_reference, dot_q4_reference


# --- the VNNI versions, in LLVM IR -----------------------------------------------------------------------------
if HAVE_VNNI:
    _i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    _V32i8, _V8i32, _V4i32 = ir.VectorType(_i8, 32), ir.VectorType(_i32, 8), ir.VectorType(_i32, 4)
    _V2f32, _V8f32 = ir.VectorType(_f32, 2), ir.VectorType(_f32, 8)
    _FAST = ("fast",)

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
        """sum over i < n_steps of step(i) (an <8 x float>) in two running sums, so that consecutive adds do not
        wait on each other, prefetching the weight row PREFETCH_BYTES ahead. -> the float32 total of the lanes."""
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8f32, [0.0] * 8)) for _ in range(2)]

        def add(i, acc_ptr):
            builder.store(builder.fadd(builder.load(acc_ptr), step(i), flags=_FAST), acc_ptr)

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
        acc = builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=_FAST)
        half = builder.fadd(builder.shuffle_vector(acc, acc, ir.Constant(_V4i32, [0, 1, 2, 3])),        # 8 -> 4
                            builder.shuffle_vector(acc, acc, ir.Constant(_V4i32, [4, 5, 6, 7])), flags=_FAST)
        lane = [builder.extract_element(half, ir.Constant(_i32, j)) for j in range(4)]
        return builder.fadd(builder.fadd(lane[0], lane[1], flags=_FAST),
                            builder.fadd(lane[2], lane[3], flags=_FAST), flags=_FAST)

    def _structs(context, builder, signature, args, names):
        """The intrinsic's arguments by name: arrays as struct proxies (.data, .shape), the row index o as is."""
        return {name: val if name == "o" else cgutils.create_struct_proxy(ty)(context, builder, value=val)
                for name, ty, val in zip(names.split(), signature.args, args)}

    def _int8_dot_codegen(kind):
        """dot_int8 (kind "int8") or dot_int8_block (kind "int8-block"). vpdpbusd needs one unsigned operand:
        |xq| is unsigned and sign(xq) moves onto the weight (vpsignb), which leaves every product unchanged."""
        names = {"int8": "w o xq xabs xs", "int8-block": "w o ws xq xabs xs"}[kind]

        def codegen(context, builder, signature, args):
            a = _structs(context, builder, signature, args, names)
            o, xs = a["o"], a["xs"]
            row_len = builder.extract_value(a["w"].shape, 1)                 # bytes per weight row
            row = builder.gep(a["w"].data, [builder.mul(o, row_len)])
            if kind == "int8":
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
                return builder.fmul(builder.sitofp(isum, _V8f32), _splat(builder, scale), flags=_FAST)
            return _row_sum(builder, n_blocks, block, row, BLOCK)
        return codegen

    def _q4_dot_codegen(context, builder, signature, args):
        """dot_q4: one 32-byte load is a pair of blocks' packed bytes; its low nibbles meet xpair's first 32 values
        and its high nibbles the next 32, so a pair costs one load, two masks and two vpdpbusd. vpdpbusd's lanes
        0-3 then hold block b's share and 4-7 block b+1's; one shuffle spreads each block's d and min over its
        four lanes."""
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
            scale = builder.fmul(both(d_row), _load(builder, a["xs8"].data, lanes, _V8f32), flags=_FAST)
            term = builder.fmul(builder.sitofp(isum, _V8f32), scale, flags=_FAST)
            return builder.fadd(term, builder.fmul(both(mins_row), _load(builder, a["xsum8"].data, lanes, _V8f32),
                                                   flags=_FAST), flags=_FAST)
        n_pairs = builder.udiv(n_blocks, ir.Constant(n_blocks.type, 2))
        return _row_sum(builder, n_pairs, pair, row, BLOCK)

    @intrinsic
    def dot_int8(typingctx, w, o, xq, xabs, xs):
        return types.float32(w, o, xq, xabs, xs), _int8_dot_codegen("int8")

    @intrinsic
    def dot_int8_block(typingctx, w, o, ws, xq, xabs, xs):
        return types.float32(w, o, ws, xq, xabs, xs), _int8_dot_codegen("int8-block")

    @intrinsic
    def dot_q4(typingctx, w, o, d, mins, xpair, xs8, xsum8):
        return types.float32(w, o, d, mins, xpair, xs8, xsum8), _q4_dot_codegen
