"""llama.cpp's other block formats, byte by byte: the K-quants (Q2_K .. Q6_K), Q5_0 / Q5_1 and IQ4_NL / IQ4_XS.

Each function below takes a tensor's blocks as raw bytes [n_blocks, block_bytes] and returns their values
[n_blocks, values_per_block] float32, computed in ggml's order of float32 operations (ggml-quants.c,
dequantize_row_*), so the result is bit for bit what llama.cpp computes. The docstring of each spells out its block.

The K-quants group 256 values into a super-block holding one or two fp16 numbers (d, and dmin for the types with
minimums) and small integer scales per sub-block of 16 or 32 values: the sub-block's own scale is d * its integer
scale. The scales cost 4-8 bits per 16-32 values instead of a 16-bit float per 32 (Q4_1), so more of the bits go
to the values. Left out: quantizing to these formats (quant.py makes `q4_k` in memory), the IQ types that
index codebooks (IQ1/IQ2/IQ3), and writing files.
"""
from __future__ import annotations

import numpy as np

QK_K = 256  # values per K-quant super-block
# IQ4_NL's 16 levels: a non-uniform 4-bit grid (denser near zero, where weights are), shared by IQ4_XS
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 number at byte `at` of every block, widened to float32 (exactly). -> [n_blocks, 1]"""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def nibbles_split(qs: np.ndarray) -> np.ndarray:
    """[n, k, 16] bytes -> [n, k, 32] 4-bit values: low nibbles first, then high (the order of Q4_0 .. Q5_1)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def bits(field: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] little-endian bytes of a u32 -> its `count` low bits, bit j at [:, j]. -> [n, count] uint8"""
    word = field.copy().view("<u4")                                          # [n, 1]
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, count]


# --- 32-value blocks ---------------------------------------------------------------------------------------
def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0, 22 bytes for 32 values: f16 d | u32 qh | 16 bytes of nibbles.
    q_j = nibble_j | (bit j of qh) << 4, in [0, 31] (nibble order as Q4_0: value j low, j+16 high); x = (q - 16) d."""
    d = f16(blocks, 0)                                                       # [n, 1]
    q = nibbles_split(blocks[:, 6:22]) | (bits(blocks[:, 2:6], 32) << 4)     # [n, 32]
    return (q.astype(np.float32) - 16) * d


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1, 24 bytes for 32 values: f16 d | f16 m | u32 qh | 16 bytes of nibbles. q as Q5_0; x = q d + m."""
    d, m = f16(blocks, 0), f16(blocks, 2)                                    # [n, 1] each
    q = nibbles_split(blocks[:, 8:24]) | (bits(blocks[:, 4:8], 32) << 4)     # [n, 32]
    return q.astype(np.float32) * d + m


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL, 18 bytes for 32 values: f16 d | 16 bytes of nibbles (order as Q4_0). x = d * IQ4_LEVELS[nibble]."""
    return f16(blocks, 0) * IQ4_LEVELS[nibbles_split(blocks[:, 2:18])]       # [n, 32]


# --- 256-value super-blocks ----------------------------------------------------------------------------------
def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K, 84 bytes for 256 values: scales[16] | qs[64] | f16 d | f16 dmin.
    16 sub-blocks of 16: scales[s] holds the sub-block's 4-bit scale (low nibble) and 4-bit minimum (high).
    Value v = 128h + 32j + l (h < 2, j < 4, l < 32) is bits 2j..2j+1 of qs[32h + l];
    x = (d * scale) * q - (dmin * min) of sub-block v // 16."""
    n = blocks.shape[0]
    sc = blocks[:, 0:16]                                                     # [n, 16]
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)                               # [n, h, 1, l]
    q = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3                # [n, h, j, l]
    dl = f16(blocks, 80) * (sc & 0x0F)                                       # [n, 16]
    ml = f16(blocks, 82) * (sc >> 4)                                         # [n, 16]
    q = q.reshape(n, 16, 16).astype(np.float32)                              # [n, sub-block, 16]
    return (dl[..., None] * q - ml[..., None]).reshape(n, QK_K)


def q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 16 signed 6-bit scales from their 12 bytes [n, 12] -> [n, 16] float32 (whole numbers).
    Scale s: low 4 bits are nibble s // 8 of byte s % 8 (low nibble for s < 8), high 2 bits are bits
    2 (s // 4) .. +1 of byte 8 + s % 4; stored plus 32."""
    s = np.arange(16)
    low = (packed[:, s % 8] >> (4 * (s // 8))) & 0x0F                        # [n, 16]
    high = (packed[:, 8 + s % 4] >> (2 * (s // 4))) & 3                      # [n, 16]
    return (low | (high << 4)).astype(np.float32) - 32


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K, 110 bytes for 256 values: hmask[32] | qs[64] | scales[12] | f16 d.
    16 sub-blocks of 16, signed 6-bit scales (q3_k_scales). Value v = 128h + 32j + l: low 2 bits are bits 2j..2j+1
    of qs[32h + l], and bit 4h + j of hmask[l] set means "no offset": q = low - (0 if the bit is set else 4), in
    [-4, 3]; x = (d * scale) * q of sub-block v // 16."""
    n = blocks.shape[0]
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)                               # [n, h, 1, l]
    low = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3              # [n, h, j, l]
    hm = blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]      # [n, 4h + j, l]
    q = low.reshape(n, 8, 32).astype(np.int8) - 4 * (1 - (hm & 1)).astype(np.int8)   # [n, 8, 32]
    dl = f16(blocks, 108) * q3_k_scales(blocks[:, 96:108])                   # [n, 16]
    return (dl[..., None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's / Q5_K's 8 scales and 8 minimums, 6 bits each, from their 12 bytes [n, 12] -> ([n, 8], [n, 8]).
    Bytes 0-3 hold scales 0-3 and bytes 4-7 minimums 0-3 in their low 6 bits; sub-blocks 4-7 have their low
    4 bits in bytes 8-11 (scale low nibble, minimum high nibble) and their top 2 bits in the top 2 bits of
    bytes 0-3 (scales) and 4-7 (minimums)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]                # [n, 4] each
    scales = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)  # [n, 8]
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)      # [n, 8]
    return scales, mins


def k4_values(qs: np.ndarray) -> np.ndarray:
    """Q4_K's / Q5_K's 128 bytes of nibbles [n, 128] -> 256 values [n, 8, 32]: sub-blocks 2p and 2p+1 share bytes
    32p .. 32p+31, the first in the low nibbles, the second in the high."""
    qs = qs.reshape(qs.shape[0], 4, 1, 32)                                   # [n, p, 1, l]
    return ((qs >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(qs.shape[0], 8, 32)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes for 256 values: f16 d | f16 dmin | scales[12] | qs[128].
    8 sub-blocks of 32 with a 6-bit scale and a 6-bit minimum each (k4_scales), 4-bit q (k4_values);
    x = (d * scale) * q - (dmin * min)."""
    n = blocks.shape[0]
    sc, mn = k4_scales(blocks[:, 4:16])                                      # [n, 8] each
    dl, ml = f16(blocks, 0) * sc, f16(blocks, 2) * mn                        # [n, 8] each
    q = k4_values(blocks[:, 16:144]).astype(np.float32)                      # [n, 8, 32]
    return (dl[..., None] * q - ml[..., None]).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes for 256 values: f16 d | f16 dmin | scales[12] | qh[32] | qs[128].
    As Q4_K, plus a fifth bit: bit s of qh[l] is the high bit of value l of sub-block s; q in [0, 31]."""
    n = blocks.shape[0]
    sc, mn = k4_scales(blocks[:, 4:16])                                      # [n, 8] each
    dl, ml = f16(blocks, 0) * sc, f16(blocks, 2) * mn                        # [n, 8] each
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # [n, s, l]
    q = (k4_values(blocks[:, 48:176]) | (high << 4)).astype(np.float32)     # [n, 8, 32]
    return (dl[..., None] * q - ml[..., None]).reshape(n, QK_K)


def q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's 256 values of each block [n, 210] as whole numbers in [-32, 31] -> [n, 256] int8 (dequantize_q6_k)."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)                            # [n, h, 1, k % 2, l]
    low = ((ql >> np.array([0, 4], np.uint8)[:, None, None]) & 0x0F).reshape(n, 2, 4, 32)   # [n, h, k, l]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)                             # [n, h, 1, l]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3             # [n, h, k, l]
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, QK_K)


def q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's 16 sub-block scales of each block [n, 210], d * scale in float32 as ggml rounds it -> [n, 16]"""
    return f16(blocks, 208) * blocks[:, 192:208].view(np.int8)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes for 256 values: ql[128] | qh[64] | int8 scales[16] | f16 d.
    16 sub-blocks of 16 with a signed 8-bit scale each. Value v = 128h + 32k + l (h < 2, k < 4, l < 32): its low
    4 bits are nibble k // 2 (low, then high) of ql[64h + 32 (k % 2) + l], its high 2 bits are bits 2k..2k+1 of
    qh[32h + l]; q = those 6 bits - 32, in [-32, 31]; x = (d * scale) * q of sub-block v // 16."""
    n = blocks.shape[0]
    q = q6_k_values(blocks).reshape(n, 16, 16).astype(np.float32)           # [n, sub-block, 16]
    return (q6_k_scales(blocks)[..., None] * q).reshape(n, QK_K)


def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS, 136 bytes for 256 values: f16 d | u16 scales_h | scales_l[4] | qs[128].
    8 sub-blocks of 32 with a 6-bit scale each: low 4 bits are nibble s % 2 of scales_l[s // 2], high 2 bits are
    bits 2s..2s+1 of scales_h; stored plus 32. Sub-block s's values are the nibbles of qs[16s .. 16s+15] (order as
    Q4_0), mapped through IQ4_LEVELS; x = (d * (scale - 32)) * level."""
    n = blocks.shape[0]
    s = np.arange(8)
    low = (blocks[:, 4 + s // 2] >> (4 * (s % 2))) & 0x0F                    # [n, 8]
    high = (blocks[:, 2:4].copy().view("<u2") >> (2 * s)) & 3                # [n, 8]
    dl = f16(blocks, 0) * ((low | (high << 4)).astype(np.float32) - 32)      # [n, 8]
    levels = IQ4_LEVELS[nibbles_split(blocks[:, 8:136].reshape(n, 8, 16))]   # [n, 8, 32]
    return (dl[..., None] * levels).reshape(n, QK_K)


DEQUANTIZERS = {  # ggml type name -> function of the blocks
    "Q5_0": dequantize_q5_0, "Q5_1": dequantize_q5_1, "IQ4_NL": dequantize_iq4_nl, "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k, "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k,
    "IQ4_XS": dequantize_iq4_xs,
}
