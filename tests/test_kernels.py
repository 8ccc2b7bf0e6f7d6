"""Every Numba kernel against its numpy twin, on odd shapes; and the two backends give the same tokens."""
import numpy as np
import pytest

import tinyllm
from tinyllm import kernels, ops, quant

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("fmt", ["fp32"] + list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 17, 64, 101, 130])
@pytest.mark.parametrize("O, I", [(1, 32), (33, 64), (130, 96), (7, 1536)])
def test_linear_matches_numpy(fmt, M, O, I):
    w = RNG.normal(0, 0.1, (O, I)).astype(np.float32)
    x = RNG.normal(0, 1, (M, I)).astype(np.float32)
    qw = w if fmt == "fp32" else quant.quantize(w, fmt)
    b = RNG.normal(size=O).astype(np.float32)
    want = ops.linear(x, qw, b)                                       # numpy: dequantize, then matmul
    got = kernels.linear(x, qw, b)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(I), rtol=1e-5)


def test_int8_channel_odd_width_not_multiple_of_block():
    w = RNG.normal(0, 0.1, (9, 45)).astype(np.float32)               # per-channel works for any width
    qw = quant.quantize_int8_channel(w)
    x = RNG.normal(size=(2, 45)).astype(np.float32)
    np.testing.assert_allclose(kernels.linear(x, qw), ops.linear(x, qw), atol=1e-5)


@pytest.mark.parametrize("S, H, KVH, Dh", [(1, 4, 4, 8), (5, 9, 3, 64), (37, 6, 2, 16), (300, 8, 1, 32)])
def test_decode_attention_matches_numpy(S, H, KVH, Dh):
    q = RNG.normal(size=(1, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    want = ops.attention(q, k, v, start=S - 1)                        # [1, H*Dh]: the last position sees all
    np.testing.assert_allclose(kernels.attention(q, k, v, S - 1), want, atol=1e-5)


@pytest.mark.parametrize("T, start", [(2, 0), (5, 7), (17, 0), (4, 300)])
@pytest.mark.parametrize("H, KVH, Dh", [(9, 3, 64), (4, 4, 8)])
def test_causal_attention_matches_numpy(T, start, H, KVH, Dh):
    """Several query tokens (a prompt chunk, a speculative verification) after `start` cached positions."""
    q = RNG.normal(size=(T, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    np.testing.assert_allclose(kernels.attention(q, k, v, start), ops.attention(q, k, v, start), atol=1e-5)


def test_causal_attention_reads_strided_views():
    """Without a cache the model passes k and v as column slices of the fused qkv activation."""
    T, H, KVH, Dh = 6, 4, 2, 8
    qkv = RNG.normal(size=(T, (H + 2 * KVH) * Dh)).astype(np.float32)
    q = qkv[:, :H * Dh].reshape(T, H, Dh)
    k = qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh)
    v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)
    np.testing.assert_allclose(kernels.attention(q, k, v, 0), ops.attention(q, k, v, 0), atol=1e-5)


def test_exp32_matches_the_library_exponential():
    """The vectorisable exponential the kernels use: within 3e-7 relative over float32's range, clamped outside."""
    from numba import njit

    @njit
    def apply(a, out):
        for i in range(a.size):
            out[i] = kernels.exp32(a[i])

    x = np.concatenate([np.linspace(-87, 88, 100_001), RNG.normal(0, 3, 10_000)]).astype(np.float32)
    got = np.empty_like(x)
    apply(x, got)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 3e-7
    edges = np.array([-1000.0, 1000.0], dtype=np.float32)
    apply(edges, got[:2])
    assert 0 < got[0] < 1e-37 and np.isfinite(got[1]) and got[1] > 1e38   # clamped to exp(-87), exp(88)


@pytest.mark.parametrize("T", [1, 5])
def test_small_ops_match_numpy(T):
    x = RNG.normal(size=(T, 96)).astype(np.float32)
    w = RNG.normal(size=96).astype(np.float32)
    np.testing.assert_allclose(kernels.rmsnorm(x, w, 1e-5), ops.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernels.swiglu(x), ops.swiglu(x), rtol=1e-5, atol=1e-6)
    cos, sin = ops.rope_tables(16, 40, 10000.0)
    heads = RNG.normal(size=(T, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(kernels.apply_rope(heads, cos[30:30 + T], sin[30:30 + T]),
                               ops.apply_rope(heads, cos[30:30 + T], sin[30:30 + T]), rtol=1e-5, atol=1e-6)


def test_backend_modules_offer_the_same_functions():
    names = ["linear", "rmsnorm", "layernorm", "apply_rope", "attention", "swiglu", "gelu_tanh", "softmax"]
    assert all(callable(getattr(kernels, n)) and callable(getattr(ops, n)) for n in names)


def test_warmup_compiles_each_kernel_once():
    kernels.warmup()
    t0 = __import__("time").perf_counter()
    assert kernels.warmup() < 0.01 + (__import__("time").perf_counter() - t0)   # nothing left to compile
    assert {np.ndarray, quant.Int8Channel, quant.Int8Block, quant.Q4Block, "ops"} <= kernels._warmed


@pytest.mark.slow
@pytest.mark.parametrize("quant_name", [None, "int8", "native"])
def test_backends_give_the_same_greedy_tokens(default_model_path, quant_name):
    m = tinyllm.load(default_model_path, quant=quant_name)
    prompt = "The three primary colors are"
    fast = tinyllm.generate(m, prompt, max_new_tokens=16).token_ids
    m.backend = "numpy"
    slow = tinyllm.generate(m, prompt, max_new_tokens=16).token_ids
    assert fast == slow
