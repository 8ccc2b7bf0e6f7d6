"""Compiling the kernels before the first request, on tiny inputs typed and laid out as the model passes them.

Numba compiles a kernel for each new combination of argument types on its first call, and caches the result on
disk (`cache=True`), so only the first run of a fresh install pays for it. `warmup` makes that first call happen
at load time (a new array layout mid-request would mean a compile in the middle of a generation). The attention
kernels of a float16 or int8 KV cache are compiled when such a cache is first made (model.new_cache, the paged
pool), so a model that never uses one never pays for them.
"""
from __future__ import annotations

import time

import numpy as np

from ..kv_cache import kv_storage
from ..quant import BLOCK, Int8Block, Int8Channel, Q4Block, quantize
from .block import _decode_block
from .dispatch import FEW_TOKENS, FUSED_ROWS, attention, linear, paged_attention, swiglu
from .kv_formats import kernel_operands
from .linear_kernels import TILE_MIN_ROWS, weight_arrays
from .pointwise import apply_rope, rmsnorm

FORMATS = {np.ndarray: None, Int8Channel: "int8", Int8Block: "int8-block", Q4Block: "q4_1"}
_done: set = set()


def _matrix(fmt: str | None, rows: int):
    """A [rows, 32] weight of format fmt (None: float32)."""
    w = np.ones((rows, BLOCK), np.float32)
    return w if fmt is None else quantize(w, fmt)


def _warm_decode_block(fmt: str | None, kv_dtype: str) -> None:
    H, KVH, Dh = 2, 1, BLOCK // 2                                   # so every matrix is [*, 32]: one block wide
    x, norm, trig = np.ones((1, BLOCK), np.float32), np.ones(BLOCK, np.float32), np.ones((1, Dh // 2), np.float32)
    kv = kv_storage((4, KVH, Dh), kv_dtype)                         # [S_max, KVH, Dh]
    (k, k_scales), (v, v_scales) = kernel_operands(kv), kernel_operands(kv)
    mats = [weight_arrays(_matrix(fmt, rows)) for rows in ((H + 2 * KVH) * Dh, BLOCK, 2 * BLOCK, BLOCK)]
    _decode_block(x, norm, norm, *mats, False, False, k, k_scales, v, v_scales, 0, trig, trig, H, 1e-5)


def _warm_attention(kv_dtype: str) -> None:
    """decode_attention, then causal_attention, on a cache of kv_dtype."""
    if ("attention", kv_dtype) in _done:
        return
    for T in (2, FEW_TOKENS + 1):
        kv = kv_storage((T + 1, 1, 4), kv_dtype)                    # [S, KVH, Dh]
        kv[:] = np.ones((T + 1, 1, 4), np.float32)
        attention(np.ones((T, 2, 4), np.float32), kv, kv, 1)
    _done.add(("attention", kv_dtype))


def warmup(weight_types=tuple(FORMATS), kv_dtype: str = "float32") -> float:
    """Compile (or load from Numba's cache) what a model holding these weight classes needs, with a KV cache of
    kv_dtype. -> seconds it took."""
    t0 = time.perf_counter()
    x = np.ones((1, BLOCK), dtype=np.float32)
    for t in weight_types:
        fmt = FORMATS[t]
        if t not in _done:
            for int8_inputs in (False, True) if fmt else (False,):  # either activations setting
                for rows in (1, TILE_MIN_ROWS):                     # the one-row and the tiled kernels
                    linear(np.ones((rows, BLOCK), np.float32), _matrix(fmt, 2), int8_inputs=int8_inputs)
            _done.add(t)
        if FUSED_ROWS and (t, kv_dtype) not in _done:
            _warm_decode_block(fmt, kv_dtype)
            _done.add((t, kv_dtype))
    _warm_attention(kv_dtype)
    if "ops" not in _done:
        rmsnorm(x, x[0], 1e-5)
        for T in (1, 2):            # q and k are views of the qkv rows: contiguous for one row, strided for more
            qkv = np.ones((T, 16), dtype=np.float32)
            apply_rope(qkv[:, :8].reshape(T, 2, 4), np.ones((T, 2), np.float32), np.ones((T, 2), np.float32))
        swiglu(np.ones((1, 4), np.float32))
        swiglu(np.ones((4, 4), np.float32))                        # the parallel form, for batches
        _done.add("ops")
    return time.perf_counter() - t0


def warmup_paged(kv_dtype: str = "float32") -> float:
    """Compile (or load) the batched paged-attention kernel for blocks of kv_dtype (and the other attention kernels
    of that format): PagedKVCache calls it when a pool is made, so only users of a paged pool pay for it.
    -> seconds it took (0 if done already)."""
    if ("paged", kv_dtype) in _done:
        return 0.0
    t0 = time.perf_counter()
    blocks = kv_storage((2, 2, 1, 4), kv_dtype)                     # [NB, BS, KVH, Dh]
    blocks[:] = np.ones((2, 2, 1, 4), np.float32)
    paged_attention(np.ones((2, 2, 4), np.float32), blocks, blocks, np.zeros((2, 1), np.int32), np.ones(2, np.int32))
    _warm_attention(kv_dtype)
    _done.add(("paged", kv_dtype))
    return time.perf_counter() - t0
