"""The Numba twins of ops.py: the same functions under the same names, with the hot loops compiled.

A model with backend="numba" runs on this package (backend.NumbaBackend); everything it calls here has a plain numpy
twin in ops.py and a parity test (tests/test_kernels.py). The files, in the order a decode step meets them:

    dispatch.py           which kernel runs for how many rows, which format, which activations (the one policy)
    weight_formats.py     the weight formats the kernels take, as named tuples (Float32Weight, Q4Weight, ...)
    linear_kernels.py     a few rows times a weight: the task split, the input rounding, fp32 and int8 weights
    dot_tiles.py          fp32 weights at 8-31 rows: tiles of dot products along a row (LLVM IR)
    q4_kernels.py         the same for 4-bit (Q4_1) weights
    kquant_kernels.py     a file's Q6_K and Q4_K super-blocks, read as the file holds them
    panel_kernels.py      a prompt chunk's linears: weight rows prepared once as panels, products in register tiles
    isa.py                which instructions they compile for: the host's, or AVX2 forced (TINYLLM_ISA=avx2)
    intdot.py             integer dot products (AVX-512 VNNI or AVX2, LLVM IR), their written contract, plain twins
    pointwise.py          RMSNorm, RoPE, SwiGLU
    attention_kernels.py  decode (flash-decoding) and paged (PagedAttention) attention
    prefill_attention.py  prompt chunks against a long cache: query blocks x key blocks, online softmax
    register_tiles.py     small matrix products, the sums held in registers (LLVM IR): prefill's attention, linears
    int8_tiles.py         a prompt chunk's quantized linears in integer register tiles (VNNI, LLVM IR)
    int8_tiles_avx2.py    the same tiles in AVX2's instructions
    kv_formats.py         the KV cache's stored formats (float32, float16, int8) as the kernels read and write them
    kv_rows.py            decode attention's inner steps on one cached row for a KV head's query heads; plain twins
    kv_rows_ir.py         the same steps in LLVM IR
    llvm_ir.py            the LLVM IR pieces the IR kernels share
    block.py              a whole Llama block of a decode step as one compiled call (one parallel region)
    spin_barrier.py       where block.py's threads wait for each other inside that region
    blas.py               the ops of a pass too long for these kernels: BLAS sgemm and numpy attention
    numerics.py           compile options, a vectorisable exp, softmax, a sum in a fixed order
    disk_cache.py         Numba's disk cache checked against all the kernels' sources, not each one's file
    warmup.py             compiling all of the above before the first request

NUMBA_DISABLE_JIT=1 runs every kernel as plain Python, to step through (slowly); the fused block is then off.
"""
from __future__ import annotations

import sys

from numba import get_num_threads, set_num_threads

from .. import ops
from . import isa  # noqa: F401  (first: TINYLLM_ISA=avx2 sets Numba's target before any kernel compiles)
from . import disk_cache

disk_cache.install()    # before any kernel is defined: cached kernels are checked against all of their sources
from . import blas  # noqa: E402
from .block import block_weights, cache_operands, decode_blocks  # noqa: E402
from .dispatch import FUSED_ROWS, PREFILL_CHUNK, SMALL_M, attention, linear, paged_attention, swiglu  # noqa: E402
from .intdot import HAVE_VNNI  # noqa: E402
from .pointwise import apply_rope, rmsnorm  # noqa: E402
from .warmup import blocks_ready, prefill_chunk, warmup, warmup_paged  # noqa: E402

layernorm, gelu_tanh, gelu = ops.layernorm, ops.gelu_tanh, ops.gelu     # not hot: the numpy functions serve

__all__ = ["linear", "rmsnorm", "layernorm", "apply_rope", "swiglu", "gelu_tanh", "gelu", "attention", "paged_attention",
           "decode_blocks", "block_weights", "cache_operands", "for_rows", "FUSED_ROWS", "PREFILL_CHUNK", "SMALL_M",
           "HAVE_VNNI", "blocks_ready", "prefill_chunk", "warmup", "warmup_paged", "get_num_threads", "set_num_threads"]


def for_rows(n_rows: int):
    """The ops a forward pass of n_rows rows (all its sequences together) runs on: this package, or past SMALL_M
    rows blas.py's, so that no pass mixes BLAS's threads with Numba's."""
    return blas if n_rows > SMALL_M else sys.modules[__name__]
