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


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 130])
@pytest.mark.parametrize("O, I", [(1, 32), (33, 64), (130, 96), (7, 1536), (5, 544)])
def test_linear_with_int8_inputs_matches_numpy(fmt, M, O, I):
    """Weights that multiply int8-rounded inputs: the integer (VNNI) kernels below TILE_MIN_ROWS rows, the tiled
    float kernels on the rounded rows above, BLAS beyond SMALL_M rows, all against ops.linear."""
    w = RNG.normal(0, 0.1, (O, I)).astype(np.float32)
    x = RNG.normal(0, 1, (M, I)).astype(np.float32)
    x[:, :3] *= 20                                                    # an outlier block, as real activations have
    qw = quant.quantize(w, fmt)
    qw.int8_inputs = True
    want = ops.linear(x, qw)
    np.testing.assert_allclose(kernels.linear(x, qw), want, atol=2e-5 * np.sqrt(I), rtol=1e-5)
    qw.int8_inputs = False                                            # and the flag is what decides
    assert np.abs(ops.linear(x, qw) - want).max() > 1e-4


@pytest.mark.parametrize("I", [1, 31, 32, 33, 100, 576])
def test_quantize_rows_rounds_exactly_as_numpy(I):
    x = RNG.normal(0, 1, (3, I)).astype(np.float32)
    x[1] = 0.0                                                        # all-zero blocks: scale 1, zeros
    x[2, : min(I, 32)] = np.arange(min(I, 32)) * 0.5                  # exact halves: ties round to even
    xq, xabs, xs = kernels.quantize_rows(x)
    want_q, want_s = quant.quantize_activations(x)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xs, want_s)
    np.testing.assert_array_equal(xabs, np.abs(want_q))
    np.testing.assert_array_equal(kernels.round_rows(x), quant.round_activations(x))


@pytest.mark.skipif(not kernels.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_integer_kernels_match_the_float_kernels_on_rounded_inputs(fmt):
    """The two implementations of int8 inputs in kernels.py agree: integer dot products (vpdpbusd) and the
    float kernels given the rounded rows (what a CPU without VNNI runs)."""
    w = RNG.normal(0, 0.1, (67, 320)).astype(np.float32)
    x = RNG.normal(0, 1, (5, 320)).astype(np.float32)
    qw = quant.quantize(w, fmt)
    got, want = np.empty((5, 67), np.float32), np.empty((5, 67), np.float32)
    xr = kernels.round_rows(x)
    if fmt == "int8":
        kernels.linear_int8_channel_vnni(qw.q, qw.scale, x, got)
        kernels.linear_int8_channel(qw.q, qw.scale, xr, want)
    elif fmt == "int8-block":
        kernels.linear_int8_block_vnni(qw.q, qw.scale, x, got)
        kernels.linear_int8_block(qw.q, qw.scale, xr, want)
    else:
        kernels.linear_q4_vnni(qw.packed, qw.d, qw.m, x, got)
        kernels.linear_q4(qw.packed, qw.d, qw.m, xr, want)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("I", [1, 5, 45, 65])
@pytest.mark.parametrize("int8_inputs", [False, True])
def test_int8_channel_odd_width_not_multiple_of_block(I, int8_inputs):
    """Per-channel int8 works for any width; with int8 inputs the last, short block is added apart."""
    w = RNG.normal(0, 0.1, (9, I)).astype(np.float32)
    qw = quant.quantize_int8_channel(w)
    qw.int8_inputs = int8_inputs
    x = RNG.normal(size=(2, I)).astype(np.float32)
    np.testing.assert_allclose(kernels.linear(x, qw), ops.linear(x, qw), atol=1e-5)


@pytest.mark.parametrize("S, H, KVH, Dh", [(1, 4, 4, 8), (5, 9, 3, 64), (37, 6, 2, 16), (300, 8, 1, 32)])
def test_decode_attention_matches_numpy(S, H, KVH, Dh):
    q = RNG.normal(size=(1, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    want = ops.attention(q, k, v, start=S - 1)                        # [1, H*Dh]: the last position sees all
    np.testing.assert_allclose(kernels.attention(q, k, v, S - 1), want, atol=1e-5)


@pytest.mark.parametrize("T, start", [(2, 0), (5, 7), (16, 40), (17, 0), (4, 300)])
@pytest.mark.parametrize("H, KVH, Dh", [(9, 3, 64), (4, 4, 8)])
def test_causal_attention_matches_numpy(T, start, H, KVH, Dh):
    """Several query tokens (a prompt chunk, a speculative verification) after `start` cached positions: up to
    FEW_TOKENS the flash-decoding kernel (with chunks that a token sees in part or not at all), more the causal
    kernel."""
    q = RNG.normal(size=(T, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    np.testing.assert_allclose(kernels.attention(q, k, v, start), ops.attention(q, k, v, start), atol=1e-5)


@pytest.mark.parametrize("T", [6, 20])
def test_causal_attention_reads_strided_views(T):
    """Without a cache the model passes k and v as column slices of the fused qkv activation."""
    H, KVH, Dh = 4, 2, 8
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


WARMUP_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
from test_model import random_model
from tinyllm import kernels, paged

def signatures():
    return {(mod.__name__, name, sig) for mod in (kernels, paged) for name, f in vars(mod).items()
            if isinstance(f, CPUDispatcher) for sig in f.signatures}

for quant in (None, "int8", "int8-block", "q4_1"):
    model = random_model("llama", context_length=64, dim=64, ffn_dim=64, quant=quant)   # warms up its kernels
    pool = paged.PagedKVCache(model.config, block_size=4, num_blocks=64)   # warms up the batched paged kernel
    before = signatures()
    for activations in ("float32", "int8") if quant else ("float32",):
        model.activations = activations
        cache = model.new_cache(64)
        model.prefill([1, 2, 3, 4, 5], cache)                       # several rows: strided q/k views
        model.decode_step(6, cache)
        model.forward([7, 8, 9], cache)                             # a verification pass after a cache
        model.logits([1, 2, 3])                                     # no cache: strided k/v views
        seqs = [pool.new_sequence() for _ in range(3)]
        model.forward_batch([[1, 2], [3], [4, 5, 6]], seqs)
        model.decode_batch([1, 2, 3], seqs)                         # the engine's batched paged step
        model.forward_batch([list(range(1, 10))] * 2, [None, None]) # tiled linears
        model.logits(list(range(1, 21)))                            # more query rows than decode_attention takes
        model.prefill(list(range(1, 21)), model.new_cache(64))
    new = signatures() - before
    assert not new, (quant, new)
"""


def test_warmup_leaves_nothing_to_compile_mid_request():
    """After warmup, prefill, decode, a no-cache pass, a batched paged step and a verification pass run only
    signatures compiled already, so no request pays for a compile. In a fresh process: signatures compiled by
    earlier tests would hide a gap."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", WARMUP_CHECK], cwd=Path(__file__).parent, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


DRAFT_WARMUP_CHECK = """
from numba.core.registry import CPUDispatcher
from test_model import random_model
from tinyllm import kernels
from tinyllm.speculative import make_draft, speculative_generate

def signatures():
    return {(name, sig) for name, f in vars(kernels).items() if isinstance(f, CPUDispatcher) for sig in f.signatures}

model = random_model("llama", context_length=64, dim=64, ffn_dim=64)        # fp32: warms the fp32 kernels only
drafts = [make_draft(model, spec) for spec in ("self-q4", "self-int8")]     # each warms its own formats
before = signatures()
for draft in drafts:
    speculative_generate(model, [1, 2, 3, 4, 5], draft, num_draft=3, max_new_tokens=12)
new = signatures() - before
assert not new, new
"""


def test_self_drafts_compile_when_built_not_mid_request():
    """A self-draft's weight formats (4-bit or int8 matrices, an 8-bit head, int8 activations) are compiled when
    make_draft builds it: a first speculative generation compiles nothing. In a fresh process, as above."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", DRAFT_WARMUP_CHECK], cwd=Path(__file__).parent, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


NO_VNNI_CHECK = """
import numpy as np
from tinyllm import kernels
from test_model import random_model
assert not kernels.HAVE_VNNI
for quant in ("int8", "int8-block", "q4_1"):
    m = random_model("llama", dim=64, ffn_dim=64, quant=quant, activations="int8")
    ids = np.random.default_rng(1).integers(0, 50, 20)
    full = m.logits(ids)                                            # [20, V], tiled float kernels on rounded rows
    cache = m.new_cache(64)
    got = [m.prefill(ids[:12], cache).reshape(-1)]
    got += [m.decode_step(int(t), cache).reshape(-1) for t in ids[12:19]]   # one row: the no-VNNI stand-ins
    np.testing.assert_allclose(np.stack(got), full[11:19], atol=1e-4)
"""


def test_int8_activations_without_vnni(tmp_path):
    """A CPU without AVX-512 VNNI (here: a portable build, NUMBA_CPU_NAME=generic) runs int8 activations through
    the float kernels on the rounded rows, in the op-by-op and in the fused path alike. In a fresh process, with
    its own kernel cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", NO_VNNI_CHECK], cwd=Path(__file__).parent, capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("quant_name", [None, "int8", "native"])
def test_backends_give_the_same_greedy_tokens(default_model_path, quant_name):
    m = tinyllm.load(default_model_path, quant=quant_name)
    prompt = "The three primary colors are"
    fast = tinyllm.generate(m, prompt, max_new_tokens=16).token_ids
    m.backend = "numpy"
    slow = tinyllm.generate(m, prompt, max_new_tokens=16).token_ids
    assert fast == slow
