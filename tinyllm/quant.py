"""Quantized weights: fewer bytes per weight, so a memory-bound decode step reads less and runs faster.

Three formats, each a small dataclass that `linear` dispatches on (the one seam; see ops.linear and
kernels.linear). Norms and the KV cache stay float32; only the big matrices shrink.

    format        stores (per row of I values)                              bytes/value  x = ...
    int8          q int8[I], one fp32 scale per row                         ~1.0         scale * q
    int8-block    q int8[I], one fp32 scale per block of 32 (like Q8_0)     ~1.125       scale[b] * q
    q4_1          4-bit q in [0, 15] packed two per byte, fp32 scale d and  ~0.75        d[b] * q + m[b]
                  minimum m per block of 32 (llama.cpp's Q4_1 layout)

Rounding is to nearest (not truncation); an all-zero row or block gets scale 1 so it still decodes to zeros.
The default model's file already holds Q4_1 matrices and a Q8_0 embedding: `from_gguf_block` repacks those
bytes without loss, so tinyllm can run on the file's own 4-bit weights.

Optionally the input of a quantized linear is rounded too, as llama.cpp always does: each row of activations to
int8 with one scale per block of 32 values (Q8_0's scheme, `quantize_activations`; a setting of the model's
forward pass, `tinyllm.load(..., activations="int8")`, passed to every linear as `int8_inputs`). Then every
product of the dot product is an integer product, and on a CPU with AVX-512 VNNI one instruction does 64 of them
(two with AVX2: kernels/intdot.py): converting each int8 weight to float32 costs more than reading it from memory, so without
this a quantized decode step is bound by arithmetic, not by the bytes it reads. The rounding is part of the
arithmetic on every path (numpy, Numba, BLAS), but it turns differences of 1e-7 between paths into whole
rounding steps now and then, so the numpy and Numba backends no longer give bit-for-bit the same tokens. benchmarks/quality.py measures what it costs.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

BLOCK = 32
FORMATS = ("int8", "int8-block", "q4_1")


class QuantizedWeight:
    """Base: a quantized [O, I] matrix. Subclasses know how to dequantize and how to be concatenated."""

    shape: tuple[int, int]

    def dequantize(self, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        raise NotImplementedError

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The stored arrays in field order (the compiled kernels take them as kernels/weight_formats.py's tuples)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def take_rows(self, idx: np.ndarray) -> "QuantizedWeight":
        """The same rows in another order (rows are quantized independently, so this is exact)."""
        return type(self)(*(a[idx] for a in self.arrays))

    @classmethod
    def concat_rows(cls, parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack matrices of the same type and width on top of each other (fusing q/k/v or gate/up)."""
        return cls(*(np.concatenate(arrays) for arrays in zip(*(p.arrays for p in parts))))

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, {self.nbytes / 2**20:.2f} MiB)"


@dataclass(repr=False)
class Int8Channel(QuantizedWeight):
    q: np.ndarray       # [O, I] int8
    scale: np.ndarray   # [O] float32

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, rows=slice(None)):
        return self.q[rows].astype(np.float32) * self.scale[rows, None]              # [o, I]


@dataclass(repr=False)
class Int8Block(QuantizedWeight):
    q: np.ndarray       # [O, I] int8
    scale: np.ndarray   # [O, I/32] float32

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, rows=slice(None)):
        q = self.q[rows]
        blocks = q.reshape(q.shape[0], -1, BLOCK).astype(np.float32)                # [o, I/32, 32]
        return (blocks * self.scale[rows, :, None]).reshape(q.shape)                 # [o, I]


@dataclass(repr=False)
class Q4Block(QuantizedWeight):
    packed: np.ndarray  # [O, I/2] uint8: block b is bytes 16b..16b+15; value j = low nibble of byte j,
    #                     value j+16 = high nibble (GGUF's Q4_1 order)
    d: np.ndarray       # [O, I/32] float32 scale
    m: np.ndarray       # [O, I/32] float32 minimum

    @property
    def shape(self):
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, rows=slice(None)):
        p = self.packed[rows]
        nib = p.reshape(p.shape[0], -1, BLOCK // 2)                                  # [o, I/32, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.float32)      # [o, I/32, 32]
        return (q * self.d[rows, :, None] + self.m[rows, :, None]).reshape(p.shape[0], -1)   # [o, I]


# --- activations ---------------------------------------------------------------------------------------------
def quantize_activations(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Round each row of x [M, I] to int8 with one scale per block of 32 values: -> (xq [M, I] int8,
    xs [M, ceil(I/32)] float32), x ~= xq * xs. Symmetric, scale = max|block| / 127, round to nearest (half to
    even); an all-zero block gets scale 1. A last block shorter than 32 (I not a multiple) has its own scale."""
    x = np.asarray(x, dtype=np.float32)
    M, I = x.shape
    nb = -(-I // block)
    padded = np.zeros((M, nb * block), dtype=np.float32)
    padded[:, :I] = x                                                                # zeros change no max
    b = padded.reshape(M, nb, block)                                                 # [M, nb, 32]
    amax = np.abs(b).max(axis=2)                                                     # [M, nb]
    xs = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    xq = np.clip(np.rint(b / xs[..., None]), -127, 127).astype(np.int8)              # [M, nb, 32]
    return xq.reshape(M, -1)[:, :I], xs


def round_activations(x: np.ndarray) -> np.ndarray:
    """x [M, I] -> the float32 values quantize_activations stands for: what a quantized linear multiplies."""
    xq, xs = quantize_activations(x)
    I = xq.shape[1]
    return (xq.astype(np.float32) * np.repeat(xs, BLOCK, axis=1)[:, :I]).astype(np.float32)   # [M, I]


# --- quantizers ----------------------------------------------------------------------------------------------
def _check(w: np.ndarray, block: int | None) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"can only quantize 2-D weight matrices, got shape {w.shape}")
    if block is not None and w.shape[1] % block:
        raise ValueError(f"block size {block} does not divide the row length {w.shape[1]}; "
                         f"use per-channel int8 for this matrix")
    return w


def quantize_int8_channel(w: np.ndarray) -> Int8Channel:
    """Symmetric int8 with one scale per output row: scale = max|row| / 127, q = round(w / scale)."""
    w = _check(w, None)
    amax = np.abs(w).max(axis=1)                                                     # [O]
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)             # [O, I]
    return Int8Channel(q, scale)


def quantize_int8_block(w: np.ndarray, block: int = BLOCK) -> Int8Block:
    """Symmetric int8 with one scale per block of 32 values along the row (Q8_0's scheme)."""
    if block != BLOCK:
        raise ValueError(f"int8-block uses blocks of {BLOCK} values, got block={block}")
    w = _check(w, block)
    b = w.reshape(w.shape[0], -1, block)                                             # [O, I/32, 32]
    amax = np.abs(b).max(axis=2)                                                     # [O, I/32]
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(b / scale[..., None]), -127, 127).astype(np.int8)
    return Int8Block(q.reshape(w.shape), scale)


def quantize_q4_1(w: np.ndarray, block: int = BLOCK) -> Q4Block:
    """Asymmetric 4-bit per block of 32: m = block min, d = (max - min) / 15, q = round((w - m) / d)."""
    if block != BLOCK:
        raise ValueError(f"q4_1 uses blocks of {BLOCK} values, got block={block}")
    w = _check(w, block)
    b = w.reshape(w.shape[0], -1, block)                                             # [O, I/32, 32]
    lo, hi = b.min(axis=2), b.max(axis=2)                                            # [O, I/32]
    d = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((b - lo[..., None]) / d[..., None]), 0, 15).astype(np.uint8)   # [O, I/32, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)                                        # [O, I/32, 16]
    return Q4Block(packed.reshape(w.shape[0], -1), d, lo.astype(np.float32))


QUANTIZERS = {"int8": quantize_int8_channel, "int8-block": quantize_int8_block, "q4_1": quantize_q4_1}


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
    if fmt not in QUANTIZERS:
        raise ValueError(f"unknown quantization format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return QUANTIZERS[fmt](w)


def quantization_error(w: np.ndarray, qw: QuantizedWeight) -> tuple[float, float]:
    """(max absolute error, RMS error) of the quantized matrix against the original."""
    err = qw.dequantize() - w
    return float(np.abs(err).max()), float(np.sqrt(np.mean(err * err)))


def from_gguf_block(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Repack a GGUF Q4_1 or Q8_0 tensor's bytes into planar arrays, exactly (f16 scales widen to f32)."""
    O, I = shape
    if type_name == "Q4_1":
        blocks = raw.reshape(O, I // BLOCK, 20)                                      # [O, I/32, 20 bytes]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)     # [O, I/32]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return Q4Block(np.ascontiguousarray(blocks[..., 4:]).reshape(O, I // 2), d, m)
    if type_name == "Q8_0":
        blocks = raw.reshape(O, I // BLOCK, 34)                                      # [O, I/32, 34 bytes]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(O, I)
        return Int8Block(q, d)
    raise ValueError(f"GGUF type {type_name} has no native tinyllm format (native: Q4_1, Q8_0)")
