"""The engine's math, as small pure numpy functions: float32 arrays in, float32 arrays out.

Every function is a few lines to step through in a debugger; kernels/ has a compiled twin of each hot one, under
the same name, and tests/test_kernels.py checks that they agree. Shape names are defined in config.py.
Left out on purpose: caches, quantized formats and dispatch. A quantized weight or a K/V cache in a stored format
(float16, int8) is made float32 by its owner before these functions see it (backend.NumpyOps does that).
"""
from __future__ import annotations

import math

import numpy as np


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T (+ b). `w` is [out, in] (PyTorch's layout), so each output is one row of w dotted with x."""
    y = x @ w.T                                         # [T, in] @ [in, out] -> [T, out]
    return y if b is None else y + b


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Llama's norm: scale each row to unit root-mean-square, then by a learned per-channel weight."""
    ms = np.mean(x * x, axis=-1, keepdims=True)         # [T, 1]
    return x * (1.0 / np.sqrt(ms + eps)) * weight       # [T, D]


def layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """GPT-2's norm: subtract the row mean, divide by the row std, then scale and shift (MPT's: no shift)."""
    mu = np.mean(x, axis=-1, keepdims=True)             # [T, 1]
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)      # [T, 1]
    y = xc / np.sqrt(var + eps) * weight                # [T, D]
    return y if bias is None else y + bias


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """Llama's gated MLP activation: silu(gate) * up, for gate and up side by side. [T, 2F] -> [T, F]"""
    F = gate_up.shape[-1] // 2
    return silu(gate_up[:, :F]) * gate_up[:, F:]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU (the tanh approximation, 'gelu_new' in transformers)."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


_erf = np.vectorize(math.erf, otypes=[np.float64])     # numpy has no erf; math's is exact to double precision


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (gpt-neox's 'gelu'; not a hot path)."""
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x) / sum(exp(x)), shifted by the max so exp never overflows."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rope_tables(head_dim: int, n_positions: int, theta: float,
                freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle: position p, pair i rotates by p * theta^(-2i/Dh) / freq_factors[i].

    freq_factors [Dh/2] (Llama 3.x: `llama3_rope_factors`, or the GGUF's `rope_freqs` tensor) slow the
    low-frequency pairs down so that positions past the training length stay in range; None: all 1.
    Computed in float64 and rounded once, so long positions keep their precision. -> two [P, Dh/2] arrays.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # [Dh/2]
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)           # [Dh/2]
    angles = np.outer(np.arange(n_positions, dtype=np.float64), inv_freq)           # [P, Dh/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as per-pair divisors of the frequency. -> [Dh/2] float32

    Pairs whose wavelength is shorter than original_context / high_freq_factor keep their frequency (1), those
    longer than original_context / low_freq_factor turn `factor` times slower, and those between blend the two.
    (The same numbers llama.cpp's converter writes as the `rope_freqs` tensor.)
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # [Dh/2]
    wavelen = 2 * np.pi / inv_freq                                                   # [Dh/2] positions per turn
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, blended))
    return out.astype(np.float32)


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al. 2022): head h adds slope_h * (key position - query position) to its
    scores, a penalty growing with distance, steep for the first heads and gentle for the last.

    For n heads, n a power of two: slope_h = 2^(-max_bias * (h+1) / n). Otherwise the first m heads (m the power of
    two below n) take the slopes of m heads, the others every other slope of 2m heads, from the first: as llama.cpp's
    ggml_soft_max_ext (max_bias) and transformers' Falcon and MPT compute them (tests/test_families.py). -> [H]
    """
    m = 2 ** math.floor(math.log2(n_heads))                                     # the power of two at or below
    h = np.arange(n_heads, dtype=np.float64)                                    # [H]
    exponent = np.where(h < m, (h + 1) / m, (2 * (h - m) + 1) / (2 * m))        # [H]
    return (2.0 ** (-max_bias * exponent)).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each head's vector by its position's angles (RoPE, Su et al. 2021), half-split convention.

    Dimension i is paired with i + Dh/2 (Hugging Face's `rotate_half` layout; GGUF files store q/k rows
    permuted for adjacent pairs, and weights.py un-permutes them so one convention holds everywhere).
    x: [T, nh, Dh]; cos, sin: [T, Dh/2] for the tokens' positions.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]               # [T, nh, Dh/2] each
    c, s = cos[:, None, :], sin[:, None, :]              # [T, 1, Dh/2]: the same angle for every head
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)   # [T, nh, Dh]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
              slopes: np.ndarray | None = None) -> np.ndarray:
    """Causal scaled dot-product attention with grouped-query heads.

    q: [T, H, Dh] for positions start .. start+T-1; k, v: [S, KVH, Dh] for positions 0 .. S-1 (S = start + T).
    GQA: query head h reads KV head h // G. Reshaping q to [KVH, G, T, Dh] lets one matmul per KV head serve
    its G query heads; K and V are never copied or repeated. slopes [H] (ALiBi families, alibi_slopes): head h's
    scores get slopes[h] * (key position - query position) added. -> [T, H*Dh]
    """
    T, H, Dh = q.shape
    S, KVH, _ = k.shape
    G = H // KVH
    qg = q.reshape(T, KVH, G, Dh).transpose(1, 2, 0, 3)            # [KVH, G, T, Dh]
    kt = k.transpose(1, 2, 0)[:, None]                             # [KVH, 1, Dh, S]
    scores = (qg @ kt) * np.float32(1.0 / np.sqrt(Dh))             # [KVH, G, T, S]
    # causal mask: query at position start+t may see keys at positions <= start+t
    q_pos = start + np.arange(T)[:, None]                          # [T, 1]
    visible = np.arange(S)[None, :] <= q_pos                       # [T, S]
    if slopes is not None:                                         # ALiBi: farther keys score lower
        distance = (np.arange(S)[None, :] - q_pos).astype(np.float32)   # [T, S], <= 0 where visible
        scores = scores + slopes.reshape(KVH, G, 1, 1) * distance      # [KVH, G, T, S]
    scores = np.where(visible, scores, np.float32(-np.inf))
    probs = softmax(scores, axis=-1)                               # [KVH, G, T, S]
    out = probs @ v.transpose(1, 0, 2)[:, None]                    # [KVH, G, T, Dh]
    return out.transpose(2, 0, 1, 3).reshape(T, H * Dh)            # [T, H*Dh]


def paged_attention(q: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, attend=attention) -> np.ndarray:
    """Attention of B one-token queries, each against its own sequence in a paged KV pool (paged.py).

    q [B, H, Dh]; k_blocks, v_blocks [NB, BS, KVH, Dh]: one layer of the pool; block_tables [B, max blocks]: the
    physical block of each sequence's logical blocks; context_lens [B]: positions to attend, the new one included.
    Each sequence's positions are gathered through its table (position p lives at offset p % BS of block
    table[p // BS]), then `attend` (plain attention; a stored format's owner passes its own) does the last
    position. -> [B, H*Dh]
    """
    B, H, Dh = q.shape
    BS = k_blocks.shape[1]
    out = np.empty((B, H * Dh), dtype=np.float32)
    for b in range(B):
        S = int(context_lens[b])
        pos = np.arange(S)                                                         # [S]
        blocks, offsets = block_tables[b, pos // BS], pos % BS                     # [S], [S]
        k, v = k_blocks[blocks, offsets], v_blocks[blocks, offsets]                # [S, KVH, Dh] each
        out[b] = attend(q[b:b + 1], k, v, S - 1)[0]                                # [H*Dh]
    return out

