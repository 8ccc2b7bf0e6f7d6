"""The weight formats the compiled kernels take: one named tuple of arrays per format, [O, I] = [rows, inputs].

    Float32Weight(w)                 w [O, I] float32
    Int8Weight(q, scale)             q [O, I] int8, scale [O] float32: W[o, i] = scale[o] * q[o, i]
    Int8BlockWeight(q, scale)        q [O, I] int8, scale [O, I/32] float32: W[o, i] = scale[o, i // 32] * q[o, i]
    Q4Weight(packed, d, mins)        packed [O, I/2] uint8 (Q4_1's nibble order: byte k of block b holds values
                                     32b+k in its low and 32b+16+k in its high 4 bits), d, mins [O, I/32] float32:
                                     W[o, i] = d[o, i // 32] * q[o, i] + mins[o, i // 32]

The names are quant.py's format names ("int8", "int8-block", "q4_1"), whose dataclasses hold the same arrays;
`kernel_weight` turns those (or a float32 array) into these. Numba compiles a named tuple as a tuple of its arrays,
with the class in its type (`instance_class`), so a kernel is specialised to the format when it compiles: Python
code asks `isinstance(w, Q4Weight)`, typing code (an @overload's typing function) `typed_as(w, Q4Weight)`.
Left out: how the formats are made and what their rounding costs (quant.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..quant import Int8Block, Int8Channel, Q4Block


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


INT8 = (Int8Weight, Int8BlockWeight)
QUANTIZED = (Int8Weight, Int8BlockWeight, Q4Weight)
_FROM_QUANT = {Int8Channel: Int8Weight, Int8Block: Int8BlockWeight, Q4Block: Q4Weight}


def kernel_weight(w) -> Float32Weight | Int8Weight | Int8BlockWeight | Q4Weight:
    """A weight (a float32 [O, I] array or a quant.QuantizedWeight) as the named tuple the compiled code takes."""
    return Float32Weight(w) if isinstance(w, np.ndarray) else _FROM_QUANT[type(w)](*w.arrays)


def typed_as(ty, formats) -> bool:
    """isinstance for typing code: whether the Numba type `ty` of a weight is one of `formats` (a class or a tuple
    of them)."""
    cls = getattr(ty, "instance_class", None)
    return cls is not None and issubclass(cls, formats)
