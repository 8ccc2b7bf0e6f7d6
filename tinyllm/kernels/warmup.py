"""Compiling the kernels before the first request, on tiny inputs typed and laid out as the model passes them.

Numba compiles a kernel for each new combination of argument types on its first call, and caches the result on
disk (`cache=True`), so only the first run of a fresh install pays for it. `warmup` makes that first call happen
at load time (a new array layout mid-request would mean a compile in the middle of a generation).
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from ..quant import BLOCK, Int8Block, Int8Channel, Q4Block, quantize
from . import intdot
from .block import BLOCKS
from .dispatch import FEW_TOKENS, FUSED_ROWS, attention, linear, paged_attention, swiglu
from .linear_kernels import TILE_MIN_ROWS, weight_arrays
from .pointwise import apply_rope, rmsnorm

FORMATS = {np.ndarray: None, Int8Channel: "int8", Int8Block: "int8-block", Q4Block: "q4_1"}
NOTICE_AFTER_S = 1.0    # loading every kernel from the cache takes well under this; compiling takes seconds
_done: set = set()


def _matrix(fmt: str | None, rows: int):
    """A [rows, 32] weight of format fmt (None: float32)."""
    w = np.ones((rows, BLOCK), np.float32)
    return w if fmt is None else quantize(w, fmt)


def _warm_decode_block(fmt: str | None, int8_inputs: bool) -> None:
    H, KVH, Dh = 2, 1, BLOCK // 2                                   # so every matrix is [*, 32]: one block wide
    x, norm, trig = np.ones((1, BLOCK), np.float32), np.ones(BLOCK, np.float32), np.ones((1, Dh // 2), np.float32)
    kv = np.zeros((4, KVH, Dh), np.float32)                         # [S_max, KVH, Dh]
    mats = [weight_arrays(_matrix(fmt, rows)) for rows in ((H + 2 * KVH) * Dh, BLOCK, 2 * BLOCK, BLOCK)]
    BLOCKS[int8_inputs](x, norm, norm, *mats, intdot.USE_VNNI, kv, kv, 0, trig, trig, H, 1e-5)


def warmup(matrix_types=tuple(FORMATS), head_types=(), int8_inputs: bool = False, fused: bool = True) -> float:
    """Compile (or load from Numba's cache) what a model needs, and nothing else, so that a first run compiles only
    its own format: for its blocks' weight classes (`matrix_types`) the one-row and the tiled linears and (if
    `fused`) the one-call block; for its output head's class (`head_types`) the one-row linear (the head sees one
    row per sequence: its tiled kernel waits for batches, warmup_paged); all for its activations setting
    (int8_inputs); attention and the small ops. -> seconds it took."""
    t0 = time.perf_counter()
    with compile_notice(t0):
        for t in {*matrix_types, *head_types}:
            fmt = FORMATS[t]
            a8 = int8_inputs and fmt is not None                     # int8 activations meet quantized weights only
            batches = t in matrix_types or "paged" in _done
            for rows in (1, TILE_MIN_ROWS) if batches else (1,):    # the one-row and the tiled kernels
                if (t, a8, rows) not in _done:
                    linear(np.ones((rows, BLOCK), np.float32), _matrix(fmt, 2), int8_inputs=a8)
                    _done.add((t, a8, rows))
            if fused and FUSED_ROWS and t in matrix_types and (t, a8, "block") not in _done:
                _warm_decode_block(fmt, a8)
                _done.add((t, a8, "block"))
        if "ops" not in _done:
            x = np.ones((1, BLOCK), dtype=np.float32)
            for T in (2, FEW_TOKENS + 1):                           # decode_attention, then tiled_causal_attention
                kv = np.ones((T + 1, 1, 4), dtype=np.float32)
                attention(np.ones((T, 2, 4), np.float32), kv, kv, 1)
            rmsnorm(x, x[0], 1e-5)
            for T in (1, 2):        # q and k are views of the qkv rows: contiguous for one row, strided for more
                qkv = np.ones((T, 16), dtype=np.float32)
                apply_rope(qkv[:, :8].reshape(T, 2, 4), np.ones((T, 2), np.float32), np.ones((T, 2), np.float32))
            swiglu(np.ones((1, 4), np.float32))
            swiglu(np.ones((4, 4), np.float32))                    # the parallel form, for batches
            _done.add("ops")
    return time.perf_counter() - t0


@contextmanager
def compile_notice(t0: float, after: float = NOTICE_AFTER_S):
    """Say on stderr that kernels are being compiled when loading them takes longer than `after` seconds (a first
    run: the cache is empty or stale), and how long it took at the end. A warm start prints nothing."""
    shown = threading.Event()

    def notice():
        shown.set()
        print("tinyllm: compiling the Numba kernels for this model (first run only; they are cached on disk) ...",
              file=sys.stderr, flush=True)
    timer = threading.Timer(after, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"tinyllm: kernels compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def warmup_paged() -> float:
    """Compile (or load) what batches need: the paged-attention kernel and the tiled linears of output heads
    warmed so far for one row only. PagedKVCache calls it when a pool is made, so only users of a paged pool pay
    for it. -> seconds it took (0 if done already)."""
    one_row_only = [(t, a8) for t, a8, rows in [d for d in _done if len(d) == 3 and d[2] == 1]
                    if (t, a8, TILE_MIN_ROWS) not in _done]
    if "paged" in _done and not one_row_only:
        return 0.0
    t0 = time.perf_counter()
    blocks = np.ones((2, 2, 1, 4), dtype=np.float32)                # [NB, BS, KVH, Dh]
    with compile_notice(t0):
        paged_attention(np.ones((2, 2, 4), np.float32), blocks, blocks, np.zeros((2, 1), np.int32),
                        np.ones(2, np.int32))
        for t, a8 in one_row_only:                                  # a head's tiled kernel: a batch's logits
            linear(np.ones((TILE_MIN_ROWS, BLOCK), np.float32), _matrix(FORMATS[t], 2), int8_inputs=a8)
            _done.add((t, a8, TILE_MIN_ROWS))
    _done.add("paged")
    return time.perf_counter() - t0
