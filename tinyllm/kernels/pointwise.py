"""The small per-token ops (RMSNorm, RoPE, SwiGLU) as one compiled call each.

Each is microseconds of arithmetic, but a decode step runs about 150 of them: as chains of numpy calls they cost
more in call overhead than in arithmetic.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numerics import EXACT_PER_VALUE, PARALLEL, SERIAL, exp32


@njit(**SERIAL)
def rmsnorm_into(x, w, eps, out):
    """out [T, D] = each row of x scaled to unit root-mean-square, times w [D] (ops.rmsnorm)."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0.0)
        for i in range(D):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.sqrt(ss / D + np.float32(eps))
        for i in range(D):
            out[t, i] = x[t, i] * r * w[i]


@njit(**SERIAL)
def rope_into(x, cos, sin, out):
    """out [T, nh, Dh] = x rotated by its positions' angles, pair (i, i + Dh/2) (ops.apply_rope)."""
    T, nh, Dh = x.shape
    half = Dh // 2
    for t in range(T):
        for h in range(nh):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i + half] = b * cos[t, i] + a * sin[t, i]


@njit(fastmath=EXACT_PER_VALUE, cache=True, nogil=True, error_model="numpy")
def _swiglu_row(gate_up, out, t):
    F = out.shape[1]
    for i in range(F):
        g = gate_up[t, i]
        out[t, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[t, F + i]


@njit(**SERIAL)
def swiglu_into(gate_up, out):
    """out [T, F] = silu(gate) * up for gate_up [T, 2F] (ops.swiglu)."""
    for t in range(out.shape[0]):
        _swiglu_row(gate_up, out, t)


@njit(**PARALLEL)
def swiglu_rows_into(gate_up, out):
    """The same over rows in parallel, for batches and prompt chunks (F exponentials per row add up)."""
    for t in prange(out.shape[0]):
        _swiglu_row(gate_up, out, t)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Twin of ops.rmsnorm. [T, D] -> [T, D]"""
    out = np.empty_like(x)
    rmsnorm_into(x, weight, eps, out)
    return out


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Twin of ops.apply_rope (half-split pairs). x [T, nh, Dh], cos/sin [T, Dh/2] -> [T, nh, Dh]"""
    out = np.empty(x.shape, dtype=np.float32)
    rope_into(x, cos, sin, out)
    return out
