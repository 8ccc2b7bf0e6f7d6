"""The K-quant kernels, on the bytes of a Q4_K_M file's two K-quant types as it holds them.

Q6_K (quant.Q6KBlock: 6-bit values in ggml's places, an 8-bit scale per 16, d per 256) times a few rows of x
rounded to int8 blocks: `linear_q6k_a8`; `linear_q6k` for float inputs (each weight row dequantized once). Their
numpy twin is the numpy backend's linear of the dequantized weight (rounding x first for int8 inputs). The vector
dot (`dot_q6k`) takes half a super-block a step: the values as unsigned bytes q in [0, 63] (one shift and one mask
per 32), the products summed by 4 into int32 lanes from -32 times the inputs' sums, so that each lane holds the
dot of q - 32; each 4 lanes (16 values) scaled by their block's input scale times d * their scale.

Q4_K's super-blocks read as they are (quant.Q4KBlock: 4-bit values, a 6-bit scale and minimum per block of 32,
an fp16 d and dmin per 8 blocks) times a few rows of x rounded to int8 blocks: `linear_q4k_a8`. Its numpy twin is
the numpy backend's linear with int8 inputs (round x, dequantize the weight, multiply: backend.NumpyOps.linear).

Per block b of 32 the product is an integer dot product scaled twice, as for Q4_1 (q4_kernels.py), except that the
block's scale and minimum are made from their 6-bit integers on the way:
    sum_j W[o, j] xq[j] xs[b] = xs[b] (d[b // 8] scales[b] sum_j q[j] xq[j] - dmin[b // 8] mins[b] sum_j xq[j])
With the vector dots, `dot_q4k` is intdot.four_bit_dot with those scales and minimums made in registers per group
of blocks; the reference path expands a task's scales into a scratch of Q4_1's form and runs Q4_1's task on them.
Both give the numbers of the Q4_1 arrays a Q4KBlock equals (to the last bit or so: fastmath may order a sum
differently in each compile), from 0.6 bytes a weight instead of 0.75. dispatch.py runs a Q4KWeight on these for
the rows of a decode step (`linear_q4k_a8`; `linear_q4k` for float inputs, each task's rows made into Q4_1's arrays in
a scratch) and hands the tiles of a prompt chunk the whole Q4_1 arrays, made per call (`as_q4_weight`). In cache the
fused dot is a little slower than the Q4_1 arrays' (576 x 1536, one row, one thread: 0.0227 against 0.0212 ms: the
conversions cost what the vector dot does); from memory, where decode reads its weights, it is faster (4096 x 4096:
0.37 against 0.45). A faster design is ggml's: round the activations with one scale per 256 (Q8_K), so that a
super-block's 8 blocks add up in integers, sum_b scales[b] * isum[b], and take two float multiplies per 256 values.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import BLOCK, Q4KBlock, SUPER
from .intdot import HAVE_AVX2, HAVE_VNNI, INT_DOTS, q4_group
from .linear_kernels import OUT_BLOCK, n_tasks, quantize_rows
from .numerics import PARALLEL, SERIAL
from .q4_kernels import last_block_sums, q4_a8_task, q4_inputs, q4_rows_task, split_halves
from .weight_formats import Q4Weight


@njit(**SERIAL)
def dot_q4k_reference(w, o, scales, mins, d, dmin, xg, xs4, xsum4):
    """Row o of a Q4KBlock's arrays in intdot.dot_q4's contract (its input layout, its even blocks), each block's
    scale d[b // 8] * scales[b] and minimum -(dmin[b // 8] * mins[b]) made on the way."""
    acc = np.float32(0.0)
    for b in range(xs4.shape[0] // 4):
        first, size = q4_group(b, scales.shape[1])
        low = BLOCK * first + 16 * (b - first)                     # where block b's values 0-15 sit in xg
        scale = d[o, b // SUPER] * np.float32(scales[o, b])
        minimum = dmin[o, b // SUPER] * np.float32(mins[o, b])
        for lane in range(4):
            isum = np.int32(0)
            for k in range(4 * lane, 4 * lane + 4):
                byte = np.int32(w[o, 16 * b + k])
                isum += (byte & 15) * np.int32(xg[low + k]) + (byte >> 4) * np.int32(xg[low + 16 * size + k])
            acc += np.float32(isum) * (scale * xs4[4 * b + lane]) - minimum * xsum4[4 * b + lane]
    return acc


dot_q4k = dot_q4k_reference
if INT_DOTS:       # the fused dot: intdot's 4-bit row dot, each group's scales and minimums made in registers
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from .intdot import f32, four_bit_dot, i8, load, structs

    def _q4k_dot_codegen(isa):
        """dot_q4k: intdot.four_bit_dot (dot_q4's contract in VNNI, dot_q4_blocks' in AVX2) with each group's
        scales d[b // 8] * scales[b] and minimums -(dmin[b // 8] * mins[b]) made from the uint8 integers and the
        super-block's two floats (a group of 4 or 2 blocks never straddles a super-block of 8). The two products
        are not reassociated (no fast flags): the numbers of Q4KBlock.block_scales, as ggml rounds them."""
        def codegen(context, builder, signature, args):
            a = structs(context, builder, signature, args, "w o scales mins d dmin xg xs xsum")
            o = a["o"]
            row = builder.gep(a["w"].data, [builder.mul(o, builder.extract_value(a["w"].shape, 1))])
            n_blocks, n_super = builder.extract_value(a["scales"].shape, 1), builder.extract_value(a["d"].shape, 1)
            at = lambda name, n: builder.gep(a[name].data, [builder.mul(o, n)])            # noqa: E731
            scales, mins, d, dmin = at("scales", n_blocks), at("mins", n_blocks), at("d", n_super), at("dmin", n_super)

            def block_terms(first, size):
                vec = ir.VectorType(f32, size)
                sup = builder.udiv(first, ir.Constant(first.type, 8))

                def times(super_row, ints, sign=1.0):   # sign * super_row[sup] * each block's integer (float32)
                    value = builder.load(builder.gep(super_row, [sup]))
                    if sign < 0:                    # -(dmin m) = (-dmin) m exactly: one scalar negation
                        value = builder.fmul(value, ir.Constant(f32, sign))
                    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
                    spread = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                                    ir.Constant(ir.VectorType(ir.IntType(32), size), [0] * size))
                    return builder.fmul(spread, builder.uitofp(load(builder, ints, first, ir.VectorType(i8, size)),
                                                               vec))
                return times(d, scales), times(dmin, mins, -1.0)
            return four_bit_dot(builder, a, isa, row, n_blocks, block_terms)
        return codegen

    def _q4k_dot_in(isa):
        @intrinsic
        def dot_q4k(typingctx, w, o, scales, mins, d, dmin, xg, xs, xsum):
            return types.float32(w, o, scales, mins, d, dmin, xg, xs, xsum), _q4k_dot_codegen(isa)
        return dot_q4k

    # each instruction set the host has (the tests hold both to intdot's 4-bit reference bodies on a VNNI host)
    Q4K_DOTS = {isa: _q4k_dot_in(isa) for isa, have in (("vnni", HAVE_VNNI), ("avx2", HAVE_AVX2)) if have}
    dot_q4k = Q4K_DOTS[INT_DOTS]


@njit(**SERIAL)
def q4k_a8_task(w, xq, xs, xg, xscales, sums, out, o0, o1, int_dots):
    """linear_q4k_a8's rows o0 .. o1-1. With int_dots, dot_q4k per row (an odd last block after, as Q4_1's task
    adds it). Else q4_kernels.q4_a8_task with intdot's reference bodies on those rows' Q4_1 arrays (q4_rows)."""
    packed, scales, mins, d, dmin = w
    if int_dots:
        for m in range(xq.shape[0]):
            g, s, sm = xg[m], xscales[m], sums[m]
            for o in range(o0, o1):
                out[m, o] = dot_q4k(packed, o, scales, mins, d, dmin, g, s, sm)
        last = xs.shape[1] - 1
        if last % 2 == 0:                      # an odd block count: the last block, in integers
            for o in range(o0, o1):
                scale = d[o, last // SUPER] * np.float32(scales[o, last])
                minimum = dmin[o, last // SUPER] * np.float32(mins[o, last])
                for m in range(xq.shape[0]):
                    isum, xsum = last_block_sums(packed, o, xq, m, last)
                    out[m, o] += xs[m, last] * (scale * np.float32(isum) - minimum * np.float32(xsum))
        return
    q4_a8_task(q4_rows(w, o0, o1), xq, xs, xg, xscales, sums, out[:, o0:o1], 0, o1 - o0, int_dots)


@njit(**SERIAL)
def q4_rows(w, o0, o1):
    """Rows o0 .. o1-1 of a Q4KWeight as the Q4Weight arrays they equal: the nibbles shared, each block's scale
    d[b // 8] * scales[b] and minimum -(dmin[b // 8] * mins[b]) made into a small scratch (OUT_BLOCK rows: it
    stays in L1). -> (packed, d, mins) of o1 - o0 rows"""
    packed, scales, mins, d, dmin = w
    nb = scales.shape[1]
    block_d = np.empty((o1 - o0, nb), np.float32)                   # [rows, I/32] d * scale, as ggml rounds it
    block_m = np.empty((o1 - o0, nb), np.float32)                   # [rows, I/32] -(dmin * min)
    for o in range(o0, o1):
        for b in range(nb):
            block_d[o - o0, b] = d[o, b // SUPER] * np.float32(scales[o, b])
            block_m[o - o0, b] = -(dmin[o, b // SUPER] * np.float32(mins[o, b]))
    return packed[o0:o1], block_d, block_m


def as_q4_weight(w) -> Q4Weight:
    """A whole Q4KWeight as the Q4Weight it equals (quant.Q4KBlock.as_q4_1's numbers): for the kernels that read
    Q4_1's arrays only, the tiles of many input rows, at the price of 0.19 bytes a weight of scratch per call."""
    scale, minimum = Q4KBlock(*w).block_scales()                    # [O, I/32] each
    return Q4Weight(w[0], scale, -minimum)


@njit(**SERIAL)
def q4k_rows_task(w, xlo, xhi, xsum, out, o0, o1):
    """linear_q4k's rows o0 .. o1-1: q4_kernels.q4_rows_task on those rows' Q4_1 arrays (q4_rows)."""
    q4_rows_task(q4_rows(w, o0, o1), xlo, xhi, xsum, out[:, o0:o1], 0, o1 - o0, 0)


@njit(**PARALLEL)
def linear_q4k(w, x, out):
    """w: a Q4KWeight [O, I]; x [M, I] float32 -> out [M, O] (float inputs: the float activations setting, and rows
    of int8 inputs past the integer dots in the fused block, rounded first), as q4_kernels.linear_q4's rows."""
    xlo, xhi, xsum = split_halves(x, w[1].shape[1])
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q4k_rows_task(w, xlo, xhi, xsum, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))


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


# --- Q6_K: 6-bit values as the file holds them, a scale per 16 --------------------------------------------------
@njit(**SERIAL)
def q6k_value(low, high, o, i):
    """Value i of row o of a Q6KWeight, q - 32 in [-32, 31] (quant.Q6KBlock's places: half of 128 values h, value
    j of it in quarter k = j // 32 at l = j % 32: low nibble or high nibble (k >= 2) of low byte 64h + l (k even) or
    64h + 32 + l (k odd), bits 2k, 2k+1 of high byte 32h + l)."""
    h, j = i // 128, i % 128
    k, l = j // 32, j % 32
    byte = np.int32(low[o, 64 * h + 32 * (k % 2) + l])
    four = (byte >> 4) if k >= 2 else (byte & 15)
    two = (np.int32(high[o, 32 * h + l]) >> (2 * k)) & 3
    return (four | (two << 4)) - 32


@njit(**SERIAL)
def dot_q6k_reference(low, high, scales, d, o, xq, xstart, xs):
    """Row o of a Q6KWeight times one input row rounded to int8 blocks (xq [I], xs [I/32]; xstart as intdot's int8
    dots take it, which only the vector version reads):
    sum over groups g of 16 values of  xs[g // 2] * (d[o, g // 16] * scales[o, g]) * (their integer dot)."""
    acc = np.float32(0.0)
    for g in range(scales.shape[1]):
        isum = np.int32(0)
        for i in range(16 * g, 16 * g + 16):
            isum += q6k_value(low, high, o, i) * np.int32(xq[i])
        acc += np.float32(isum) * (xs[g // 2] * (d[o, g // 16] * np.float32(scales[o, g])))
    return acc


dot_q6k = dot_q6k_reference
if INT_DOTS:       # the vector version, in the instructions of intdot.py's dots (VNNI, or AVX2's byte multiply-adds)
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from .intdot import FAST, V16f32, f32, i8, i32, joined, load, quad_sums, row_sum, structs

    def _q6k_dot_codegen(isa):
        """dot_q6k, a half super-block (128 values) a step: from 64 low bytes A, B and 32 high bytes H, the four
        quarters' unsigned values q in [0, 63] are (A & 15) | (H << 4 & 48), (B & 15) | (H << 2 & 48),
        A >> 4 | (H & 48), B >> 4 | (H >> 2 & 48) (ggml's layout: one shift and one mask a vector). Their products
        with the int8 inputs sum by 4 into lanes (intdot.quad_sums, q unsigned as vpdpbusd and vpmaddubsw take it),
        each lane starting from -32 times its inputs' sum (intdot's xstart / 4: -128 times that sum), so a lane
        holds the dot of q - 32; 4 lanes make a group of 16, scaled by xs of its block times d * its scale."""
        def codegen(context, builder, signature, args):
            a = structs(context, builder, signature, args, "low high scales d o xq xstart xs")
            o = a["o"]
            at = lambda name: builder.gep(a[name].data, [builder.mul(o, builder.extract_value(a[name].shape, 1))])  # noqa: E731
            low, high, scales, d = at("low"), at("high"), at("scales"), at("d")
            n_halves = builder.udiv(builder.extract_value(a["low"].shape, 1), ir.Constant(o.type, 64))
            bytes32 = ir.VectorType(i8, 32)
            k = lambda v: ir.Constant(bytes32, [v] * 32)                                 # noqa: E731
            c = lambda v, i: builder.mul(i, ir.Constant(i.type, v))                      # noqa: E731

            def spread(v, each, lanes=16, first=0):    # <n x float> -> lanes, lane j = v[first + j // each]
                order = ir.Constant(ir.VectorType(i32, lanes), [first + j // each for j in range(lanes)])
                return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), order)

            def half(i):                               # values 128 i .. 128 i + 127 -> <16 x float> of terms
                A, B = load(builder, low, c(64, i), bytes32), load(builder, low, builder.add(c(64, i), ir.Constant(
                    i.type, 32)), bytes32)
                H = load(builder, high, c(32, i), bytes32)
                quarters = [builder.or_(builder.and_(A, k(15)), builder.and_(builder.shl(H, k(4)), k(48))),
                            builder.or_(builder.and_(B, k(15)), builder.and_(builder.shl(H, k(2)), k(48))),
                            builder.or_(builder.lshr(A, k(4)), builder.and_(H, k(48))),
                            builder.or_(builder.lshr(B, k(4)), builder.and_(builder.lshr(H, k(2)), k(48)))]
                group_scale = builder.fmul(                                               # d * scale, 8 groups
                    spread(builder.insert_element(ir.Constant(ir.VectorType(f32, 1), ir.Undefined), builder.load(
                        builder.gep(d, [builder.udiv(i, ir.Constant(i.type, 2))])), ir.Constant(i32, 0)), 8, 8),
                    builder.sitofp(load(builder, scales, c(8, i), ir.VectorType(i8, 8)), ir.VectorType(f32, 8)))
                xs = load(builder, a["xs"].data, c(4, i), ir.VectorType(f32, 4))            # the 4 blocks' scales
                terms = None
                for p in range(2):                     # quarters 2p, 2p+1: 64 values, 16 lanes
                    x = load(builder, a["xq"].data, builder.add(c(128, i), ir.Constant(i.type, 64 * p)),
                             ir.VectorType(i8, 64))
                    start = load(builder, a["xstart"].data, builder.add(c(32, i), ir.Constant(i.type, 16 * p)),
                                 ir.VectorType(i32, 16))
                    start = builder.ashr(start, ir.Constant(start.type, [2] * 16))       # -32 times the sums
                    isum = quad_sums(builder, start, joined(builder, quarters[2 * p:2 * p + 2]), x, isa)
                    scale = builder.fmul(spread(xs, 8, first=2 * p), spread(group_scale, 4, first=4 * p), flags=FAST)
                    term = builder.fmul(builder.sitofp(isum, V16f32), scale, flags=FAST)
                    terms = term if terms is None else builder.fadd(terms, term, flags=FAST)
                return terms
            return row_sum(builder, n_halves, half, low, 64, V16f32)
        return codegen

    def _dot_in(isa):
        @intrinsic
        def dot_q6k(typingctx, low, high, scales, d, o, xq, xstart, xs):
            return types.float32(low, high, scales, d, o, xq, xstart, xs), _q6k_dot_codegen(isa)
        return dot_q6k

    # each instruction set the host has (the tests hold both to the reference body on a VNNI host)
    Q6K_DOTS = {isa: _dot_in(isa) for isa, have in (("vnni", HAVE_VNNI), ("avx2", HAVE_AVX2)) if have}
    dot_q6k = Q6K_DOTS[INT_DOTS]


@njit(**SERIAL)
def q6k_a8_task(w, xq, xstart, xs, out, o0, o1, int_dots):
    """linear_q6k_a8's task: out[:, o0:o1], from quantize_rows' rounded rows."""
    low, high, scales, d = w
    for m in range(xq.shape[0]):
        q_m, start_m, s_m = xq[m], xstart[m], xs[m]
        if int_dots:                           # two loops with a constant each, so that neither carries a branch
            for o in range(o0, o1):
                out[m, o] = dot_q6k(low, high, scales, d, o, q_m, start_m, s_m)
        else:
            for o in range(o0, o1):
                out[m, o] = dot_q6k_reference(low, high, scales, d, o, q_m, start_m, s_m)


@njit(**PARALLEL)
def linear_q6k_a8(w, x, out, int_dots):
    """w: a Q6KWeight [O, I] (I a multiple of 256); x [M, I] is rounded to int8 blocks here -> out [M, O]. int_dots:
    whether the vector dot may run (intdot.USE_INT_DOTS)."""
    xq, xstart, xs = quantize_rows(x)
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q6k_a8_task(w, xq, xstart, xs, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK), int_dots)


@njit(**SERIAL)
def q6k_rows_task(w, x, out, o0, o1):
    """linear_q6k's rows o0 .. o1-1 against every input row: each weight row dequantized once (the values
    Q6KBlock.dequantize gives), then one plain dot product per input row."""
    low, high, scales, d = w
    I = 2 * low.shape[1]
    row = np.empty(I, np.float32)                                   # [I] the weight row's values
    q = np.empty(128, np.int32)                                     # [128] a half super-block's q - 32
    for o in range(o0, o1):
        for h in range(scales.shape[1] // 8):                       # each half super-block: q6k_value's places
            for l in range(32):                                     # (loops of 32, so that they vectorise)
                a, b, two = np.int32(low[o, 64 * h + l]), np.int32(low[o, 64 * h + 32 + l]), np.int32(high[o, 32 * h + l])
                q[l] = ((a & 15) | ((two & 3) << 4)) - 32
                q[32 + l] = ((b & 15) | (((two >> 2) & 3) << 4)) - 32
                q[64 + l] = ((a >> 4) | (((two >> 4) & 3) << 4)) - 32
                q[96 + l] = ((b >> 4) | (((two >> 6) & 3) << 4)) - 32
            for g in range(8):
                scale = d[o, h // 2] * np.float32(scales[o, 8 * h + g])
                for j in range(16):
                    row[128 * h + 16 * g + j] = scale * np.float32(q[16 * g + j])
        for m in range(x.shape[0]):
            acc = np.float32(0.0)
            for i in range(I):
                acc += row[i] * x[m, i]
            out[m, o] = acc


@njit(**PARALLEL)
def linear_q6k(w, x, out):
    """w: a Q6KWeight [O, I]; x [M, I] float32 -> out [M, O] (float inputs: the float activations setting, and
    prompt chunks whose inputs are rounded first)."""
    O = w[0].shape[0]
    for task in prange(n_tasks(O)):
        q6k_rows_task(w, x, out, task * OUT_BLOCK, min(O, task * OUT_BLOCK + OUT_BLOCK))
