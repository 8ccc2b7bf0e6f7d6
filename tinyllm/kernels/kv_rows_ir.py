"""kv_rows.py's score_rows and add_rows in LLVM IR: the fast version of decode attention's two inner loops.

Each stored row is loaded and widened to float32 once, 16 values to a vector, for all G query heads, whose q rows
(score_rows) or running sums (add_rows) stay in registers for the whole pass (VECTORS_AT_ONCE vectors of them at a
time); the rows PREFETCH_ROWS ahead are requested from memory as it goes, since the hardware prefetcher alone left
the float16 and int8 kernels waiting on memory, and into L2 only: requested into L1 as well, they held up the loads
of the rows being read, and a pass over a long context took 1.5x as long. A row is written out without loops over
its values: with the head size known only at run time, LLVM's loops kept their counters, overlap checks and leftover
iterations, and ran 1.5x slower. Code is written out for head sizes 64 and 128 (int8 in groups of 32), the usual
ones; any other shape takes a generic path of plain loops in the same IR.

score_rows adds up the products of ROWS_PER_TREE float16 or int8 rows in one reduction tree per head
(_lane_sums): summing each row's 16 lanes alone was a third of its instructions. Over an int8 cache q is rounded
to int8 blocks as well (per 32 values, a float32 step: kv_cache.query_for, which every twin of attention applies
too), so q . k needs no widening at all: with AVX-512 VNNI one vpdpbusd multiplies 64 stored bytes by q's levels
and sums them in fours (llama.cpp's Q8_0 dot product); without it, vpmaddwd takes 32 at a time. Widening each
int8 row to float32 first had made the int8 kernel slower than the float16 one, which reads twice the bytes.

Left out: the contract, the `shape` argument and the plain loops (kv_rows.py).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .llvm_ir import call, prefetch

HEAD_SIZES = (64, 128)          # the head sizes written out
LANES = 16                      # float32 values per vector (one AVX-512 register)
INT8_GROUP = 32                 # values per int8 scale that the code here reads
PREFETCH_ROWS = 32              # how far ahead of the row it reads a pass asks for rows from memory
VECTORS_AT_ONCE = 16            # q rows (or sums) of a pass's query heads kept in registers, in 16-value vectors
ROWS_PER_TREE = 4               # rows whose dot products one reduction tree adds up (float16, int8)


_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16i8, _V16i16, _V16i32 = ir.VectorType(_i8, LANES), ir.VectorType(_i16, LANES), ir.VectorType(_i32, LANES)
_V32i32 = ir.VectorType(_i32, 2 * LANES)
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


def _splat(builder, x, n=LANES):
    """x -> <n x x's type> of copies"""
    one = builder.insert_element(ir.Constant(ir.VectorType(x.type, n), ir.Undefined), x, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_i32, n), [0] * n))


def _add(builder, a, b):
    return builder.fadd(a, b, flags=_FAST) if isinstance(a.type.element, ir.FloatType) else builder.add(a, b)


def _fold(builder, a, b, width):
    """a and b (b may be a itself) hold partial sums of some sources, `width` consecutive lanes per source ->
    one vector with every source of a, then of b (unless b is a), in width / 2 lanes: each source's two halves
    added."""
    n = a.type.count
    sources = [s * width for s in range(n // width)] + ([] if b is a else [n + s * width for s in range(n // width)])

    def lanes(offset):
        return ir.Constant(ir.VectorType(_i32, len(sources) * (width // 2)),
                           [s + offset + j for s in sources for j in range(width // 2)])
    return _add(builder, builder.shuffle_vector(a, b, lanes(0)), builder.shuffle_vector(a, b, lanes(width // 2)))


def _lane_sums(builder, vectors, width=LANES):
    """A power-of-two count of vectors, each the partial sums of one source in `width` lanes (or a single vector
    of several sources) -> one vector whose lane j is the total of source j. One reduction tree for all: 4 sums
    of 16 lanes take 15 vector operations this way, 32 one by one."""
    while len(vectors) > 1:
        vectors = [_fold(builder, vectors[i], vectors[i + 1], width) for i in range(0, len(vectors), 2)]
        width //= 2
    v = vectors[0]
    while width > 1:
        v = _fold(builder, v, v, width)
        width //= 2
    return v


def _vector_of(builder, scalars):
    """Scalars of one type -> a vector of them."""
    v = ir.Constant(ir.VectorType(scalars[0].type, len(scalars)), ir.Undefined)
    for i, x in enumerate(scalars):
        v = builder.insert_element(v, x, ir.Constant(_i32, i))
    return v


def _concat(builder, vectors):
    """Vectors of one type -> one vector of all their lanes in order (a power-of-two count of them)."""
    while len(vectors) > 1:
        n = vectors[0].type.count
        vectors = [builder.shuffle_vector(vectors[i], vectors[i + 1], ir.Constant(ir.VectorType(_i32, 2 * n),
                                                                                   list(range(2 * n))))
                   for i in range(0, len(vectors), 2)]
    return vectors[0]


def _halves_to_floats(builder, bits, f16c):
    """float16 bits (<n x i16> or i16) -> float32 (the same shape). Without F16C: kv_formats'
    _half_bits_to_float_int, lane by lane (the exponent and mantissa moved into a float's places, times 2^112;
    infinities and NaNs kept)."""
    vector = isinstance(bits.type, ir.VectorType)
    n = bits.type.count if vector else None

    def c(value, ty):                                    # a constant, splat across the lanes for vectors
        return ir.Constant(ir.VectorType(ty, n), [value] * n) if vector else ir.Constant(ty, value)
    if f16c:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n) if vector else ir.HalfType()),
                             ir.VectorType(_f32, n) if vector else _f32)
    i32, f32 = (ir.VectorType(_i32, n), ir.VectorType(_f32, n)) if vector else (_i32, _f32)
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
        prefetch(builder, builder.gep(ahead, [ir.Constant(_i64, line)]), into_l2=True)
    pieces = range(head_size // LANES)
    if dtype == types.float32:
        return [_load(builder, row, LANES * p, _V16f32) for p in pieces]
    if dtype == types.uint16:
        return [_halves_to_floats(builder, _load(builder, row, LANES * p, _V16i16), f16c) for p in pieces]
    sc = cgutils.create_struct_proxy(scales_type)(context, builder, value=scales)
    scale_row = _address(builder, sc, scales_type, [s, kvh], _i16)
    prefetch(builder, _address(builder, sc, scales_type, [builder.add(s, ir.Constant(_i64, PREFETCH_ROWS)), kvh],
                               _i8), into_l2=True)
    group_scales = [_splat(builder, _halves_to_floats(builder, builder.load(builder.gep(
        scale_row, [ir.Constant(_i64, g)])), f16c)) for g in range(head_size // INT8_GROUP)]
    return [builder.fmul(builder.sitofp(_load(builder, row, LANES * p, _V16i8), _V16f32),
                         group_scales[p * LANES // INT8_GROUP], flags=_FAST) for p in pieces]


def _q_blocks(builder, pieces, scale, vnni):
    """An int8 cache's q . k runs in integers, q rounded to int8 blocks too (as llama.cpp does with a Q8_0 cache):
    one query head's q row (16-float vectors) -> (its levels, per 32-value group, of max|group| / 127: VNNI takes
    them as <64 x i8> per 64 values, the fallback as <32 x i8> per group; VNNI's starting sums, -128 times each
    lane's 4 levels (it multiplies k + 128); the factor per group, max|group| / 127 times `scale`, NaN where the
    group holds a NaN: loudly wrong, as float arithmetic would be)."""
    zero, per_group = ir.Constant(_f32, 0.0), INT8_GROUP // LANES
    ints, factors = [], []
    for g in range(0, len(pieces), per_group):
        group = pieces[g:g + per_group]
        largest = call(builder, "llvm.fabs.v16f32", _V16f32, group[0])
        nan = builder.fcmp_unordered("uno", group[0], group[0])
        for piece in group[1:]:
            largest = call(builder, "llvm.maxnum.v16f32", _V16f32, largest,
                           call(builder, "llvm.fabs.v16f32", _V16f32, piece))
            nan = builder.or_(nan, builder.fcmp_unordered("uno", piece, piece))
        amax = call(builder, "llvm.vector.reduce.fmax.v16f32", _f32, largest)
        # (no fast-math flags: the numpy twin, kv_cache.query_for, rounds with the same operations)
        step = builder.select(builder.fcmp_ordered(">", amax, zero), builder.fdiv(ir.Constant(_f32, 127.0), amax),
                              zero)
        ints += [builder.fptosi(call(builder, "llvm.rint.v16f32", _V16f32,
                                     builder.fmul(piece, _splat(builder, step))), _V16i32) for piece in group]
        factor = builder.fmul(amax, builder.fmul(scale, ir.Constant(_f32, 1.0 / 127.0)))
        factors.append(builder.select(call(builder, "llvm.vector.reduce.or.v16i1", ir.IntType(1), nan),
                                      ir.Constant(_f32, float("nan")), factor))
    width = 4 * LANES if vnni else INT8_GROUP                  # levels per vector handed on
    levels, starts = [], []
    for i in range(0, len(ints), width // LANES):
        block = _concat(builder, ints[i:i + width // LANES])  # <width x i32>
        levels.append(builder.trunc(block, ir.VectorType(_i8, width)))
        if vnni:                                               # lane l sums bytes 4l .. 4l+3
            four = [builder.shuffle_vector(block, block, ir.Constant(_V16i32, list(range(j, width, 4))))
                    for j in range(4)]
            starts.append(builder.mul(_tree_sum(builder, four), ir.Constant(_V16i32, [-128] * LANES)))
    return levels, starts, factors


def _int8_row_dots(context, builder, values_type, scales_type, values, scales, s, kvh, head_size, q_blocks, vnni):
    """The stored int8 row [s, kvh] against each head's q levels (_q_blocks) -> per head, vectors of integer
    partial sums, each 16 lanes: VNNI, one vector per 64 values whose lanes 0-7 and 8-15 are two groups' (each lane
    4 products: vpdpbusd); the fallback, one per group (each lane 2 products: vpmaddwd). And the row's group
    scales (float16 bits, <head_size / 32 x i16>)."""
    v = cgutils.create_struct_proxy(values_type)(context, builder, value=values)
    sc = cgutils.create_struct_proxy(scales_type)(context, builder, value=scales)
    row = _address(builder, v, values_type, [s, kvh], _i8)
    ahead = builder.add(s, ir.Constant(_i64, PREFETCH_ROWS))
    for line in range(0, head_size, 64):
        prefetch(builder, builder.gep(_address(builder, v, values_type, [ahead, kvh], _i8),
                                      [ir.Constant(_i64, line)]), into_l2=True)
    prefetch(builder, _address(builder, sc, scales_type, [ahead, kvh], _i8), into_l2=True)
    scale_bits = builder.load(builder.bitcast(_address(builder, sc, scales_type, [s, kvh], _i16),
                                              ir.VectorType(_i16, head_size // INT8_GROUP).as_pointer()), align=1)
    if vnni:                                                   # k + 128 as unsigned bytes: one xor per row
        k_blocks = [builder.xor(_load(builder, row, 64 * b, ir.VectorType(_i8, 64)), ir.Constant(
            ir.VectorType(_i8, 64), [-128] * 64)) for b in range(head_size // 64)]
        return [[call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16i32, start, k, q)
                 for k, q, start in zip(k_blocks, levels, starts)] for levels, starts in q_blocks], scale_bits
    k_groups = [builder.sext(_load(builder, row, INT8_GROUP * g, ir.VectorType(_i8, INT8_GROUP)), _V32i32)
                for g in range(head_size // INT8_GROUP)]
    evens, odds = (ir.Constant(_V16i32, list(range(first, INT8_GROUP, 2))) for first in (0, 1))
    dots = []
    for levels, _ in q_blocks:
        products = [builder.mul(k, builder.sext(q, _V32i32)) for k, q in zip(k_groups, levels)]   # <32 x i32>
        dots.append([builder.add(builder.shuffle_vector(p, p, evens), builder.shuffle_vector(p, p, odds))
                     for p in products])
    return dots, scale_bits


def _q_group_step_and_factor(builder, qa, q_type, t, h, j0, group, scale):
    """The generic path's _q_blocks for one group, q[t, h, j0 : j0+group]: (the multiplier that takes it to its int8
    levels, the factor back to a scaled score; NaN if the group holds a NaN)."""
    amax = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
    nan = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 0))
    with cgutils.for_range(builder, group) as j:
        x = builder.load(_address(builder, qa, q_type, [t, h, builder.add(j0, j.index)], _f32))
        builder.store(call(builder, "llvm.maxnum.f32", _f32, builder.load(amax),
                           call(builder, "llvm.fabs.f32", _f32, x)), amax)
        builder.store(builder.or_(builder.load(nan), builder.fcmp_unordered("uno", x, x)), nan)
    largest, zero = builder.load(amax), ir.Constant(_f32, 0.0)
    step = builder.select(builder.fcmp_ordered(">", largest, zero),
                          builder.fdiv(ir.Constant(_f32, 127.0), largest), zero)
    factor = builder.fmul(largest, builder.fmul(scale, ir.Constant(_f32, 1.0 / 127.0)))
    return step, builder.select(builder.load(nan), ir.Constant(_f32, float("nan")), factor)



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
        vectors = [_add(builder, vectors[i], vectors[i + 1]) if i + 1 < len(vectors) else vectors[i]
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


def row_intrinsics(f16c: bool, vnni: bool):
    """(score_rows, add_rows) with float16 widened by F16C or by integer arithmetic, and an int8 cache's q . k by
    AVX-512 VNNI or by pairs of 16-bit products."""
    @intrinsic
    def score_rows(typingctx, q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0, shape):
        sig = types.none(q, t, h0, n_heads, k, ks, s0, n, kvh, scale, scores, i0, shape)

        def codegen(context, builder, signature, args):
            q_, t_, h0_, heads_, k_, ks_, s0_, n_, kvh_, scale_, scores_, i0_, _ = _indices_as_int64(
                context, builder, signature, args)
            qa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=q_)
            sa = cgutils.create_struct_proxy(signature.args[10])(context, builder, value=scores_)

            def body(size, heads_per_kv):
                int8 = signature.args[4].dtype == types.int8
                groups = size // INT8_GROUP

                def heads(first, m):                             # m query heads, their q rows in registers
                    hs = [builder.add(builder.add(h0_, first), ir.Constant(_i64, j)) for j in range(m)]
                    q_rows = [[_load(builder, _address(builder, qa, signature.args[0], [t_, h], _f32), LANES * p,
                                     _V16f32) for p in range(size // LANES)] for h in hs]
                    if int8:                                     # int8 levels in registers instead
                        q_blocks = [_q_blocks(builder, q_row, scale_, vnni) for q_row in q_rows]

                    def scores_of(first_row, rows):              # positions first_row .. first_row+rows-1
                        dots, scale_bits = [], []                # dots[r][head]: vectors whose lanes add up to it
                        for r in range(rows):
                            s = builder.add(s0_, builder.add(first_row, ir.Constant(_i64, r)))
                            if int8:
                                d, bits = _int8_row_dots(context, builder, signature.args[4], signature.args[5], k_,
                                                         ks_, s, kvh_, size, [b[:2] for b in q_blocks], vnni)
                                scale_bits.append(bits)
                            else:
                                row = _row(context, builder, signature.args[4], signature.args[5], k_, ks_, s, kvh_,
                                           size, f16c)
                                d = [[_tree_sum(builder, [builder.fmul(qp, rp, flags=_FAST)
                                                          for qp, rp in zip(q_row, row)])] for q_row in q_rows]
                            dots.append(d)
                        if int8:                                 # [rows * groups] each row's group scales
                            k_scales = _halves_to_floats(builder, _concat(builder, scale_bits), f16c)
                        for j, h in enumerate(hs):
                            if int8:                             # a sum per row and group, scaled, then added
                                sums = _lane_sums(builder, [vector for d in dots for vector in d[j]],
                                                  LANES // 2 if vnni else LANES)
                                q_factors = _concat(builder, [_vector_of(builder, q_blocks[j][2])] * rows)
                                sums = _lane_sums(builder, [builder.fmul(builder.fmul(builder.sitofp(
                                    sums, k_scales.type), k_scales, flags=_FAST), q_factors, flags=_FAST)], groups)
                            else:                                # a sum per row
                                sums = _lane_sums(builder, [vector for d in dots for vector in d[j]])
                                sums = builder.fmul(sums, _splat(builder, scale_, rows), flags=_FAST)
                            builder.store(sums, builder.bitcast(_address(builder, sa, signature.args[10], [
                                t_, h, builder.add(i0_, first_row)], _f32), sums.type.as_pointer()), align=4)
                    # float32 rows one at a time: their kernel waits on memory, and ran slower with the trees
                    per_tree = 1 if signature.args[4].dtype == types.float32 else ROWS_PER_TREE
                    trees = builder.udiv(n_, ir.Constant(_i64, per_tree))
                    with cgutils.for_range(builder, trees) as tree:
                        scores_of(builder.mul(tree.index, ir.Constant(_i64, per_tree)), per_tree)
                    done = builder.mul(trees, ir.Constant(_i64, per_tree))
                    with cgutils.for_range(builder, builder.sub(n_, done)) as rest:      # the last n % 4, alone
                        scores_of(builder.add(done, rest.index), 1)
                _head_groups(heads_per_kv, size, heads)
            ka = cgutils.create_struct_proxy(signature.args[4])(context, builder, value=k_)
            ksa = _scales(context, builder, signature.args[5], ks_)
            head_size = builder.extract_value(qa.shape, 2)

            def generic():                               # (int8: q's levels found again for every row)
                groups = ir.Constant(_i64, 1) if ksa is None else builder.extract_value(ksa.shape, 2)
                group = builder.udiv(head_size, groups)                  # values per group (float: all of them)
                with cgutils.for_range(builder, heads_) as g, cgutils.for_range(builder, n_) as i:
                    h, s = builder.add(h0_, g.index), builder.add(s0_, i.index)
                    score = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
                    with cgutils.for_range(builder, groups) as b:
                        j0 = builder.mul(b.index, group)
                        step, factor = (None, scale_) if ksa is None else _q_group_step_and_factor(
                            builder, qa, signature.args[0], t_, h, j0, group, scale_)
                        total = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
                        with cgutils.for_range(builder, group) as j:
                            jj = builder.add(j0, j.index)
                            x = _value(context, builder, signature.args[4], signature.args[5], ka, ksa, s, kvh_, jj,
                                       f16c)
                            qj = builder.load(_address(builder, qa, signature.args[0], [t_, h, jj], _f32))
                            if step is not None:                 # an int8 cache: q's int8 level
                                qj = call(builder, "llvm.rint.f32", _f32, builder.fmul(qj, step))
                            builder.store(builder.fadd(builder.load(total), builder.fmul(qj, x, flags=_FAST),
                                                       flags=_FAST), total)
                        builder.store(builder.fadd(builder.load(score), builder.fmul(builder.load(total), factor,
                                                                                     flags=_FAST), flags=_FAST), score)
                    builder.store(builder.load(score), _address(
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

