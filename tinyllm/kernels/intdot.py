"""Integer dot products of one quantized weight row with one input row rounded to int8 blocks.

Converting every int8 or 4-bit weight to float costs more than reading it from memory, so a quantized decode step
would be bound by arithmetic. With the input rounded to int8 too (quant.quantize_activations: one scale per block
of 32 values), each block's dot product is an integer sum that AVX-512 VNNI computes in one instruction: vpdpbusd
multiplies 32 unsigned bytes by 32 signed bytes and adds each group of 4 products into one of 8 int32 lanes (64
bytes into 16 lanes in its 512-bit form, which the versions here use: two int8 blocks or four 4-bit ones at once).

The contract (what every function here returns, as float32; the callers in linear_kernels.py and q4_kernels.py
prepare the inputs):

    dot_int8(w, o, xq, xstart, xs)
        w [O, I] int8 weights, o a row of w, xq [I] int8 rounded input, xs [ceil(I/32)] scales, xstart [I/4 over
        the full blocks] int32: -128 times each 4 consecutive values of xq summed (vpdpbusd wants one operand
        unsigned: the weights go in as w + 128, and these starting sums take back what the 128 adds).
        -> sum over the FULL blocks b < I // 32 of  xs[b] * sum_j w[o, 32b+j] * xq[32b+j]   (a short last block
           is the caller's)
    dot_int8_block(w, o, ws, xq, xstart, xs)
        as dot_int8, ws [O, I/32] the weight's block scales (I a multiple of 32).
        -> sum over b of  ws[o, b] * xs[b] * sum_j w[o, 32b+j] * xq[32b+j]
    dot_q4(w, o, d, mins, xg, xs4, xsum4)
        w [O, I/2] packed 4-bit (Q4_1 order: byte j of a block holds value j low, value j+16 high), d, mins
        [O, I/32]. The blocks are taken in groups (`q4_group`): fours, then a last pair if two remain (an odd
        last block is the caller's). xg [I] is the rounded input in the order of the nibbles of each group's
        bytes: values 0-15 of each of its blocks in turn, then values 16-31 of each in turn. Each block b has 4
        lanes l (its bytes 4l..4l+3, both nibbles): xs4[4b + l] is the block's input scale, xsum4[4b + l] the
        rounded input summed over the 8 values that lane multiplies, times that scale.
        -> sum over blocks b and lanes l of  isum[b, l] * d[o, b] * xs4[4b+l] + mins[o, b] * xsum4[4b+l],
           isum[b, l] = the integer dot of the lane's 4 bytes (both nibbles) with their 8 input values.
    dot_q4_blocks(w, o, d, mins, xg, xs, xsum)
        w, d, mins and xg as dot_q4; xs [I/32] the input's block scales, xsum [I/32] each block's rounded input
        summed, times its scale. A block's integer sums are added up before its one float step.
        -> sum over the blocks b of dot_q4's groups of  isum[b] * d[o, b] * xs[b] + mins[o, b] * xsum[b],
           isum[b] = the integer dot of the block's 16 bytes (both nibbles) with its 32 input values.
    dot_q5(w, o, d, high, xg, xs4, xsum4), dot_q5_blocks(w, o, d, high, xg, xs, xsum)
        Q5_0 (quant.Q5Block): as dot_q4 and dot_q4_blocks, the 4-bit values widened by a fifth bit (high [O, I/32]
        uint32, bit j for value j of the block: q = nibble + 16 bit, in [0, 31]) and mins[o, b] = -16 d[o, b]
        (W = d (q - 16)). The fifth bits go into the bytes before the multiply (a 64-bit mask per four blocks'
        halves selects 16 or 0): the same integer sums, at most 2 x 31 x 127 per pair (AVX2's 16 bits: 4 x that).

Each has a plain-Numba `*_reference` body with the same contract. The fast versions are LLVM IR written here
(Numba cannot express vector instructions), in one of two instruction sets (`INT_DOTS`): AVX-512 VNNI, or, on a
CPU with AVX2 but not VNNI, AVX2's byte multiply-adds, as llama.cpp's AVX2 kernels do: vpmaddubsw multiplies 32
unsigned by 32 signed bytes and adds adjacent pairs into 16-bit sums, vpmaddwd by ones adds those pairs into
int32 lanes of 4 products each, the lanes of vpdpbusd. The 16-bit sums saturate past 32,767, so AVX2 takes the
int8 weights as |w| against sign(w) * x (vpsignb: at most 2 x 128 x 127) instead of VNNI's w + 128; 4-bit values
are at most 2 x 15 x 127. With neither (or NUMBA_DISABLE_JIT=1) the plain names are the reference bodies.
The 4-bit dot comes in two contracts, one per instruction set. dot_q4 (VNNI) sums 64 bytes per vpdpbusd and
scales per lane. AVX2 needs two instructions for what vpdpbusd does in one, and there a 4-bit row cost more
arithmetic than reading it, so dot_q4_blocks meets the nibbles' two products in 16 bits (at most 2 x 2 x 15 x 127)
before widening them, as llama.cpp's AVX2 kernels do, adds each block's 4 lanes in integers (two shuffles and adds
per four blocks), and scales one sum per block (docs/design/kernels.md, "AVX-512 VNNI against AVX2").
`Q4_BY_BLOCKS` says which of the two the kernels call (and of dot_q5 and dot_q5_blocks).
The IR helpers without a leading underscore (load, halves, joined, quad_sums, row_sum, structs, and the LLVM types
i8, i32, f32, V16f32 and the FAST flags) are for the other modules that write dots (kquant_kernels.py).
`USE_INT_DOTS` is what the dispatch passes as `int_dots` to the kernels that call these (and whether the integer
tiles of int8_tiles.py / int8_tiles_avx2.py run); the environment variable TINYLLM_NO_VNNI=1 forces the reference
bodies on any CPU. `USE_VNNI` says whether kv_rows.py's VNNI rows may run (they have no AVX2 version). The
instruction set is the compile target's: TINYLLM_ISA=avx2 (isa.py) builds the AVX2 versions on an AVX-512 CPU.
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import BLOCK
from .isa import FEATURES
from .llvm_ir import call, lane_total, prefetch
from .numerics import SERIAL

_HOST = FEATURES                                                       # the target's (isa.py: TINYLLM_ISA)
HAVE_VNNI = {"avx512vnni", "avx512vl"} <= _HOST
HAVE_AVX2 = "avx2" in _HOST
INT_DOTS = "vnni" if HAVE_VNNI else "avx2" if HAVE_AVX2 else None      # the instructions dot_* below are written in
_FORCED_PLAIN = os.environ.get("TINYLLM_NO_VNNI", "") not in ("", "0")
USE_INT_DOTS = INT_DOTS is not None and not _FORCED_PLAIN
USE_VNNI = HAVE_VNNI and not _FORCED_PLAIN
Q4_BY_BLOCKS = INT_DOTS == "avx2"   # the kernels' 4-bit dot with int dots on: dot_q4_blocks, else dot_q4
# Rows are short (576 int8 or 288 packed bytes), so the hardware prefetcher keeps restarting: ask this far ahead
# (8 KiB, some 14 int8 rows: the int8 kernels read from memory 1.2-1.3x faster than with 2 KiB: docs/design/kernels.md).
PREFETCH_BYTES = 8192


# --- the reference bodies ----------------------------------------------------------------------------------------
@njit(**SERIAL)
def _int8_block_sum(w, o, xq, b):
    """sum_j w[o, 32b+j] * xq[32b+j] in int32"""
    s = np.int32(0)
    for j in range(b * BLOCK, (b + 1) * BLOCK):
        s += np.int32(w[o, j]) * np.int32(xq[j])
    return s


@njit(**SERIAL)
def dot_int8_reference(w, o, xq, xstart, xs):
    acc = np.float32(0.0)
    for b in range(w.shape[1] // BLOCK):
        acc += np.float32(_int8_block_sum(w, o, xq, b)) * xs[b]
    return acc


@njit(**SERIAL)
def dot_int8_block_reference(w, o, ws, xq, xstart, xs):
    acc = np.float32(0.0)
    for b in range(ws.shape[1]):
        acc += np.float32(_int8_block_sum(w, o, xq, b)) * (xs[b] * ws[o, b])
    return acc


@njit(fastmath=True, cache=True, inline="always")
def q4_group(b, n_blocks):
    """The group of blocks that block b belongs to in dot_q4's input order -> (its first block, how many): fours,
    so that one 64-byte load takes a group's packed bytes, then a last pair (two 32-byte halves of a vector)."""
    fours = n_blocks // 4 * 4
    if b < fours:
        return b - b % 4, 4
    return fours, 2


@njit(**SERIAL)
def dot_q4_reference(w, o, d, mins, xg, xs4, xsum4):
    acc = np.float32(0.0)
    for b in range(xs4.shape[0] // 4):
        first, size = q4_group(b, d.shape[1])
        low = BLOCK * first + 16 * (b - first)                     # where block b's values 0-15 sit in xg
        high = low + 16 * size                                     # and its values 16-31
        for lane in range(4):
            isum = np.int32(0)
            for k in range(4 * lane, 4 * lane + 4):
                byte = np.int32(w[o, 16 * b + k])                  # the block's 16 bytes
                isum += (byte & 15) * np.int32(xg[low + k]) + (byte >> 4) * np.int32(xg[high + k])
            acc += np.float32(isum) * (d[o, b] * xs4[4 * b + lane]) + mins[o, b] * xsum4[4 * b + lane]
    return acc


@njit(**SERIAL)
def dot_q4_blocks_reference(w, o, d, mins, xg, xs, xsum):
    acc = np.float32(0.0)
    for b in range(d.shape[1] - d.shape[1] % 2):                   # the even blocks (an odd last one: the caller's)
        first, size = q4_group(b, d.shape[1])
        low = BLOCK * first + 16 * (b - first)                     # where block b's values 0-15 sit in xg
        high = low + 16 * size                                     # and its values 16-31
        isum = np.int32(0)
        for k in range(16):
            byte = np.int32(w[o, 16 * b + k])                      # the block's 16 bytes
            isum += (byte & 15) * np.int32(xg[low + k]) + (byte >> 4) * np.int32(xg[high + k])
        acc += np.float32(isum) * (d[o, b] * xs[b]) + mins[o, b] * xsum[b]
    return acc


@njit(**SERIAL)
def fifth_bits(high, o, b, k):
    """Value k of block b of a Q5_0 row: its fifth bit times 16 (high [O, I/32] uint32)."""
    return np.int32((np.int64(high[o, b]) >> k) & 1) * 16


@njit(**SERIAL)
def dot_q5_reference(w, o, d, high, xg, xs4, xsum4):
    acc = np.float32(0.0)
    for b in range(xs4.shape[0] // 4):
        first, size = q4_group(b, d.shape[1])
        low = BLOCK * first + 16 * (b - first)                     # where block b's values 0-15 sit in xg
        upper = low + 16 * size                                    # and its values 16-31
        for lane in range(4):
            isum = np.int32(0)
            for k in range(4 * lane, 4 * lane + 4):
                byte = np.int32(w[o, 16 * b + k])
                isum += (((byte & 15) + fifth_bits(high, o, b, k)) * np.int32(xg[low + k])
                         + ((byte >> 4) + fifth_bits(high, o, b, k + 16)) * np.int32(xg[upper + k]))
            acc += np.float32(isum) * (d[o, b] * xs4[4 * b + lane]) - np.float32(16.0) * d[o, b] * xsum4[4 * b + lane]
    return acc


@njit(**SERIAL)
def dot_q5_blocks_reference(w, o, d, high, xg, xs, xsum):
    acc = np.float32(0.0)
    for b in range(d.shape[1] - d.shape[1] % 2):
        first, size = q4_group(b, d.shape[1])
        low = BLOCK * first + 16 * (b - first)
        upper = low + 16 * size
        isum = np.int32(0)
        for k in range(16):
            byte = np.int32(w[o, 16 * b + k])
            isum += (((byte & 15) + fifth_bits(high, o, b, k)) * np.int32(xg[low + k])
                     + ((byte >> 4) + fifth_bits(high, o, b, k + 16)) * np.int32(xg[upper + k]))
        acc += np.float32(isum) * (d[o, b] * xs[b]) - np.float32(16.0) * d[o, b] * xsum[b]
    return acc


dot_int8, dot_int8_block = dot_int8_reference, dot_int8_block_reference
dot_q4, dot_q4_blocks = dot_q4_reference, dot_q4_blocks_reference
dot_q5, dot_q5_blocks = dot_q5_reference, dot_q5_blocks_reference


# --- the fast versions, in LLVM IR: VNNI or AVX2 ----------------------------------------------------------------
if INT_DOTS:
    i8, _i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    _V8f32, V16f32 = ir.VectorType(f32, 8), ir.VectorType(f32, 16)
    FAST = ("fast",)

    def load(builder, ptr, offset, vector_type):
        """vector_type's worth of values from ptr + offset (in elements of ptr), no alignment assumed."""
        return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vector_type.as_pointer()), align=1)

    def halves(builder, v):
        """<n x i8> -> its 32-byte pieces, in order (what one AVX2 instruction takes)."""
        return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 32), list(range(first, first + 32))))
                for first in range(0, v.type.count, 32)]

    def joined(builder, pieces):
        """Vectors of one type (2^k of them) -> one, in order: halves' inverse."""
        while len(pieces) > 1:
            n = 2 * pieces[0].type.count
            pieces = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, n), list(range(n))))
                      for a, b in zip(pieces[::2], pieces[1::2])]
        return pieces[0]

    def quad_sums(builder, acc, unsigned, signed, isa):
        """acc <n x i32> + 4n unsigned bytes times 4n signed ones, each 4 products summed into one lane (n 8 or 16)."""
        # VNNI: one vpdpbusd. AVX2: per 32 bytes, vpmaddubsw (pairs into int16) and vpmaddwd by ones (pairs of pairs
        # into int32), exact where no pair of products passes 32,767 (the callers make sure).
        if isa == "vnni":
            return call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * acc.type.count}", acc.type, acc, unsigned, signed)
        ones = ir.Constant(ir.VectorType(_i16, 16), [1] * 16)
        quads = [call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(i32, 8),
                      call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_i16, 16), u, x), ones)
                 for u, x in zip(halves(builder, unsigned), halves(builder, signed))]
        return builder.add(acc, joined(builder, quads))

    def row_sum(builder, n_steps, step, row, bytes_per_step, vector_type=_V8f32):
        """sum over i < n_steps of step(i) (a vector_type of floats) -> the float32 total of its lanes."""
        # two running sums, so that consecutive adds do not wait on each other; the weight row prefetched
        # PREFETCH_BYTES ahead
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vector_type, [0.0] * vector_type.count))
                for _ in range(2)]

        def add(i, acc_ptr):
            builder.store(builder.fadd(builder.load(acc_ptr), step(i), flags=FAST), acc_ptr)

        one, two = ir.Constant(n_steps.type, 1), ir.Constant(n_steps.type, 2)
        with cgutils.for_range(builder, builder.udiv(n_steps, two)) as loop:
            i = builder.mul(loop.index, two)
            ahead = builder.add(builder.mul(i, ir.Constant(i.type, bytes_per_step)), ir.Constant(i.type,
                                                                                              PREFETCH_BYTES))
            for line in range(0, 2 * bytes_per_step, 64):                      # each cache line of the two steps
                prefetch(builder, builder.gep(row, [builder.add(ahead, ir.Constant(i.type, line))]))
            add(i, accs[0])
            add(builder.add(i, one), accs[1])
        with builder.if_then(builder.trunc(n_steps, ir.IntType(1))):                        # an odd count
            add(builder.sub(n_steps, one), accs[0])
        return lane_total(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=FAST))

    def structs(context, builder, signature, args, names):
        """The intrinsic's arguments by name: arrays as struct proxies (.data, .shape), the row index o as is."""
        return {name: val if name == "o" else cgutils.create_struct_proxy(ty)(context, builder, value=val)
                for name, ty, val in zip(names.split(), signature.args, args)}

    def _int8_dot_codegen(kind, isa):
        """dot_int8 (kind "int8") or dot_int8_block (kind "int8-block"): a pair of blocks per 64 bytes of integer
        sums (lanes 0-7 the first block's, 8-15 the second's), a last odd block in 32. Both instruction sets
        multiply unsigned bytes by signed ones. VNNI: the weight goes in as w + 128 (one xor), the input as it is,
        and the sums start at xstart (-128 times the input's sums), so they come out as the products of w and xq.
        AVX2: |w| against sign(w) * xq (vpsignb twice), so that a pair of products fits in 16 bits; sums from 0."""
        names = {"int8": "w o xq xstart xs", "int8-block": "w o ws xq xstart xs"}[kind]

        def codegen(context, builder, signature, args):
            a = structs(context, builder, signature, args, names)
            o, xs = a["o"], a["xs"]
            row_len = builder.extract_value(a["w"].shape, 1)                 # bytes per weight row
            row = builder.gep(a["w"].data, [builder.mul(o, row_len)])
            if kind == "int8":
                n_blocks = builder.udiv(row_len, ir.Constant(row_len.type, BLOCK))
            else:
                n_blocks = builder.extract_value(a["ws"].shape, 1)
                ws_row = builder.gep(a["ws"].data, [builder.mul(o, n_blocks)])

            def blocks(first, size):                # blocks first .. first+size-1 -> <8*size x float> of terms
                nbytes, lanes = BLOCK * size, 8 * size
                bytes_type = ir.VectorType(i8, nbytes)
                x_off = builder.mul(first, ir.Constant(first.type, BLOCK))
                w = load(builder, row, x_off, bytes_type)
                x = load(builder, a["xq"].data, x_off, bytes_type)
                if isa == "vnni":
                    start = load(builder, a["xstart"].data, builder.mul(first, ir.Constant(first.type, 8)),
                                  ir.VectorType(i32, lanes))
                    isum = quad_sums(builder, start, builder.xor(w, ir.Constant(bytes_type, [-128] * nbytes)), x,
                                      isa)
                else:
                    sign = lambda v: [call(builder, "llvm.x86.avx2.psign.b", piece.type, piece, w_piece)  # noqa: E731
                                      for piece, w_piece in zip(halves(builder, v), halves(builder, w))]
                    isum = quad_sums(builder, ir.Constant(ir.VectorType(i32, lanes), [0] * lanes),
                                      joined(builder, sign(w)), joined(builder, sign(x)), isa)
                scale = load(builder, xs.data, first, ir.VectorType(f32, size))
                if kind == "int8-block":
                    scale = builder.fmul(scale, load(builder, ws_row, first, ir.VectorType(f32, size)))
                eight_each = ir.Constant(ir.VectorType(i32, lanes), [j // 8 for j in range(lanes)])
                scale = builder.shuffle_vector(scale, ir.Constant(scale.type, ir.Undefined), eight_each)
                return builder.fmul(builder.sitofp(isum, ir.VectorType(f32, lanes)), scale, flags=FAST)
            two = ir.Constant(n_blocks.type, 2)
            n_pairs = builder.udiv(n_blocks, two)
            total = row_sum(builder, n_pairs, lambda i: blocks(builder.mul(i, two), 2), row, 2 * BLOCK, V16f32)
            result = cgutils.alloca_once_value(builder, total)
            with builder.if_then(builder.trunc(n_blocks, ir.IntType(1))):                      # an odd last block
                last = lane_total(builder, blocks(builder.sub(n_blocks, ir.Constant(n_blocks.type, 1)), 1))
                builder.store(builder.fadd(builder.load(result), last, flags=FAST), result)
            return builder.load(result)
        return codegen

    def _group_operands(builder, row, xg, first, size, high_row=None):
        """A group of `size` 4-bit blocks from `first` on (16 bytes each) -> (their values 0-15, their values 16-31,
        the input values those meet, and the ones these meet), each <16*size x i8>. With high_row (Q5_0's fifth
        bits, a uint32 per block) the values are 5-bit: bit k of a block's word adds 16 to its value k."""
        nbytes = 16 * size
        bytes_type = ir.VectorType(i8, nbytes)
        packed = load(builder, row, builder.mul(first, ir.Constant(first.type, 16)), bytes_type)
        x_off = builder.mul(first, ir.Constant(first.type, BLOCK))
        low = builder.and_(packed, ir.Constant(bytes_type, [15] * nbytes))                 # low nibbles
        high = builder.lshr(packed, ir.Constant(bytes_type, [4] * nbytes))                 # high nibbles
        if high_row is not None:            # ggml's bytes_from_bits: each byte gets the word's byte holding its bit
            words = builder.bitcast(load(builder, high_row, first, ir.VectorType(i32, size)),
                                    ir.VectorType(i8, 4 * size))                           # the words' bytes
            bit = ir.Constant(bytes_type, [1 << (k % 8) for k in range(nbytes)])
            sixteen, zero = ir.Constant(bytes_type, [16] * nbytes), ir.Constant(bytes_type, [0] * nbytes)

            def fifth(half):                        # values 0-15 (half 0) or 16-31 of each block -> 16 or 0 each
                spread = _lanes(builder, words, words, [4 * (k // 16) + 2 * half + k % 16 // 8 for k in range(nbytes)])
                return builder.select(builder.icmp_unsigned("!=", builder.and_(spread, bit), zero), sixteen, zero)
            low, high = builder.or_(low, fifth(0)), builder.or_(high, fifth(1))
        return (low, high, load(builder, xg, x_off, bytes_type),
                load(builder, xg, builder.add(x_off, ir.Constant(first.type, nbytes)), bytes_type))

    def _q4_rows(builder, a):
        """Row o of a 4-bit weight (its packed bytes), its block count, and its rows of d and of mins (Q5_0: of
        high, its fifth bits)."""
        o = a["o"]
        row = builder.gep(a["w"].data, [builder.mul(o, builder.extract_value(a["w"].shape, 1))])
        n_blocks = builder.extract_value(a["d"].shape, 1)
        per_block = a["high"] if "high" in a else a["mins"]
        return (row, n_blocks, builder.gep(a["d"].data, [builder.mul(o, n_blocks)]),
                builder.gep(per_block.data, [builder.mul(o, n_blocks)]))

    def _fours_then_pair(builder, group, n_blocks, row, vector_type):
        """A 4-bit row's total: group(first, 4) (a vector_type of terms) over its fours of blocks, then group(first,
        2) over a last pair if two blocks remain (an odd last block is the caller's)."""
        four = ir.Constant(n_blocks.type, 4)
        n_fours = builder.udiv(n_blocks, four)
        total = row_sum(builder, n_fours, lambda i: group(builder.mul(i, four), 4), row, 64, vector_type)
        result = cgutils.alloca_once_value(builder, total)
        last_pair = builder.icmp_unsigned(">=", builder.urem(n_blocks, four), ir.Constant(n_blocks.type, 2))
        with builder.if_then(last_pair):
            pair = lane_total(builder, group(builder.mul(n_fours, four), 2))
            builder.store(builder.fadd(builder.load(result), pair, flags=FAST), result)
        return builder.load(result)

    def four_bit_dot(builder, a, isa, row, n_blocks, block_terms, high_row=None):
        """A 4-bit (or with high_row, 5-bit) row's dot in isa's contract (vnni: dot_q4's, avx2: dot_q4_blocks')."""
        # a: the intrinsic's arguments by name (xg, xs, xsum: q4_kernels.q4_inputs' layout for isa); block_terms(
        # first, size) -> (the blocks' scales, their minimums), each <size x float>: each format makes its own
        group = _lanes_group if isa == "vnni" else _blocks_group
        return _fours_then_pair(builder, lambda first, size: group(builder, a, isa, row, first, size, block_terms,
                                                                   high_row),
                                n_blocks, row, V16f32 if isa == "vnni" else ir.VectorType(f32, 4))

    def _lanes_group(builder, a, isa, row, first, size, block_terms, high_row):
        """dot_q4's group: one 64-byte load is four blocks' packed bytes; its low nibbles meet the group's first 64
        input values and its high nibbles the next 64, so four blocks cost one load, two masks and two steps of
        integer sums (quad_sums' 512-bit vpdpbusd), whose lanes 4j..4j+3 then hold block j's share; one shuffle
        spreads each block's d and min over its four lanes. A last pair of blocks is the same in 256 bits.
        -> <4*size x float> of terms"""
        low, high, x_low, x_high = _group_operands(builder, row, a["xg"].data, first, size, high_row)
        lanes_type = ir.VectorType(f32, 4 * size)
        isum = quad_sums(builder, ir.Constant(ir.VectorType(i32, 4 * size), [0] * 4 * size), low, x_low, isa)
        isum = quad_sums(builder, isum, high, x_high, isa)
        four_each = ir.Constant(ir.VectorType(i32, 4 * size), [j // 4 for j in range(4 * size)])
        d, mins = (builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), four_each)
                   for v in block_terms(first, size))
        at = builder.mul(first, ir.Constant(first.type, 4))
        scale = builder.fmul(d, load(builder, a["xs"].data, at, lanes_type), flags=FAST)
        term = builder.fmul(builder.sitofp(isum, lanes_type), scale, flags=FAST)
        return builder.fadd(term, builder.fmul(mins, load(builder, a["xsum"].data, at, lanes_type), flags=FAST),
                            flags=FAST)

    def _lanes(builder, a, b, indices):
        """The lanes of a then b at `indices` (one shuffle)."""
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(indices)), list(indices)))

    def _pair_sums(builder, a, b):
        """The lanes of a then b with each adjacent pair added: <n x i32>, <n x i32> -> <n x i32>."""
        n = 2 * a.type.count
        return builder.add(_lanes(builder, a, b, range(0, n, 2)), _lanes(builder, a, b, range(1, n, 2)))

    def _blocks_group(builder, a, isa, row, first, size, block_terms, high_row):
        """dot_q4_blocks' group in AVX2: per four blocks (64 packed bytes), the two nibbles' products meet in 16-bit
        sums (vpmaddubsw twice, one add), widen to 4 int32 lanes per block (vpmaddwd), and two rounds of pair sums
        leave one integer per block in block order; then one multiply-add per block for d * xs and one for
        min * xsum, in a <4 x float> of the four blocks. A last pair of blocks is the same in 2 lanes.
        -> <size x float> of terms"""
        ones = ir.Constant(ir.VectorType(_i16, 16), [1] * 16)
        quads = []                                  # per 32 bytes: <8 x i32>, 4 lanes for each of 2 blocks
        for low, high, x_low, x_high in zip(*(halves(builder, v) for v in _group_operands(
                builder, row, a["xg"].data, first, size, high_row))):
            pairs = builder.add(call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_i16, 16), low, x_low),
                                call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_i16, 16), high, x_high))
            quads.append(call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(i32, 8), pairs, ones))
        if size == 4:                               # [b0 b0 b1 b1 b2 b2 b3 b3] -> [b0 b1 b2 b3]
            block_halves = _pair_sums(builder, *quads)
            isum = _pair_sums(builder, _lanes(builder, block_halves, block_halves, range(4)),
                              _lanes(builder, block_halves, block_halves, range(4, 8)))
        else:                                       # [b0 b0 b1 b1] -> [b0 b1]
            block_halves = _pair_sums(builder, _lanes(builder, *quads, *quads, range(4)),
                                      _lanes(builder, *quads, *quads, range(4, 8)))
            isum = _pair_sums(builder, _lanes(builder, block_halves, block_halves, range(2)),
                              _lanes(builder, block_halves, block_halves, range(2, 4)))
        per_block = ir.VectorType(f32, size)
        d, mins = block_terms(first, size)
        scale = builder.fmul(d, load(builder, a["xs"].data, first, per_block), flags=FAST)
        term = builder.fmul(builder.sitofp(isum, per_block), scale, flags=FAST)
        return builder.fadd(term, builder.fmul(mins, load(builder, a["xsum"].data, first, per_block), flags=FAST),
                            flags=FAST)

    def _q4_dot_codegen(isa, fifth):
        """dot_q4 (vnni) or dot_q4_blocks (avx2); with fifth, dot_q5 or dot_q5_blocks: d and mins read from their
        rows, or d and -16 d (Q5_0: W = d q - 16 d)."""
        def codegen(context, builder, signature, args):
            a = structs(context, builder, signature, args, f"w o d {'high' if fifth else 'mins'} xg xs xsum")
            row, n_blocks, d_row, per_block_row = _q4_rows(builder, a)

            def block_terms(first, size):
                d = load(builder, d_row, first, ir.VectorType(f32, size))
                if fifth:
                    return d, builder.fmul(d, ir.Constant(d.type, [-16.0] * size), flags=FAST)
                return d, load(builder, per_block_row, first, ir.VectorType(f32, size))
            return four_bit_dot(builder, a, isa, row, n_blocks, block_terms, per_block_row if fifth else None)
        return codegen

    def _dots_in(isa):
        """(dot_int8, dot_int8_block, dot_q4) written in isa's instructions ("vnni" or "avx2")."""
        @intrinsic
        def dot_int8(typingctx, w, o, xq, xstart, xs):
            return types.float32(w, o, xq, xstart, xs), _int8_dot_codegen("int8", isa)

        @intrinsic
        def dot_int8_block(typingctx, w, o, ws, xq, xstart, xs):
            return types.float32(w, o, ws, xq, xstart, xs), _int8_dot_codegen("int8-block", isa)

        @intrinsic
        def dot_q4(typingctx, w, o, d, mins, xg, xs, xsum):         # (dot_q4_blocks in AVX2)
            return types.float32(w, o, d, mins, xg, xs, xsum), _q4_dot_codegen(isa, False)

        return dot_int8, dot_int8_block, dot_q4

    def _q5_dot_in(isa):
        """dot_q5 (vnni) or dot_q5_blocks (avx2)."""
        @intrinsic
        def dot_q5(typingctx, w, o, d, high, xg, xs, xsum):
            return types.float32(w, o, d, high, xg, xs, xsum), _q4_dot_codegen(isa, True)
        return dot_q5

    # each instruction set the host has, by name: (dot_int8, dot_int8_block, its 4-bit dot), and its 5-bit dot; the
    # tests hold both to the reference bodies on a VNNI host
    _SETS = [isa for isa, have in (("vnni", HAVE_VNNI), ("avx2", HAVE_AVX2)) if have]
    DOTS, Q5_DOTS = {isa: _dots_in(isa) for isa in _SETS}, {isa: _q5_dot_in(isa) for isa in _SETS}
    dot_int8, dot_int8_block, _four_bit = DOTS[INT_DOTS]
    _five_bit = Q5_DOTS[INT_DOTS]
    if Q4_BY_BLOCKS:
        dot_q4_blocks, dot_q5_blocks = _four_bit, _five_bit
    else:
        dot_q4, dot_q5 = _four_bit, _five_bit
