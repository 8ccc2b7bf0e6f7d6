"""Decode attention's two inner loops, over n cached positions of one KV head for the query heads that share it:

    score_rows(q, t, h0, G, k, ks, s0, n, kvh, scale, scores, i0)
        scores[t, h, i0+i] = scale * q[t, h] . K[s0+i, kvh]
    add_rows(acc, t, h0, G, p, i0, n, v, vs, s0, kvh)
        acc[t, h] += sum over i of p[t, h, i0+i] * V[s0+i, kvh]
    for i < n and the G query heads h = h0 .. h0+G-1

K and V are in their stored format (kv_formats.py: float32, float16 bits, or int8 with a float16 scale per group of
values). `score_rows_reference` and `add_rows_reference` below are the plain loops: the readable version, what runs
with NUMBA_DISABLE_JIT=1, and what the tests hold the fast one to.

The fast one is LLVM IR. Each stored row is loaded and widened to float32 once, 16 values to a vector, for all G
query heads, whose q rows (score_rows) or running sums (add_rows) stay in registers for the whole pass
(VECTORS_AT_ONCE vectors of them at a time); the rows PREFETCH_ROWS ahead are requested from memory as it goes,
since the hardware prefetcher alone left the float16 and int8 kernels waiting on memory. A row is written out
without loops over its values: with the head size known only at run time, LLVM's loops kept their counters, overlap
checks and leftover iterations, and ran 1.5x slower. Code is written out for head sizes 64 and 128 (int8 in groups
of 32), the usual ones; any other shape takes a generic path of plain loops in the same IR.

Which of them a kernel contains is decided when it compiles, by its last argument `shape`: a tuple from
`row_shape` whose type (how many floats, how many ints) carries the head size and the query heads per KV head, or
() for the generic path. So a model compiles exactly the one body it runs (every variant in one kernel cost its
first start seconds of compiling); rows that turn out not to match it get NaN scores and sums: loudly wrong.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kv_formats import F16C, kv_value

HEAD_SIZES = (64, 128)          # the head sizes written out
LANES = 16                      # float32 values per vector (one AVX-512 register)
INT8_GROUP = 32                 # values per int8 scale that the code here reads
PREFETCH_ROWS = 32              # how far ahead of the row it reads a pass asks for rows from memory
VECTORS_AT_ONCE = 16            # q rows (or sums) of a pass's query heads kept in registers, in 16-value vectors


_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16i8, _V16i16, _V16i32 = ir.VectorType(_i8, LANES), ir.VectorType(_i16, LANES), ir.VectorType(_i32, LANES)
_V16f32 = ir.VectorType(_f32, LANES)
_FAST = ("fast",)


def _address(builder, array, array_type, indices, element):
    """&array[indices...] (leading indices; the rest 0) as element*, from the array's own strides."""
    address = builder.ptrtoint(array.data, _i64)
    for stride, index in zip(cgutils.unpack_tuple(builder, array.strides, array_type.ndim), indices):
        address = builder.add(address, builder.mul(index, stride))
    return builder.inttoptr(address, element.as_pointer())


def _load(builder, pointer, offset, vector):
    return builder.load(builder.bitcast(builder.gep(pointer, [ir.Constant(_i64, offset)]), vector.as_pointer()),
                        align=1)


def _prefetch(builder, address):
    """Ask for the cache line at address (i8*) to be read into the cache, for reading; no fault if it is not
    mapped (the rows past the end of a cache)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [address.type, _i32, _i32,
                                                                                        _i32]), "llvm.prefetch.p0")
    builder.call(fn, [address, ir.Constant(_i32, 0), ir.Constant(_i32, 3), ir.Constant(_i32, 1)])


def _splat(builder, x):
    one = builder.insert_element(ir.Constant(_V16f32, ir.Undefined), x, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_V16i32, [0] * LANES))


def _lanes_sum(builder, v):
    """<16 x float> -> the sum of its lanes, halving the vector four times"""
    n = LANES
    while n > 1:
        n //= 2
        low, high = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, n), list(range(i, i + n))))
                     for i in (0, n))
        v = builder.fadd(low, high, flags=_FAST)
    return builder.extract_element(v, ir.Constant(_i32, 0))


def _halves_to_floats(builder, bits, f16c):
    """float16 bits (<16 x i16> or i16) -> float32 (the same shape). Without F16C: kv_formats'
    _half_bits_to_float_int, lane by lane (the exponent and mantissa moved into a float's places, times 2^112;
    infinities and NaNs kept)."""
    vector = isinstance(bits.type, ir.VectorType)
    n = LANES if vector else None

    def c(value, ty):                                    # a constant, splat across the lanes for vectors
        return ir.Constant(ir.VectorType(ty, n), [value] * n) if vector else ir.Constant(ty, value)
    if f16c:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n) if vector else ir.HalfType()),
                             _V16f32 if vector else _f32)
    i32, f32 = (_V16i32, _V16f32) if vector else (_i32, _f32)
    h = builder.zext(bits, i32)
    sign = builder.shl(builder.and_(h, c(0x8000, _i32)), c(16, _i32))
    rest = builder.and_(h, c(0x7fff, _i32))
    finite = builder.bitcast(builder.fmul(builder.bitcast(builder.shl(rest, c(13, _i32)), f32),
                                          c(2.0 ** 112, _f32)), i32)
    special = builder.or_(c(0x7f800000, _i32), builder.shl(builder.and_(rest, c(0x3ff, _i32)), c(13, _i32)))
    magnitude = builder.select(builder.icmp_unsigned(">=", rest, c(0x7c00, _i32)), special, finite)
    return builder.bitcast(builder.or_(magnitude, sign), f32)


def _row(context, builder, values_type, scales_type, values, scales, s, kvh, head_size, f16c):
    """The stored row [s, kvh] as head_size / 16 vectors of float32 (an int8 value times its group's scale)."""
    v = cgutils.create_struct_proxy(values_type)(context, builder, value=values)
    dtype = values_type.dtype
    element = {types.float32: _f32, types.uint16: _i16, types.int8: _i8}[dtype]
    row = _address(builder, v, values_type, [s, kvh], element)
    ahead = _address(builder, v, values_type, [builder.add(s, ir.Constant(_i64, PREFETCH_ROWS)), kvh], _i8)
    for line in range(0, head_size * {types.float32: 4, types.uint16: 2, types.int8: 1}[dtype], 64):
        _prefetch(builder, builder.gep(ahead, [ir.Constant(_i64, line)]))
    pieces = range(head_size // LANES)
    if dtype == types.float32:
        return [_load(builder, row, LANES * p, _V16f32) for p in pieces]
    if dtype == types.uint16:
        return [_halves_to_floats(builder, _load(builder, row, LANES * p, _V16i16), f16c) for p in pieces]
    sc = cgutils.create_struct_proxy(scales_type)(context, builder, value=scales)
    scale_row = _address(builder, sc, scales_type, [s, kvh], _i16)
    _prefetch(builder, _address(builder, sc, scales_type, [builder.add(s, ir.Constant(_i64, PREFETCH_ROWS)), kvh],
                                _i8))
    group_scales = [_splat(builder, _halves_to_floats(builder, builder.load(builder.gep(
        scale_row, [ir.Constant(_i64, g)])), f16c)) for g in range(head_size // INT8_GROUP)]
    return [builder.fmul(builder.sitofp(_load(builder, row, LANES * p, _V16i8), _V16f32),
                         group_scales[p * LANES // INT8_GROUP], flags=_FAST) for p in pieces]


def row_shape(head_size: int, heads_per_kv: int, int8_group: int | None) -> tuple:
    """The kernels' `shape` argument for heads of head_size values, heads_per_kv query heads per KV head and int8
    groups of int8_group values (None: a float format): (0.0,) * (head_size / 16) + (0,) * heads_per_kv for the
    written-out head sizes, () for the generic path. Only its type matters (how many floats, how many ints); it is
    one flat tuple because Numba's parallel loops do not pass nested ones on."""
    if head_size not in HEAD_SIZES or int8_group not in (None, INT8_GROUP):
        return ()
    return (0.0,) * (head_size // LANES) + (0,) * heads_per_kv


def row_shape_of(k, ks, heads_per_kv: int) -> tuple:
    """row_shape for cached values k [..., Dh] with int8 scales ks (None for a float format)."""
    if not k.flags.c_contiguous:
        return ()
    return row_shape(k.shape[-1], heads_per_kv, None if ks is None else k.shape[-1] // ks.shape[-1])


def _written_out_or_generic(builder, signature, scales_type, scales, head_size, written, generic, loudly_wrong):
    """written(head size, heads per KV head) for the shape the last argument (`shape`) describes, if the run-time
    head size (and int8 groups) match it, else loudly_wrong(); generic() where `shape` is ()."""
    shape = signature.args[-1]
    arrays = [a for a in signature.args if isinstance(a, types.Array)]
    if len(shape) == 0 or any(a.layout != "C" for a in arrays):      # decided when compiling
        return generic()
    size = LANES * sum(isinstance(ty, types.Float) for ty in shape.types)
    heads = len(shape) - size // LANES
    match = builder.icmp_unsigned("==", head_size, ir.Constant(_i64, size))
    if not isinstance(scales_type, types.NoneType):                  # int8: groups of INT8_GROUP values too
        match = builder.and_(match, builder.icmp_unsigned("==", builder.extract_value(scales.shape, 2),
                                                           ir.Constant(_i64, size // INT8_GROUP)))
    with builder.if_else(match, likely=True) as (yes, no):
        with yes:
            written(size, heads)
        with no:
            loudly_wrong()


def _value(context, builder, values_type, scales_type, v, sc, s, kvh, j, f16c):
    """The generic path's one stored value [s, kvh, j] as float32 (an int8 value times its group's scale)."""
    dtype = values_type.dtype
    element = {types.float32: _f32, types.uint16: _i16, types.int8: _i8}[dtype]
    x = builder.load(_address(builder, v, values_type, [s, kvh, j], element))
    if dtype == types.float32:
        return x
    if dtype == types.uint16:
        return _halves_to_floats(builder, x, f16c)
    group = builder.udiv(builder.extract_value(v.shape, 2), builder.extract_value(sc.shape, 2))
    scale = builder.load(_address(builder, sc, scales_type, [s, kvh, builder.udiv(j, group)], _i16))
    return builder.fmul(builder.sitofp(x, _f32), _halves_to_floats(builder, scale, f16c), flags=_FAST)


def _tree_sum(builder, vectors):
    """Pairwise sum of a list of vectors (no long chain of dependent additions)."""
    while len(vectors) > 1:
        vectors = [builder.fadd(vectors[i], vectors[i + 1], flags=_FAST) if i + 1 < len(vectors) else vectors[i]
                   for i in range(0, len(vectors), 2)]
    return vectors[0]


def _indices_as_int64(context, builder, signature, args):
    """The arguments, every integer among them (positions, heads, counts) widened to int64."""
    return [context.cast(builder, a, ty, types.int64) if isinstance(ty, types.Integer) else a
            for a, ty in zip(args, signature.args)]


def _head_groups(heads: int, head_size: int, body):
    """body(first head offset, count) for the heads of a KV head in groups of up to VECTORS_AT_ONCE / (head_size /
    16) (4 heads of 64 values, 2 of 128): each group's q rows or sums stay in registers."""
    most = max(1, VECTORS_AT_ONCE * LANES // head_size)
    for first in range(0, heads, most):
        body(ir.Constant(_i64, first), min(most, heads - first))


def _row_intrinsics(f16c: bool):
    """(score_rows, add_rows) with float16 widened by F16C or by integer arithmetic."""
    @intrinsic
    def score_rows(typingctx, q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0, shape):
        sig = types.none(q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0, shape)

        def codegen(context, builder, signature, args):
            q_, t_, h0_, heads_, k_, ks_, s0_, n_, kvh_, scale_, scores_, i0_, _ = _indices_as_int64(
                context, builder, signature, args)
            qa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=q_)
            sa = cgutils.create_struct_proxy(signature.args[10])(context, builder, value=scores_)

            def body(size, heads_per_kv):
                def heads(first, m):                             # m query heads, their q rows in registers
                    hs = [builder.add(builder.add(h0_, first), ir.Constant(_i64, j)) for j in range(m)]
                    q_rows = [[_load(builder, _address(builder, qa, signature.args[0], [t_, h], _f32), LANES * p,
                                     _V16f32) for p in range(size // LANES)] for h in hs]
                    with cgutils.for_range(builder, n_) as i:
                        row = _row(context, builder, signature.args[4], signature.args[5], k_, ks_,
                                   builder.add(s0_, i.index), kvh_, size, f16c)
                        for h, q_row in zip(hs, q_rows):
                            dot = _lanes_sum(builder, _tree_sum(builder, [
                                builder.fmul(qp, rp, flags=_FAST) for qp, rp in zip(q_row, row)]))
                            builder.store(builder.fmul(dot, scale_, flags=_FAST), _address(
                                builder, sa, signature.args[10], [t_, h, builder.add(i0_, i.index)], _f32))
                _head_groups(heads_per_kv, size, heads)
            ka = cgutils.create_struct_proxy(signature.args[4])(context, builder, value=k_)
            ksa = _scales(context, builder, signature.args[5], ks_)
            head_size = builder.extract_value(qa.shape, 2)

            def generic():
                with cgutils.for_range(builder, heads_) as g, cgutils.for_range(builder, n_) as i:
                    h, s = builder.add(h0_, g.index), builder.add(s0_, i.index)
                    total = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
                    with cgutils.for_range(builder, head_size) as j:
                        x = _value(context, builder, signature.args[4], signature.args[5], ka, ksa, s, kvh_,
                                   j.index, f16c)
                        qj = builder.load(_address(builder, qa, signature.args[0], [t_, h, j.index], _f32))
                        builder.store(builder.fadd(builder.load(total), builder.fmul(qj, x, flags=_FAST),
                                                   flags=_FAST), total)
                    builder.store(builder.fmul(builder.load(total), scale_, flags=_FAST), _address(
                        builder, sa, signature.args[10], [t_, h, builder.add(i0_, i.index)], _f32))

            def loudly_wrong():
                with cgutils.for_range(builder, heads_) as g, cgutils.for_range(builder, n_) as i:
                    builder.store(ir.Constant(_f32, float("nan")), _address(
                        builder, sa, signature.args[10], [t_, builder.add(h0_, g.index), builder.add(i0_, i.index)],
                        _f32))
            _written_out_or_generic(builder, signature, signature.args[5], ksa, head_size, body, generic,
                                    loudly_wrong)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def add_rows(typingctx, acc, t, h0, n_heads, p, i0, n, v, vs, s0, kvh, shape):
        sig = types.none(acc, t, h0, n_heads, p, i0, n, v, vs, s0, kvh, shape)

        def codegen(context, builder, signature, args):
            acc_, t_, h0_, heads_, p_, i0_, n_, v_, vs_, s0_, kvh_, _ = _indices_as_int64(context, builder,
                                                                                          signature, args)
            aa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=acc_)
            pa = cgutils.create_struct_proxy(signature.args[4])(context, builder, value=p_)

            def body(size, heads_per_kv):
                def heads(first, m):                             # m query heads, their sums in registers
                    hs = [builder.add(builder.add(h0_, first), ir.Constant(_i64, j)) for j in range(m)]
                    acc_rows = [builder.bitcast(_address(builder, aa, signature.args[0], [t_, h], _f32),
                                                _V16f32.as_pointer()) for h in hs]
                    sums = [[cgutils.alloca_once_value(builder, builder.load(builder.gep(r, [ir.Constant(_i64, p)]),
                                                                             align=1))
                             for p in range(size // LANES)] for r in acc_rows]
                    with cgutils.for_range(builder, n_) as i:
                        row = _row(context, builder, signature.args[7], signature.args[8], v_, vs_,
                                   builder.add(s0_, i.index), kvh_, size, f16c)
                        for h, sum_h in zip(hs, sums):
                            weight = _splat(builder, builder.load(_address(
                                builder, pa, signature.args[4], [t_, h, builder.add(i0_, i.index)], _f32)))
                            for where, piece in zip(sum_h, row):
                                builder.store(builder.fadd(builder.load(where), builder.fmul(weight, piece,
                                                                                            flags=_FAST),
                                                           flags=_FAST), where)
                    for r, sum_h in zip(acc_rows, sums):
                        for p, where in enumerate(sum_h):
                            builder.store(builder.load(where), builder.gep(r, [ir.Constant(_i64, p)]), align=1)
                _head_groups(heads_per_kv, size, heads)
            va = cgutils.create_struct_proxy(signature.args[7])(context, builder, value=v_)
            vsa = _scales(context, builder, signature.args[8], vs_)
            head_size = builder.extract_value(aa.shape, 2)

            def generic():
                with cgutils.for_range(builder, heads_) as g, cgutils.for_range(builder, n_) as i:
                    h, s = builder.add(h0_, g.index), builder.add(s0_, i.index)
                    weight = builder.load(_address(builder, pa, signature.args[4], [t_, h, builder.add(i0_, i.index)],
                                                   _f32))
                    with cgutils.for_range(builder, head_size) as j:
                        x = _value(context, builder, signature.args[7], signature.args[8], va, vsa, s, kvh_,
                                   j.index, f16c)
                        where = _address(builder, aa, signature.args[0], [t_, h, j.index], _f32)
                        builder.store(builder.fadd(builder.load(where), builder.fmul(weight, x, flags=_FAST),
                                                   flags=_FAST), where)

            def loudly_wrong():
                with cgutils.for_range(builder, heads_) as g, cgutils.for_range(builder, head_size) as j:
                    builder.store(ir.Constant(_f32, float("nan")), _address(
                        builder, aa, signature.args[0], [t_, builder.add(h0_, g.index), j.index], _f32))
            _written_out_or_generic(builder, signature, signature.args[8], vsa, head_size, body, generic,
                                    loudly_wrong)
            return context.get_dummy_value()
        return sig, codegen
    return score_rows, add_rows


def _scales(context, builder, scales_type, scales):
    """The int8 scales' array struct, or None for a float format."""
    if isinstance(scales_type, types.NoneType):
        return None
    return cgutils.create_struct_proxy(scales_type)(context, builder, value=scales)


def score_rows_reference(q, t, h0, G, k, ks, s0, n, kvh, scale, scores, i0, shape=()):
    """score_rows as plain loops."""
    for h in range(h0, h0 + G):
        for i in range(n):
            total = np.float32(0.0)
            for j in range(q.shape[2]):
                total += q[t, h, j] * kv_value(k, ks, s0 + i, kvh, j)
            scores[t, h, i0 + i] = total * scale


def add_rows_reference(acc, t, h0, G, p, i0, n, v, vs, s0, kvh, shape=()):
    """add_rows as plain loops."""
    for h in range(h0, h0 + G):
        for i in range(n):
            for j in range(acc.shape[2]):
                acc[t, h, j] += p[t, h, i0 + i] * kv_value(v, vs, s0 + i, kvh, j)


if config.DISABLE_JIT:                   # stepping through as Python: the plain loops
    score_rows, add_rows = score_rows_reference, add_rows_reference
else:
    score_rows, add_rows = _row_intrinsics(F16C)
