"""The ops of a forward pass with more rows than the Numba linears take (dispatch.SMALL_M): a long prompt, or a
batch of prompts. The linears run on numpy's BLAS sgemm, and attention in numpy too, so that BLAS's threads and
Numba's never take turns on the same cores within one pass; the small serial kernels stay.
"""
from __future__ import annotations

import numpy as np

from ..backend import NumpyOps
from ..quant import round_activations
from .pointwise import apply_rope, rmsnorm, swiglu_into

TILE_ROWS = 512           # rows of a quantized weight dequantized at a time (fits in L2)
attention, paged_attention = NumpyOps.attention, NumpyOps.paged_attention
layernorm, gelu_tanh, gelu = NumpyOps.layernorm, NumpyOps.gelu_tanh, NumpyOps.gelu
__all__ = ["linear", "rmsnorm", "layernorm", "apply_rope", "swiglu", "gelu_tanh", "gelu", "attention",
           "paged_attention"]


def linear(x: np.ndarray, w, b: np.ndarray | None = None, int8_inputs: bool = False) -> np.ndarray:
    """x [M, I] times w -> [M, O] with sgemm: on float32 weights directly, on quantized ones dequantized TILE_ROWS
    rows at a time, so no full fp32 copy of a weight is ever made."""
    if isinstance(w, np.ndarray):
        out = x @ w.T                                                       # [M, O]
    else:
        if int8_inputs:
            x = round_activations(x)                                        # [M, I] on the int8 grid
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        for r in range(0, w.shape[0], TILE_ROWS):
            out[:, r:r + TILE_ROWS] = x @ w.dequantize(slice(r, r + TILE_ROWS)).T
    return out if b is None else out + b


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, serially: next to BLAS a parallel kernel's threads would fight BLAS's. [T, 2F] -> [T, F]"""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    swiglu_into(gate_up, out)
    return out
