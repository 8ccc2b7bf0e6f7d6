"""Decode attention's two inner loops, over n cached positions of one KV head for the query heads that share it,
in LLVM IR:

    score_rows(q, t, h0, G, k, ks, s0, n, kvh, scale, scores, i0)
        scores[t, h, i0+i] = scale * q[t, h] . K[s0+i, kvh]
    add_rows(acc, t, h0, G, p, i0, n, v, vs, s0, kvh)
        acc[t, h] += sum over i of p[t, h, i0+i] * V[s0+i, kvh]
    for i < n and the G query heads h = h0 .. h0+G-1

Each stored row (kv_formats.py: float32, float16 bits, or int8 with a float16 scale per 32 values) is loaded and
widened to float32 once, 16 values to a vector, for all G query heads, whose q rows (score_rows) or running sums
(add_rows) stay in registers for the whole pass, up to HEADS_AT_ONCE heads at a time; the rows PREFETCH_ROWS ahead
are requested from memory as it goes, since the hardware prefetcher alone left the float16 and int8 kernels
waiting on memory. A row is written out without loops over its values: with the head size known only at run
time, LLVM's loops kept their counters, overlap checks and leftover iterations, and ran 1.5x slower. Code is
generated for head sizes 64 and 128, the usual ones; `fits(k, ks)` says whether a cache's rows are one of those
(int8 in groups of 32, rows contiguous). The plain loops kv_formats.dot_kv and add_kv remain the readable twin and
the path for every other shape.
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
PREFETCH_ROWS = 32              # how far ahead of the row it reads a pass asks for rows from memory
HEADS_AT_ONCE = 4               # query heads whose q rows (or sums) stay in registers through a pass over the rows


def fits(k, ks) -> bool:
    """Whether score_rows and add_rows read this cache's rows (k [S, KVH, Dh] values, ks its int8 scales or None)."""
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


def _head_groups(builder, n_heads, body):
    """body(first head offset, heads) for the heads in groups of up to HEADS_AT_ONCE, `heads` a Python int (the
    code for each group size is written out; n_heads is known only at run time)."""
    at_once = ir.Constant(_i64, HEADS_AT_ONCE)
    with cgutils.for_range(builder, builder.udiv(builder.add(n_heads, ir.Constant(_i64, HEADS_AT_ONCE - 1)),
                                                 at_once)) as group:
        first = builder.mul(group.index, at_once)
        left = builder.sub(n_heads, first)

        def sizes(m):                                    # if left == m (or, for the largest, >= m) ... else smaller
            if m == 1:
                return body(first, 1)
            with builder.if_else(builder.icmp_unsigned(">=", left, ir.Constant(_i64, m))) as (this, smaller):
                with this:
                    body(first, m)
                with smaller:
                    sizes(m - 1)
        sizes(HEADS_AT_ONCE)


def _row_intrinsics(f16c: bool):
    """(score_rows, add_rows) with float16 widened by F16C or by integer arithmetic."""
    @intrinsic
    def score_rows(typingctx, q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0):
        sig = types.none(q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0)

        def codegen(context, builder, signature, args):
            q_, t_, h0_, heads_, k_, ks_, s0_, n_, kvh_, scale_, scores_, i0_ = _indices_as_int64(
                context, builder, signature, args)
            qa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=q_)
            sa = cgutils.create_struct_proxy(signature.args[10])(context, builder, value=scores_)

            def body(size):
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
                _head_groups(builder, heads_, heads)
            _for_each_head_size(builder, builder.extract_value(qa.shape, 2), body)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def add_rows(typingctx, acc, t, h0, n_heads, p, i0, n, v, vs, s0, kvh):
        sig = types.none(acc, t, h0, n_heads, p, i0, n, v, vs, s0, kvh)

        def codegen(context, builder, signature, args):
            acc_, t_, h0_, heads_, p_, i0_, n_, v_, vs_, s0_, kvh_ = _indices_as_int64(context, builder, signature,
                                                                                       args)
            aa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=acc_)
            pa = cgutils.create_struct_proxy(signature.args[4])(context, builder, value=p_)

            def body(size):
                def heads(first, m):                             # m query heads, their sums in registers
                    hs = [builder.add(builder.add(h0_, first), ir.Constant(_i64, j)) for j in range(m)]
                    rows = [builder.bitcast(_address(builder, aa, signature.args[0], [t_, h], _f32),
                                            _V16f32.as_pointer()) for h in hs]
                    sums = [[cgutils.alloca_once_value(builder, builder.load(builder.gep(r, [ir.Constant(_i64, p)]),
                                                                             align=1))
                             for p in range(size // LANES)] for r in rows]
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
                    for r, sum_h in zip(rows, sums):
                        for p, where in enumerate(sum_h):
                            builder.store(builder.load(where), builder.gep(r, [ir.Constant(_i64, p)]), align=1)
                _head_groups(builder, heads_, heads)
            _for_each_head_size(builder, builder.extract_value(aa.shape, 2), body)
            return context.get_dummy_value()
        return sig, codegen
    return score_rows, add_rows


if config.DISABLE_JIT:                   # stepping through as Python: the plain loops (fits() is then False)
    def fits(k, ks) -> bool:             # noqa: F811
        return False
    score_rows = add_rows = None
else:
    score_rows, add_rows = _row_intrinsics(F16C)

