"""The stored K/V formats as the attention kernels see them (kv_cache.py's kv_dtype): reading a value, its scale,
and writing a new row (the fused block stores its token's K/V itself).

    kv_dtype   values the kernel gets         scales
    float32    float32 [..., KVH, Dh]         None
    float16    uint16 [..., KVH, Dh]          None      (the float16 bits: Numba has no float16 type)
    int8       int8 [..., KVH, Dh]            uint16 [..., KVH, Dh/group]   (float16 bits, as Q8_0's scales)

Each helper below is specialised to its argument types when a kernel compiles, so a float32 cache compiles to the
same loops as before and the float16 / int8 variants are compiled only by a model that uses them. A float16
value is widened by one instruction (F16C's vcvtph2ps, which every x86-64 CPU with AVX2 has), in LLVM IR; without
F16C (or with TINYLLM_NO_F16C=1) by integer arithmetic that gives the same bits.
"""
from __future__ import annotations

import os
import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.extending import intrinsic, overload, register_jitable

from ..kv_cache import QuantizedKV

def _host_converts_halves() -> bool:
    """Whether LLVM may convert float16 <-> float32 in one instruction here: x86 needs F16C (every CPU with AVX2
    has it; a portable NUMBA_CPU_NAME build assumes none), other targets have it in their base set."""
    if config.CPU_NAME or os.environ.get("TINYLLM_NO_F16C", "") not in ("", "0"):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    return "+f16c" in llvm.get_host_cpu_features().flatten().split(",")


F16C = not config.DISABLE_JIT and _host_converts_halves()

if not config.DISABLE_JIT:
    from .numerics import _float32_from_bits

    @intrinsic
    def _half_bits_to_float_f16c(typingctx, bits):
        """uint16 holding a float16's bits -> that value as float32 (exact)."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def _float_to_half_bits_f16c(typingctx, x):
        """float32 -> the bits of the nearest float16 (ties to even, as numpy's astype(float16))."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    @intrinsic
    def _bits_of_float32(typingctx, x):
        """float32 -> the int32 with the same bits (a reinterpretation)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.int32(types.float32), codegen

    @njit(inline="always")
    def _half_bits_to_float_int(bits):
        """The same conversion in integer arithmetic (x86 without F16C): the exponent and mantissa bits shifted into
        a float's places and multiplied by 2^112 (127 - 15 = 112: the two exponent biases), which is exact for
        normal and subnormal halves alike; infinities and NaNs map to theirs."""
        h = np.int32(bits)
        sign = np.int32((h & 0x8000) << 16)
        rest = np.int32(h & 0x7fff)
        if rest >= 0x7c00:
            return _float32_from_bits(np.int32(sign | 0x7f800000 | ((rest & 0x3ff) << 13)))
        f = _float32_from_bits(np.int32(rest << 13)) * np.float32(2.0 ** 112)
        return _float32_from_bits(np.int32(_bits_of_float32(f) | sign))

    @njit(inline="always")
    def _float_to_half_bits_int(x):
        """float32 -> nearest float16's bits, ties to even, in integer arithmetic (x86 without F16C)."""
        b = _bits_of_float32(x)
        sign = (b >> 16) & 0x8000
        a = b & 0x7fffffff                                   # |x| as bits
        if a >= 0x47800000:                                  # >= 65536, inf, nan: beyond every finite half
            return np.uint16(sign | (0x7e00 if a > 0x7f800000 else 0x7c00))
        if a < 0x38800000:                                   # below 2^-14: a subnormal half. Adding 0.5, whose ulp is
            # 2^-24 (the subnormal step), rounds |x| to that step in hardware; the float's low bits are the count
            return np.uint16(sign | (_bits_of_float32(_float32_from_bits(a) + np.float32(0.5)) - 0x3f000000))
        # rebias the exponent, then round the 13 dropped mantissa bits to nearest, ties to even (a carry into the
        # exponent is right, up to 65520 -> inf)
        return np.uint16(sign | ((a - 0x38000000 + 0xfff + ((a >> 13) & 1)) >> 13))

    _half_bits_to_float = _half_bits_to_float_f16c if F16C else _half_bits_to_float_int
    _float_to_half_bits = _float_to_half_bits_f16c if F16C else _float_to_half_bits_int


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


def kv_value(k, ks, s, kvh, j):
    """The stored value k[s, kvh, j] as float32 (an int8 value times its group's scale)."""
    x = widen(k[s, kvh, j])
    return x if ks is None else x * widen(ks[s, kvh, j // (k.shape[2] // ks.shape[2])])


@register_jitable
def int8_levels(x, group, scale):
    """A q row x [Dh] as attention over an int8 cache uses it (kv_cache.query_for): -> (x in int8 levels of
    max|group| / 127 per group of `group` values, as float32 integers [Dh]; per group the factor, that step times
    `scale`, which takes a sum of levels times values back to a scaled score [Dh / group])."""
    levels = np.empty_like(x)
    factors = np.empty(x.shape[0] // group, np.float32)
    for b in range(factors.shape[0]):
        amax = np.float32(np.max(np.abs(x[b * group:(b + 1) * group])))
        step = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        for j in range(b * group, (b + 1) * group):
            levels[j] = np.rint(x[j] * step)
        factors[b] = amax * (scale * np.float32(1.0 / 127.0))
    return levels, factors


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


@overload(kv_value, inline="always")
def _kv_value_typed(k, ks, s, kvh, j):
    if isinstance(ks, types.NoneType):
        return lambda k, ks, s, kvh, j: widen(k[s, kvh, j])
    return lambda k, ks, s, kvh, j: np.float32(k[s, kvh, j]) * widen(ks[s, kvh, j // (k.shape[2] // ks.shape[2])])


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
