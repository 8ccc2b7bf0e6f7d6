"""Decode attention's two inner steps on one cached position, for the G query heads that share its KV head, in
LLVM IR:

    score_row(q, t, h0, n, k, ks, s, kvh, scale, scores, i)    scores[t, h, i] = scale * q[t, h] . K[s, kvh]
    add_row(acc, t, h0, n, p, i, v, vs, s, kvh)                acc[t, h] += p[t, h, i] * V[s, kvh]
                                                                for the n query heads h = h0 .. h0+n-1

The stored row (kv_formats.py: float32, float16 bits, or int8 with a float16 scale per 32 values) is loaded and
widened to float32 once, 16 values to a vector, and stays in registers for all n heads: the float16 and int8
conversions are paid once per KV head instead of once per query head. The row is written out without loops: with
the head size known only at run time, LLVM's loops over it kept their counters, overlap checks and leftover
iterations, and int8 attention ran 1.5x slower in them than written out (the plain loops, kv_formats.dot_kv and
add_kv, remain the readable twin and the path for other shapes). Code is generated for head sizes 64 and 128, the
usual ones; `fits(k, ks)` says whether a cache's rows are one of those (int8 in groups of 32, rows contiguous).
"""
from __future__ import annotations

from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .kv_formats import F16C

HEAD_SIZES = (64, 128)          # the head sizes written out
LANES = 16                      # float32 values per vector (one AVX-512 register)
INT8_GROUP = 32                 # values per int8 scale that the code here reads


def fits(k, ks) -> bool:
    """Whether score_row and add_row read this cache's rows (k [S, KVH, Dh] values, ks its int8 scales or None)."""
    group_ok = ks is None or k.shape[2] // ks.shape[2] == INT8_GROUP
    return k.shape[2] in HEAD_SIZES and group_ok


@overload(fits, inline="always")
def _fits_typed(k, ks):
    if k.layout != "C" or not (isinstance(ks, types.NoneType) or ks.layout == "C"):
        return lambda k, ks: False                       # strided rows: the plain loops
    if isinstance(ks, types.NoneType):
        return lambda k, ks: k.shape[2] == 64 or k.shape[2] == 128
    return lambda k, ks: (k.shape[2] == 64 or k.shape[2] == 128) and k.shape[2] // ks.shape[2] == 32


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
    pieces = range(head_size // LANES)
    if dtype == types.float32:
        return [_load(builder, row, LANES * p, _V16f32) for p in pieces]
    if dtype == types.uint16:
        return [_halves_to_floats(builder, _load(builder, row, LANES * p, _V16i16), f16c) for p in pieces]
    sc = cgutils.create_struct_proxy(scales_type)(context, builder, value=scales)
    scale_row = _address(builder, sc, scales_type, [s, kvh], _i16)
    group_scales = [_splat(builder, _halves_to_floats(builder, builder.load(builder.gep(
        scale_row, [ir.Constant(_i64, g)])), f16c)) for g in range(head_size // INT8_GROUP)]
    return [builder.fmul(builder.sitofp(_load(builder, row, LANES * p, _V16i8), _V16f32),
                         group_scales[p * LANES // INT8_GROUP], flags=_FAST) for p in pieces]


def _for_each_head_size(builder, head_size_value, body):
    """body(head size) in the branch where the run-time head size is that one (fits() excludes every other)."""
    with builder.if_else(builder.icmp_unsigned("==", head_size_value,
                                               ir.Constant(head_size_value.type, HEAD_SIZES[0]))) as (small, large):
        with small:
            body(HEAD_SIZES[0])
        with large:
            body(HEAD_SIZES[1])


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


def _row_intrinsics(f16c: bool):
    """(score_row, add_row) with float16 widened by F16C or by integer arithmetic."""
    @intrinsic
    def score_row(typingctx, q, t, h0, n, k, ks, s, kvh, scale, scores, i):
        sig = types.none(q, t, h0, n, k, ks, s, kvh, scale, scores, i)

        def codegen(context, builder, signature, args):
            q_, t_, h0_, n_, k_, ks_, s_, kvh_, scale_, scores_, i_ = _indices_as_int64(context, builder, signature,
                                                                                        args)
            qa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=q_)
            sa = cgutils.create_struct_proxy(signature.args[9])(context, builder, value=scores_)
            head_size = builder.extract_value(qa.shape, 2)

            def body(size):
                row = _row(context, builder, signature.args[4], signature.args[5], k_, ks_, s_, kvh_, size, f16c)
                with cgutils.for_range(builder, n_) as g:
                    h = builder.add(h0_, g.index)
                    q_row = _address(builder, qa, signature.args[0], [t_, h], _f32)
                    products = [builder.fmul(_load(builder, q_row, LANES * p, _V16f32), piece, flags=_FAST)
                                for p, piece in enumerate(row)]
                    score = builder.fmul(_lanes_sum(builder, _tree_sum(builder, products)), scale_, flags=_FAST)
                    builder.store(score, _address(builder, sa, signature.args[9], [t_, h, i_], _f32))
            _for_each_head_size(builder, head_size, body)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def add_row(typingctx, acc, t, h0, n, p, i, v, vs, s, kvh):
        sig = types.none(acc, t, h0, n, p, i, v, vs, s, kvh)

        def codegen(context, builder, signature, args):
            acc_, t_, h0_, n_, p_, i_, v_, vs_, s_, kvh_ = _indices_as_int64(context, builder, signature, args)
            aa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=acc_)
            pa = cgutils.create_struct_proxy(signature.args[4])(context, builder, value=p_)
            head_size = builder.extract_value(aa.shape, 2)

            def body(size):
                row = _row(context, builder, signature.args[6], signature.args[7], v_, vs_, s_, kvh_, size, f16c)
                with cgutils.for_range(builder, n_) as g:
                    h = builder.add(h0_, g.index)
                    weight = _splat(builder, builder.load(_address(builder, pa, signature.args[4], [t_, h, i_],
                                                                   _f32)))
                    acc_row = _address(builder, aa, signature.args[0], [t_, h], _f32)
                    for piece_index, piece in enumerate(row):
                        where = builder.bitcast(builder.gep(acc_row, [ir.Constant(_i64, LANES * piece_index)]),
                                                _V16f32.as_pointer())
                        builder.store(builder.fadd(builder.load(where, align=1),
                                                   builder.fmul(weight, piece, flags=_FAST), flags=_FAST),
                                      where, align=1)
            _for_each_head_size(builder, head_size, body)
            return context.get_dummy_value()
        return sig, codegen
    return score_row, add_row


if config.DISABLE_JIT:                   # stepping through as Python: the plain loops (fits() is then False)
    def fits(k, ks) -> bool:             # noqa: F811
        return False
    score_row = add_row = None
else:
    score_row, add_row = _row_intrinsics(F16C)

