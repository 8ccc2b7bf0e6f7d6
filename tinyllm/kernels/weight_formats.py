"""The weight formats the compiled kernels take: one named tuple of arrays per format, [O, I] = [rows, inputs].

    Float32Weight(w)                 w [O, I] float32
    Int8Weight(q, scale)             q [O, I] int8, scale [O] float32: W[o, i] = scale[o] * q[o, i]
    Int8BlockWeight(q, scale)        q [O, I] int8, scale [O, I/32] float32: W[o, i] = scale[o, i // 32] * q[o, i]
    Q4Weight(packed, d, mins)        packed [O, I/2] uint8 (Q4_1's nibble order: byte k of block b holds values
                                     32b+k in its low and 32b+16+k in its high 4 bits), d, mins [O, I/32] float32:
                                     W[o, i] = d[o, i // 32] * q[o, i] + mins[o, i // 32]
    Q5Weight(packed, d, high)        packed as Q4Weight's, d [O, I/32] float32, high [O, I/32] uint32 (Q5_0's
                                     fifth bits, bit j for value j of the block): W[o, i] = d[o, i // 32] *
                                     (q[o, i] + 16 * bit i % 32 of high[o, i // 32] - 16)
    Q4KWeight(packed, scales, mins,  packed as Q4Weight's, scales, mins [O, I/32] uint8 (6-bit), d, dmin [O, I/256
              d, dmin)               rounded up] float32 (Q4_K's super-blocks of 8 blocks): W[o, i] = d[o, i // 256]
                                     * scales[o, i // 32] * q[o, i] - dmin[o, i // 256] * mins[o, i // 32]
    Q6KWeight(low, high, scales, d)  low [O, I/2], high [O, I/4] uint8 (Q6_K's 4 + 2 bits of each value q, in
                                     ggml's places: quant.Q6KBlock), scales [O, I/16] int8, d [O, I/256] float32:
                                     W[o, i] = d[o, i // 256] * scales[o, i // 16] * (q[o, i] - 32)

The names are quant.py's format names ("int8", "int8-block", "q4_1"), whose dataclasses hold the same arrays;
`kernel_weight` turns those (or a float32 array) into these: a "q4_k" weight (quant.Q4KBlock) as a Q4KWeight, a
file's Q5_0 (quant.Q5Block) as a Q5Weight, its Q6_K (quant.Q6KBlock) as a Q6KWeight. Numba compiles a named tuple as a tuple of its arrays,
with the class in its type (`instance_class`), so a kernel is specialised to the format when it compiles: Python
code asks `isinstance(w, Q4Weight)`, typing code (an @overload's typing function) `typed_as(w, Q4Weight)`.
The fused decode block (block.py) is handed plain tuples, `tuple(w)`, and names them itself (`named`): Numba's
dispatcher types an exact tuple of arrays in C but a named tuple in Python, microseconds a weight, and a decode step
calls the block once per layer with four weights each. (A parallel region must receive its weights named: naming
one inside a `prange` function fails in Numba's parfor lowering.)
Left out: how the formats are made and what their rounding costs (quant.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import overload

from ..quant import Int8Block, Int8Channel, Q4Block, Q4KBlock, Q5Block, Q6KBlock


class Float32Weight(NamedTuple):
    w: np.ndarray           # [O, I] float32


class Int8Weight(NamedTuple):
    q: np.ndarray           # [O, I] int8
    scale: np.ndarray       # [O] float32, one per row


class Int8BlockWeight(NamedTuple):
    q: np.ndarray           # [O, I] int8
    scale: np.ndarray       # [O, I/32] float32, one per block of 32 values


class Q4Weight(NamedTuple):
    packed: np.ndarray      # [O, I/2] uint8, two 4-bit values a byte
    d: np.ndarray           # [O, I/32] float32 scale per block
    mins: np.ndarray        # [O, I/32] float32 minimum per block


class Q5Weight(NamedTuple):
    packed: np.ndarray      # [O, I/2] uint8, the low 4 bits of two values a byte
    d: np.ndarray           # [O, I/32] float32 scale per block
    high: np.ndarray        # [O, I/32] uint32, the fifth bits of a block's 32 values


class Q4KWeight(NamedTuple):
    packed: np.ndarray      # [O, I/2] uint8, two 4-bit values a byte
    scales: np.ndarray      # [O, I/32] uint8 in [0, 63], a block's scale in units of its super-block's d
    mins: np.ndarray        # [O, I/32] uint8 in [0, 63], a block's minimum in units of dmin
    d: np.ndarray           # [O, I/256 rounded up] float32, one per super-block of 8 blocks
    dmin: np.ndarray        # [O, I/256 rounded up] float32


class Q6KWeight(NamedTuple):
    low: np.ndarray         # [O, I/2] uint8, the low 4 bits of two values a byte
    high: np.ndarray        # [O, I/4] uint8, the high 2 bits of four values a byte
    scales: np.ndarray      # [O, I/16] int8, one per 16 values, in units of d
    d: np.ndarray           # [O, I/256] float32, one per super-block of 256 values


INT8 = (Int8Weight, Int8BlockWeight)
QUANTIZED = (Int8Weight, Int8BlockWeight, Q4Weight, Q4KWeight, Q5Weight, Q6KWeight)
_FROM_QUANT = {Int8Channel: Int8Weight, Int8Block: Int8BlockWeight, Q4Block: Q4Weight, Q4KBlock: Q4KWeight,
               Q5Block: Q5Weight, Q6KBlock: Q6KWeight}


def kernel_weight(w) -> Float32Weight | Int8Weight | Int8BlockWeight | Q4Weight | Q4KWeight | Q5Weight | Q6KWeight:
    """A weight (a float32 [O, I] array or a quant.QuantizedWeight) as the named tuple the compiled code takes."""
    if isinstance(w, np.ndarray):
        return Float32Weight(w)
    return _FROM_QUANT[type(w)](*w.arrays)


def named(w):
    """A weight as its named tuple: as it is if it is one, else the plain tuple of its arrays read by their types
    (the first array's dtype, and for int8 whether the scales are per row or per block)."""
    if isinstance(w, (Float32Weight,) + QUANTIZED):
        return w
    return _format_of(len(w), w[0].dtype, w[-1].dtype, w[-1].ndim)(*w)


def _format_of(n_arrays: int, dtype, last_dtype, scale_ndim: int):
    """The format of a plain tuple of weight arrays, by its first array's dtype, then for uint8 values their count
    (five arrays: Q4_K's, four: Q6_K's) or the last array's dtype (Q5_0's fifth bits, or Q4_1's minimums), for int8
    values the rank of the scales (per row, per block of 32)."""
    name = str(dtype)
    if name == "float32":
        return Float32Weight
    if name == "uint8":
        if n_arrays != 3:
            return Q4KWeight if n_arrays == 5 else Q6KWeight
        return Q5Weight if str(last_dtype) == "uint32" else Q4Weight
    if name == "int8":
        return {1: Int8Weight, 2: Int8BlockWeight}[scale_ndim]
    raise TypeError(f"no weight format has {name} values")


@overload(named)
def _named_typed(w):
    if isinstance(w, types.BaseNamedTuple):
        return lambda w: w
    first, last = w[0], w[len(w) - 1]
    cls = _format_of(len(w), first.dtype, last.dtype, last.ndim)
    if cls is Float32Weight:
        return lambda w: Float32Weight(w[0])
    if cls is Q4Weight:
        return lambda w: Q4Weight(w[0], w[1], w[2])
    if cls is Q5Weight:
        return lambda w: Q5Weight(w[0], w[1], w[2])
    if cls is Q4KWeight:
        return lambda w: Q4KWeight(w[0], w[1], w[2], w[3], w[4])
    if cls is Q6KWeight:
        return lambda w: Q6KWeight(w[0], w[1], w[2], w[3])
    return lambda w: cls(w[0], w[1])


def typed_as(ty, formats) -> bool:
    """isinstance for typing code: whether the Numba type `ty` of a weight is one of `formats` (a class or a tuple
    of them)."""
    cls = getattr(ty, "instance_class", None)
    return cls is not None and issubclass(cls, formats)
