"""Quantized weights: fewer bytes per weight, so a memory-bound decode step reads less and runs faster.

Three formats, each a small dataclass that `linear` dispatches on (the one seam; see ops.linear and
kernels.linear). Norms and the KV cache stay float32; only the big matrices shrink.

    format        stores (per row of I values)                              bytes/value  x = ...
    int8          q int8[I], one fp32 scale per row                         ~1.0         scale * q
    int8-block    q int8[I], one fp32 scale per block of 32 (like Q8_0)     ~1.125       scale[b] * q
    q4_1          4-bit q in [0, 15] packed two per byte, fp32 scale d and  ~0.75        d[b] * q + m[b]
                  minimum m per block of 32 (llama.cpp's Q4_1 layout)
    q4_k          4-bit q as q4_1; per block of 32 a 6-bit scale s and     ~0.6         d s[b] q - dmin m[b]
                  6-bit minimum m, per super-block of 8 blocks an fp16 d
                  and dmin (llama.cpp's Q4_K, the 4-bit type of Q4_K_M files)

Rounding is to nearest (not truncation); an all-zero row or block gets scale 1 so it still decodes to zeros.
The default model's file already holds Q4_1 matrices and a Q8_0 embedding: `from_gguf_block` repacks those
bytes (and a Q4_K_M file's Q4_K, Q5_0 and Q6_K ones) without loss, so tinyllm can run on the file's own 4-bit weights.

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

from .kquants import f16, k4_scales, k4_values

BLOCK = 32
SUPER = 8   # q4_k: blocks of 32 per super-block (256 values, as ggml's QK_K)
FORMATS = ("int8", "int8-block", "q4_1", "q4_k")


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


@dataclass(repr=False)
class Q4KBlock(QuantizedWeight):
    """llama.cpp's Q4_K: 4-bit values as Q4_1's, but the scale and the minimum of each block of 32 are 6-bit
    integers, multiples of two fp16 numbers d and dmin shared by a super-block of 8 blocks (256 values). 4.5 + 1.5
    bits of scales per 32 values, not Q4_1's 32: the same 4-bit values in 0.59 bytes per weight instead of 0.75.
    The Numba kernels read it as it is (kernels/kquant_kernels.py)."""

    packed: np.ndarray  # [O, I/2] uint8, Q4_1's nibble order within each block of 32
    scales: np.ndarray  # [O, I/32] uint8 in [0, 63]: block b's scale is d[b // 8] * scales[b]
    mins: np.ndarray    # [O, I/32] uint8 in [0, 63]: block b's minimum is -dmin[b // 8] * mins[b]
    d: np.ndarray       # [O, ceil(I/256)] float32 (fp16 values); a last super-block may have fewer than 8 blocks
    dmin: np.ndarray    # [O, ceil(I/256)] float32 (fp16 values)

    @property
    def shape(self):
        return self.packed.shape[0], self.packed.shape[1] * 2

    def block_scales(self, rows=slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(scale, minimum to subtract) of every block of 32, in float32 as ggml computes them. -> [o, I/32] each"""
        sup = np.arange(self.scales.shape[1]) // SUPER                               # [I/32] super-block of a block
        return self.d[rows][:, sup] * self.scales[rows], self.dmin[rows][:, sup] * self.mins[rows]

    def dequantize(self, rows=slice(None)):
        scale, minimum = self.block_scales(rows)                                     # [o, I/32] each
        p = self.packed[rows]
        nib = p.reshape(p.shape[0], -1, BLOCK // 2)                                  # [o, I/32, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.float32)      # [o, I/32, 32]
        return (scale[..., None] * q - minimum[..., None]).reshape(p.shape[0], -1)   # [o, I]

    @functools.cached_property
    def as_q4_1(self) -> Q4Block:
        """The same values as a Q4Block (the nibbles shared, a float32 scale and minimum per block): exact, since
        d * q + (-m) rounds as d * q - m."""
        scale, minimum = self.block_scales()
        return Q4Block(self.packed, scale, -minimum)


@dataclass(repr=False)
class Q6KBlock(QuantizedWeight):
    """llama.cpp's Q6_K (the 6-bit type of Q4_K_M files: some ffn_down, and the output head of models without a tied
    one) as the file holds it, made planar: W = d * scale * (q - 32), q in [0, 63], per super-block of 256 values
    one fp16 d (widened to float32), per 16 values an 8-bit scale. Within a super-block each half of 128 values
    has 64 bytes of low 4 bits and 32 bytes of high 2 bits: byte l of the low ones holds values l (low nibble) and
    l + 64 (high), byte l + 32 values l + 32 and l + 96; bits 2k, 2k+1 of high byte l belong to value l + 32k. Those
    are ggml's places, chosen so that a vector of 32 bytes yields 32 values with one shift and one mask each
    (kernels/kquant_kernels.py). 0.83 bytes a weight (the file: 0.82)."""

    low: np.ndarray     # [O, I/2] uint8: the low 4 bits of each value, as above
    high: np.ndarray    # [O, I/4] uint8: the high 2 bits, four values a byte
    scales: np.ndarray  # [O, I/16] int8: each 16 values' scale, in units of d
    d: np.ndarray       # [O, I/256] float32 (fp16 values)

    @property
    def shape(self):
        return self.low.shape[0], self.low.shape[1] * 2

    def values(self, rows=slice(None)) -> np.ndarray:
        """q - 32, whole numbers in [-32, 31]. -> [o, I] int8"""
        low, high = self.low[rows], self.high[rows]
        o = low.shape[0]
        halves = low.reshape(o, -1, 2, 64)                                               # [o, I/256, 2, 64]
        a, b = halves[..., :32], halves[..., 32:]                                         # [o, I/256, 2, 32]
        h = high.reshape(o, -1, 2, 32)                                                    # [o, I/256, 2, 32]
        q = np.concatenate([(a & 15) | (h & 3) << 4, (b & 15) | (h >> 2 & 3) << 4,       # values 0-31, 32-63,
                            a >> 4 | (h >> 4 & 3) << 4, b >> 4 | (h >> 6) << 4], axis=-1)  # 64-95, 96-127
        return (q.astype(np.int8) - np.int8(32)).reshape(o, -1)

    def sub_block_scales(self, rows=slice(None)) -> np.ndarray:
        """d * scale of each 16 values, in float32 as ggml computes it. -> [o, I/16]"""
        scales = self.scales[rows]
        return (self.d[rows][:, :, None] * scales.reshape(scales.shape[0], -1, 16)).reshape(scales.shape)

    def dequantize(self, rows=slice(None)):
        q = self.values(rows)
        groups = q.reshape(q.shape[0], -1, 16).astype(np.float32)                         # [o, I/16, 16]
        return (self.sub_block_scales(rows)[..., None] * groups).reshape(q.shape)          # [o, I]


@dataclass(repr=False)
class Q5Block(QuantizedWeight):
    """llama.cpp's Q5_0 (most matrices of a Q4_K_M file whose rows are not whole super-blocks) as the file holds it:
    5-bit values q in [0, 31], W = d * (q - 16), with q's low 4 bits packed as Q4_1's and its fifth bits one uint32
    per block of 32 (bit j: value j). 0.75 bytes a weight (the fp16 d widened to float32), the file's 0.69."""

    packed: np.ndarray  # [O, I/2] uint8: the low 4 bits, Q4_1's nibble order within each block of 32
    d: np.ndarray       # [O, I/32] float32 (fp16 values)
    high: np.ndarray    # [O, I/32] uint32: bit j is the fifth bit of the block's value j

    @property
    def shape(self):
        return self.packed.shape[0], self.packed.shape[1] * 2

    def values(self, rows=slice(None)) -> np.ndarray:
        """q - 16, whole numbers in [-16, 15]. -> [o, I] int8"""
        p = self.packed[rows]
        nib = p.reshape(p.shape[0], -1, BLOCK // 2)                                  # [o, I/32, 16]
        fifth = (self.high[rows][..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1   # [o, I/32, 32]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1) | (fifth.astype(np.uint8) << 4)
        return (q.astype(np.int8) - np.int8(16)).reshape(p.shape[0], -1)

    def dequantize(self, rows=slice(None)):
        q = self.values(rows)
        blocks = q.reshape(q.shape[0], -1, BLOCK).astype(np.float32)                # [o, I/32, 32]
        return (blocks * self.d[rows, :, None]).reshape(q.shape)                     # [o, I]

    def as_int8_block(self) -> Int8Block:
        """The same values as an Int8Block, exactly (to fuse with a Q8_0 matrix: a Q4_K_M file's v beside q, k)."""
        return Int8Block(self.values(), self.d)


def same_format(parts: list) -> list:
    """Matrices to be stacked into one, in one format where that is exact: Q5Block parts beside Int8Block ones as
    int8 blocks. Other mixes as float32."""
    kinds = {type(p) for p in parts}
    if kinds == {Q5Block, Int8Block}:
        return [p.as_int8_block() if isinstance(p, Q5Block) else p for p in parts]
    if len(kinds) > 1:
        return [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    return parts


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


def quantize_q4_k(w: np.ndarray, block: int = BLOCK) -> Q4KBlock:
    """llama.cpp's Q4_K scheme (quantize_row_q4_K_ref in ggml-quants.c), in three steps:
      1. each block of 32 gets the scale s and minimum m (x ~ s * q - m, q in [0, 15]) of `fit_scale_and_min`;
      2. each super-block of 8 blocks stores d = max s / 63 and dmin = max m / 63 as fp16, and each block
         round(s / d) and round(m / dmin), 6 bits each;
      3. the values are rounded against those stored scales: q = round((x + dmin * m6) / (d * s6)), in [0, 15].
    Unlike ggml, a row need not be a multiple of 256 long (the default model's rows are 576): the last
    super-block may hold fewer than 8 blocks."""
    if block != BLOCK:
        raise ValueError(f"q4_k uses blocks of {BLOCK} values, got block={block}")
    w = _check(w, block)
    O, I = w.shape
    x = w.reshape(O, I // BLOCK, BLOCK)                                              # [O, B, 32]
    scale, minimum = fit_scale_and_min(x)                                            # [O, B] each
    nb, ns = I // BLOCK, -(-I // (BLOCK * SUPER))
    sup = np.arange(nb) // SUPER                                                     # [B] super-block of a block
    stored = []
    for value in (scale, minimum):                                                   # step 2, for both
        padded = np.pad(value, ((0, 0), (0, ns * SUPER - nb)))                       # [O, S * 8] (values >= 0)
        top = padded.reshape(O, ns, SUPER).max(axis=-1)                              # [O, S] largest of each
        unit = (top / 63).astype(np.float16).astype(np.float32)                      # [O, S] d or dmin
        with np.errstate(divide="ignore", invalid="ignore"):
            six = np.where(top[:, sup] > 0, np.rint(value * (63 / top)[:, sup]), 0)  # [O, B]
        stored += [unit, np.clip(six, 0, 63).astype(np.uint8)]
    d, scales, dmin, mins = stored
    s, m = d[:, sup] * scales, dmin[:, sup] * mins                                   # [O, B] as dequantized
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s[..., None] > 0, np.rint((x + m[..., None]) / s[..., None]), 0)   # step 3, [O, B, 32]
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)                                        # [O, B, 16]
    return Q4KBlock(packed.reshape(O, -1), scales, mins, d, dmin)


def fit_scale_and_min(x: np.ndarray, nmax: int = 15, steps: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """For each row of x [..., n] a scale s >= 0 and minimum m >= 0 with x ~ s * q - m, q = round((x + m) / s) in
    [0, nmax], by ggml's make_qkx2_quants: the error is weighted by |x| + rms(x) (large values matter more);
    it tries the grids of (nmax - 1 + 0.1 k) steps, k = 0 .. steps, from min(x, 0) to max(x), and for the q each
    grid gives, the least-squares s and m (the minimum kept at or below 0), keeping the fit with the least error.
    -> (s, m) [...] float32"""
    wts = np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + np.abs(x)               # [..., n]
    lo, hi = np.minimum(x.min(axis=-1), 0), x.max(axis=-1)                           # [...]
    span = np.where(hi > lo, hi - lo, 1).astype(np.float32)
    sw, sx = wts.sum(axis=-1), (wts * x).sum(axis=-1)                                # [...]

    def grid(iscale):
        return np.clip(np.rint(iscale[..., None] * (x - lo[..., None])), 0, nmax)   # [..., n]

    def error(s, m, q):
        return (wts * (s[..., None] * q + m[..., None] - x) ** 2).sum(axis=-1)      # [...]

    best_s, best_m = span / nmax, lo                                                 # the plain min-max grid
    best_err = error(best_s, best_m, grid(nmax / span))
    for k in range(steps + 1):
        q = grid((nmax - 1 + 0.1 * k) / span)                                        # [..., n]
        sl, sl2, sxl = (wts * q).sum(axis=-1), (wts * q * q).sum(axis=-1), (wts * q * x).sum(axis=-1)
        det = sw * sl2 - sl * sl                                                     # [...]
        with np.errstate(divide="ignore", invalid="ignore"):
            s, m = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det           # weighted least squares
            s, m = np.where(m > 0, sxl / sl2, s), np.minimum(m, 0)                   # a minimum above 0: s alone
            err = error(s, m, q)
        better = (det > 0) & (err < best_err)
        best_s, best_m, best_err = np.where(better, s, best_s), np.where(better, m, best_m), np.where(better, err,
                                                                                                         best_err)
    return np.where(hi > lo, np.maximum(best_s, 0), 0).astype(np.float32), (-best_m).astype(np.float32)


QUANTIZERS = {"int8": quantize_int8_channel, "int8-block": quantize_int8_block, "q4_1": quantize_q4_1,
              "q4_k": quantize_q4_k}


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
    if fmt not in QUANTIZERS:
        raise ValueError(f"unknown quantization format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return QUANTIZERS[fmt](w)


def quantization_error(w: np.ndarray, qw: QuantizedWeight) -> tuple[float, float]:
    """(max absolute error, RMS error) of the quantized matrix against the original."""
    err = qw.dequantize() - w
    return float(np.abs(err).max()), float(np.sqrt(np.mean(err * err)))


def from_gguf_block(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Repack a GGUF Q4_1, Q8_0, Q5_0, Q4_K or Q6_K tensor's bytes into planar arrays, exactly (f16 scales widen to f32).
    Q5_0 as a Q5Block: its bytes as they are, but planar."""
    O, I = shape
    if type_name == "Q4_K":
        blocks = raw.reshape(-1, 144)                                                # [O * I/256, 144 bytes]
        scales, mins = k4_scales(blocks[:, 4:16])                                    # [O * I/256, 8] each
        q = k4_values(blocks[:, 16:]).reshape(O, I // BLOCK, BLOCK)                  # [O, I/32, 32]
        packed = q[..., :16] | (q[..., 16:] << 4)                                    # [O, I/32, 16]: Q4_1's order
        d, dmin = f16(blocks, 0).reshape(O, -1), f16(blocks, 2).reshape(O, -1)       # [O, I/256] each
        return Q4KBlock(packed.reshape(O, I // 2), scales.reshape(O, -1), mins.reshape(O, -1), d, dmin)
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
    if type_name == "Q6_K":
        blocks = raw.reshape(O, -1, 210)                                             # [O, I/256, 210 bytes]
        part = lambda a, b: np.ascontiguousarray(blocks[..., a:b]).reshape(O, -1)   # noqa: E731
        return Q6KBlock(part(0, 128), part(128, 192), part(192, 208).view(np.int8),
                        f16(blocks.reshape(-1, 210), 208).reshape(O, -1))
    if type_name == "Q5_0":
        blocks = raw.reshape(-1, 22)                                                 # [O * I/32, 22 bytes]
        high = blocks[:, 2:6].copy().view("<u4").astype(np.uint32)                   # [O * I/32, 1]
        return Q5Block(np.ascontiguousarray(blocks[:, 6:22]).reshape(O, I // 2), f16(blocks, 0).reshape(O, -1),
                       high.reshape(O, -1))
    raise ValueError(f"GGUF type {type_name} has no native tinyllm format (native: {', '.join(NATIVE_TYPES)})")


NATIVE_TYPES = ("Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")   # the GGUF types from_gguf_block repacks
