"""The stored K/V formats as the attention kernels see them (kv_cache.py's kv_dtype): reading a value, its scale,
and writing a new row (the fused block stores its token's K/V itself).

    kv_dtype   values the kernel gets         scales
    float32    float32 [..., KVH, Dh]         None
    float16    uint16 [..., KVH, Dh]          None      (the float16 bits: Numba has no float16 type)
    int8       int8 [..., KVH, Dh]            uint16 [..., KVH, Dh/group]   (float16 bits, as Q8_0's scales)

Each helper below is specialised to its argument types when a kernel compiles, so a float32 cache compiles to the
same loops as before and the float16 / int8 variants are compiled only by a model that uses them. A float16
value is widened by one instruction (F16C's vcvtph2ps, which every x86-64 CPU with AVX2 has), in LLVM IR.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.extending import intrinsic, overload

from ..kv_cache import QuantizedKV

if not config.DISABLE_JIT:
    @intrinsic
    def _half_bits_to_float(typingctx, bits):
        """uint16 holding a float16's bits -> that value as float32 (exact)."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def _float_to_half_bits(typingctx, x):
        """float32 -> the bits of the nearest float16 (ties to even, as numpy's astype(float16))."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen


def kernel_operands(kv) -> tuple[np.ndarray, np.ndarray | None]:
    """Stored K or V (a float32 / float16 array or a QuantizedKV) -> (values, scales) as the kernels take them."""
    if isinstance(kv, QuantizedKV):
        return kv.values, kv.scales.view(np.uint16)
    return (kv.view(np.uint16) if kv.dtype == np.float16 else kv), None


# --- reading -------------------------------------------------------------------------------------------------------
def widen(x):
    """One stored value -> float32 (the int8 value still to be multiplied by its group's scale)."""
    if isinstance(x, np.uint16):
        return np.float32(np.array(x, np.uint16).view(np.float16))
    return np.float32(x)


def dot_kv(q, t, h, k, ks, s, kvh):
    """q[t, h] . the stored K row of position s, KV head kvh (q [T, H, Dh]; k [S, KVH, Dh]) -> float32."""
    return (_dot_float if ks is None else _dot_int8)(q, t, h, k, ks, s, kvh)


def add_kv(acc, t, h, p, v, vs, s, kvh):
    """acc[t, h] += p * the stored V row of position s, KV head kvh (acc [T, H, Dh]; v [S, KVH, Dh])."""
    (_add_float if vs is None else _add_int8)(acc, t, h, p, v, vs, s, kvh)


def _dot_float(q, t, h, k, ks, s, kvh):
    a = np.float32(0.0)
    for j in range(q.shape[2]):
        a += q[t, h, j] * widen(k[s, kvh, j])
    return a


def _add_float(acc, t, h, p, v, vs, s, kvh):
    for j in range(acc.shape[2]):
        acc[t, h, j] += p * widen(v[s, kvh, j])


# int8: per group of values, the int8 values in float arithmetic and the group's scale applied once. The loops run
# from 0 over slices: with bounds like g * group .. (g + 1) * group LLVM leaves them scalar (several times slower).
def _dot_int8(q, t, h, k, ks, s, kvh):
    group = q.shape[2] // ks.shape[2]
    a = np.float32(0.0)
    for g in range(ks.shape[2]):
        q_part, k_part = q[t, h, g * group:(g + 1) * group], k[s, kvh, g * group:(g + 1) * group]   # [group]
        part = np.float32(0.0)
        for j in range(group):
            part += q_part[j] * np.float32(k_part[j])
        a += part * widen(ks[s, kvh, g])
    return a


def _add_int8(acc, t, h, p, v, vs, s, kvh):
    group = acc.shape[2] // vs.shape[2]
    for g in range(vs.shape[2]):
        pd = p * widen(vs[s, kvh, g])
        acc_part, v_part = acc[t, h, g * group:(g + 1) * group], v[s, kvh, g * group:(g + 1) * group]  # [group]
        for j in range(group):
            acc_part[j] += pd * np.float32(v_part[j])


def half_bits(x):
    """float32 -> the bits of the nearest float16 (ties to even, as numpy's astype(float16))."""
    return np.float16(x).view(np.uint16)


def first_rows(scales, n):
    """scales[:n], or None for a float format (the scales of a cache's first n positions)."""
    return None if scales is None else scales[:n]


@overload(first_rows, inline="always")
def _first_rows_typed(scales, n):
    if isinstance(scales, types.NoneType):
        return lambda scales, n: None
    return lambda scales, n: scales[:n]


@overload(widen, inline="always")
def _widen_typed(x):
    if x == types.uint16:
        return lambda x: _half_bits_to_float(x)
    return lambda x: np.float32(x)


@overload(dot_kv, inline="always")
def _dot_kv_typed(q, t, h, k, ks, s, kvh):
    return _dot_float if isinstance(ks, types.NoneType) else _dot_int8


@overload(add_kv, inline="always")
def _add_kv_typed(acc, t, h, p, v, vs, s, kvh):
    return _add_float if isinstance(vs, types.NoneType) else _add_int8


@overload(half_bits, inline="always")
def _half_bits_typed(x):
    return lambda x: _float_to_half_bits(x)


# --- writing -------------------------------------------------------------------------------------------------------
def store_row(values, scales, s, h, row):
    """Write row [Dh] float32 as position s, KV head h of values [S, KVH, Dh], rounded to the stored format."""
    if scales is not None:
        _store_int8_row(values, scales, s, h, row)
    elif values.dtype == np.uint16:
        values[s, h] = row.astype(np.float16).view(np.uint16)
    else:
        values[s, h] = row


def _store_int8_row(values, scales, s, h, row):
    """int8 with a new float16 scale per group, the arithmetic of kv_cache.quantize_int8 (scale = max|x| / 127,
    values rounded against the stored scale)."""
    group = row.shape[0] // scales.shape[-1]
    for g in range(scales.shape[-1]):
        amax = np.float32(0.0)
        for j in range(g * group, (g + 1) * group):
            amax = max(amax, abs(row[j]))
        bits = half_bits(amax / np.float32(127.0))
        scales[s, h, g] = bits
        d = widen(bits)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for j in range(g * group, (g + 1) * group):
            values[s, h, j] = np.int8(min(max(np.rint(row[j] * inv), np.float32(-127.0)), np.float32(127.0)))


@overload(store_row)
def _store_row_typed(values, scales, s, h, row):
    if not isinstance(scales, types.NoneType):
        return _store_int8_row
    if values.dtype == types.uint16:
        def store_half(values, scales, s, h, row):
            for j in range(row.shape[0]):
                values[s, h, j] = _float_to_half_bits(row[j])
        return store_half

    def store_float(values, scales, s, h, row):
        for j in range(row.shape[0]):
            values[s, h, j] = row[j]
    return store_float
