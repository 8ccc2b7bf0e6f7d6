"""pytest-benchmark suites for every kernel and its numpy twin (not part of the default test run).

    pytest benchmarks/ --benchmark-only --benchmark-columns=median,iqr,ops

Each benchmark records the bytes it must read in `extra_info`, so GB/s = bytes / median.
Threads are pinned to 2 for BLAS and Numba.
"""
import numpy as np
import pytest

import tinyllm
from tinyllm import kernels, ops, quant
from tinyllm.kv_cache import kv_storage

tinyllm.set_threads(min(2, __import__("os").cpu_count()))
RNG = np.random.default_rng(0)
SHAPES = {"ffn_gate_up": (3072, 576), "lm_head": (49152, 576)}


def weight(fmt, shape):
    w = RNG.normal(0, 0.05, shape).astype(np.float32)
    return w if fmt == "fp32" else quant.quantize(w, fmt)


@pytest.mark.parametrize("M", [1, 4, 8, 32, 128])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("fmt", ["fp32", "int8", "int8-block", "q4_1", "int8+a8", "int8-block+a8", "q4_1+a8"])
def test_linear_numba(benchmark, fmt, shape_name, M):
    """+a8: the weight multiplies int8-rounded inputs (activations="int8"): the integer VNNI kernels below 8 rows."""
    base, _, a8 = fmt.partition("+")
    w = weight(base, SHAPES[shape_name])
    x = RNG.normal(size=(M, w.shape[1])).astype(np.float32)
    kernels.linear(x, w, int8_inputs=bool(a8))
    nbytes = w.nbytes
    benchmark.extra_info.update(bytes=nbytes, format=fmt, M=M, vnni=bool(a8) and kernels.HAVE_VNNI and M < 8)
    benchmark(kernels.linear, x, w, int8_inputs=bool(a8))
    if benchmark.stats:                                               # None with --benchmark-disable
        benchmark.extra_info["GB/s"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("I", [576, 1536])
@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_quantize_activations(benchmark, impl, I):
    """Rounding one token's activations to int8 blocks: the extra step of every linear with int8 inputs."""
    x = RNG.normal(size=(1, I)).astype(np.float32)
    from tinyllm.kernels.linear_kernels import quantize_rows
    fn = quantize_rows if impl == "numba" else quant.quantize_activations
    fn(x)
    benchmark(fn, x)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "q4_1"])
def test_linear_numpy_twin(benchmark, fmt):
    w = weight(fmt, SHAPES["ffn_gate_up"])
    x = RNG.normal(size=(1, w.shape[1])).astype(np.float32)
    benchmark.extra_info.update(bytes=w.nbytes, format=fmt)
    benchmark(ops.linear, x, w)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("S", [256, 2048])
@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_decode_attention(benchmark, impl, S, kv_dtype):
    """One token against S cached positions stored as kv_dtype (SmolLM2's 9 heads over 3 KV heads of 64)."""
    q = RNG.normal(size=(1, 9, 64)).astype(np.float32)
    k, v = kv_storage((S, 3, 64), kv_dtype), kv_storage((S, 3, 64), kv_dtype)
    k[:], v[:] = (RNG.normal(size=(S, 3, 64)).astype(np.float32) for _ in range(2))
    fn = kernels.attention if impl == "numba" else ops.attention
    fn(q, k, v, S - 1)
    benchmark.extra_info["bytes"] = k.nbytes + v.nbytes
    benchmark(fn, q, k, v, S - 1)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_small_ops_per_token(benchmark, impl):
    """rmsnorm + rope on q and k + swiglu for one token: the per-layer glue of a decode step."""
    o = kernels if impl == "numba" else ops
    x = RNG.normal(size=(1, 576)).astype(np.float32)
    w = np.ones(576, np.float32)
    q = RNG.normal(size=(1, 9, 64)).astype(np.float32)
    cos, sin = ops.rope_tables(64, 8, 1e5)
    gu = RNG.normal(size=(1, 3072)).astype(np.float32)

    def glue():
        o.rmsnorm(x, w, 1e-5)
        o.apply_rope(q, cos[3:4], sin[3:4])
        o.apply_rope(q[:, :3], cos[3:4], sin[3:4])
        o.swiglu(gu)

    glue()
    benchmark(glue)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_causal_attention(benchmark, impl):
    """A 4-token speculative verification after 256 cached positions (several query rows, causal)."""
    T, S = 4, 260
    q = RNG.normal(size=(T, 9, 64)).astype(np.float32)
    k = RNG.normal(size=(S, 3, 64)).astype(np.float32)
    v = RNG.normal(size=(S, 3, 64)).astype(np.float32)
    fn = kernels.attention if impl == "numba" else ops.attention
    fn(q, k, v, S - T)
    benchmark.extra_info["bytes"] = k.nbytes + v.nbytes
    benchmark(fn, q, k, v, S - T)


@pytest.mark.parametrize("start", [0, 1920])
@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_prompt_chunk_attention(benchmark, impl, start):
    """A 128-token prompt chunk after `start` cached positions (prefill_attention.py; the numpy twin makes the
    whole score matrix). extra_info: the chunk's useful floating-point operations, so GFLOP/s = flops / median."""
    T, S = 128, start + 128
    q = RNG.normal(size=(T, 9, 64)).astype(np.float32)
    k = RNG.normal(size=(S, 3, 64)).astype(np.float32)
    v = RNG.normal(size=(S, 3, 64)).astype(np.float32)
    fn = kernels.attention if impl == "numba" else ops.attention
    fn(q, k, v, start)
    benchmark.extra_info["flops"] = 4 * 9 * 64 * sum(start + t + 1 for t in range(T))
    benchmark(fn, q, k, v, start)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_paged_decode_attention(benchmark, impl):
    """32 sequences x 257 positions in blocks of 16, scattered over the pool: one batched decode step's layer."""
    B, S, BS = 32, 257, 16
    nb = -(-S // BS)
    blocks = RNG.normal(size=(B * nb, BS, 3, 64)).astype(np.float32)
    tables = RNG.permutation(B * nb).astype(np.int32).reshape(B, nb)
    lens = np.full(B, S, np.int32)
    q = RNG.normal(size=(B, 9, 64)).astype(np.float32)
    fn = kernels.paged_attention if impl == "numba" else ops.paged_attention
    fn(q, blocks, blocks, tables, lens)
    benchmark.extra_info["bytes"] = 2 * B * S * 3 * 64 * 4
    benchmark(fn, q, blocks, blocks, tables, lens)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_swiglu_batch(benchmark, impl):
    """SwiGLU over 32 rows (a batched decode step): 32 x 1536 exponentials."""
    o = kernels if impl == "numba" else ops
    gu = RNG.normal(size=(32, 3072)).astype(np.float32)
    o.swiglu(gu)
    benchmark(o.swiglu, gu)
