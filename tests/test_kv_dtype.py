"""The KV cache in float16 and int8 (kv_dtype): the rounding, the kernels against their numpy twins on each stored
format, and the model invariants for every format (paged == contiguous, fused block == op by op, forks and
speculative rollback, nothing leaks), plus the plumbing and its errors. The last test runs the real model."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from tinyllm import kernels, kv_cache, ops
from tinyllm.backend import NumpyOps
from tinyllm.engine import Engine
from tinyllm.kv_cache import KV_DTYPES, QuantizedKV, as_float32, int8_group, kv_storage, quantize_int8
from tinyllm.paged import PagedKVCache
from tinyllm.sampling import SamplingParams
from tinyllm.speculative import speculative_generate
from test_model import random_model
from test_paged import _greedy as greedy
from tiny_gguf import tiny_llama

ROUNDED = ("float16", "int8")


def stored(rng, shape, kv_dtype, scale=1.0):
    """Random K or V of `shape` in kv_dtype, and the float32 values attention must see (the rounded ones)."""
    kv = kv_storage(shape, kv_dtype)
    kv[:] = (rng.normal(size=shape) * scale).astype(np.float32)
    return kv, as_float32(kv)


# --- formats ----------------------------------------------------------------------------------------------------
def test_bytes_per_token_of_each_format():
    config = random_model("llama").config                           # L 2, KVH 2, Dh 8
    assert [config.kv_bytes_per_token(d) for d in KV_DTYPES] == [2 * 2 * 2 * 8 * b for b in (4, 2)] + [
        2 * 2 * 2 * (8 + 2)]                          # int8: 8 values + a float16 scale (one per head: 32 > Dh)
    smol = tinyllm.config.ModelConfig("llama", 49152, 576, 30, 9, 3, 1536, 8192)
    assert [smol.kv_bytes_per_token(d) for d in KV_DTYPES] == [46_080, 23_040, 12_240]
    for d in KV_DTYPES:                 # what the caches reserve is what they report (no kernels: sizes only)
        cache = kv_cache.ContiguousKVCache(config, 10, d)
        assert cache.nbytes == 10 * cache.bytes_per_token == 10 * config.kv_bytes_per_token(d)
        pool = PagedKVCache(config, block_size=4, memory="64KiB", kv_dtype=d)
        assert pool.nbytes == pool.num_blocks * pool.block_bytes <= 64 * 1024 < (pool.num_blocks + 1) * pool.block_bytes


def test_int8_rounding_is_within_half_a_step_and_keeps_zeros():
    rng = np.random.default_rng(19)
    x = rng.normal(size=(50, 3, 64)).astype(np.float32) * np.logspace(-3, 2, 50)[:, None, None].astype(np.float32)
    x[7] = 0.0                                                     # an all-zero head: scale 0, values 0
    q, scales = quantize_int8(x, 64)
    assert q.dtype == np.int8 and scales.shape == (50, 3, 1) and np.abs(q).max() == 127
    scales = scales.astype(np.float32)                             # stored as float16
    back = q * scales                                              # [50, 3, 64]
    assert np.all(np.abs(back - x) <= scales * 0.5 * (1 + 1e-5) + 1e-30)
    assert np.all(back[7] == 0) and np.all(scales[7] == 0)
    kv = QuantizedKV.zeros((50, 3, 64), 32)                        # per 32 values: two scales per head
    kv[:] = x
    assert kv.scales.shape == (50, 3, 2) and np.abs(kv.dequantize() - x).max() <= np.abs(back - x).max()


def test_unknown_kv_dtype_is_a_one_line_error():
    model = random_model("llama")
    for make in (lambda: model.new_cache(8, "bfloat16"),
                 lambda: PagedKVCache(model.config, num_blocks=2, kv_dtype="fp8"),
                 lambda: Engine(model, num_blocks=4, kv_dtype="int4"),
                 lambda: model.config.kv_bytes_per_token("half")):
        with pytest.raises(ValueError, match=r"^unknown kv_dtype .*; choose one of: float32, float16, int8$"):
            make()


def test_float16_conversions_without_f16c_give_numpys_bits():
    """The integer-arithmetic fallbacks (x86 without F16C): every half -> float, and float -> nearest half (ties
    to even at every midpoint, overflow to inf, subnormals) equal numpy's, bit for bit."""
    from numba import njit
    from tinyllm.kernels import kv_formats
    to_float, to_half = kv_formats._half_bits_to_float_int, kv_formats._float_to_half_bits_int

    @njit
    def both(bits, x, floats, halves):
        for i in range(bits.shape[0]):
            floats[i] = to_float(bits[i])
        for i in range(x.shape[0]):
            halves[i] = to_half(x[i])

    bits = np.arange(2**16).astype(np.uint16)
    halves = bits.view(np.float16).astype(np.float32)                 # every half, as float32
    finite = np.unique(halves[np.isfinite(halves)])
    rng = np.random.default_rng(19)
    x = np.concatenate([finite, (finite[:-1] + finite[1:]) / 2,      # every half and every midpoint between two
                        rng.normal(size=10_000).astype(np.float32) * np.float32(1e-6),
                        np.array([65519.99, 65520, 1e9, np.inf, -np.inf], np.float32)]).astype(np.float32)
    floats, got = np.empty(bits.size, np.float32), np.empty(x.size, np.uint16)
    both(bits, x, floats, got)
    nan = np.isnan(halves)
    np.testing.assert_array_equal(floats[~nan].view(np.uint32), halves[~nan].view(np.uint32))
    assert np.isnan(floats[nan]).all()
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("f16c, vnni", [(True, True), (False, False)])
@pytest.mark.parametrize("head_dim, H, group", [(64, 6, 32)] + [pytest.param(*shape, marks=pytest.mark.slow) for shape in
                                                [(128, 6, 32), (64, 14, 32), (48, 6, 16), (40, 4, 40), (64, 6, 64)]])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rows_in_llvm_ir_equal_the_plain_loops(kv_dtype, head_dim, H, group, f16c, vnni, monkeypatch):
    """kv_rows' score_rows / add_rows in LLVM IR (float16 by F16C or by integer arithmetic; an int8 cache's q . k
    by VNNI or by 16-bit products) compute what their plain loops compute: head sizes 64 and 128 written out (3
    and 7 query heads per KV head), other head sizes and int8 groups on the generic path; passes that start
    anywhere; sums added to what acc held. Code compiled for one shape (head size 64, int8 groups of 32) fills NaN
    for rows of another: loudly wrong."""
    from numba import njit
    from tinyllm.kernels import kv_formats, kv_rows
    if f16c and not kv_formats.F16C or vnni and not kernels.HAVE_VNNI:
        pytest.skip("this CPU has no F16C / AVX-512 VNNI")
    monkeypatch.setattr(kv_cache, "INT8_GROUP", group)
    fast, plain = kv_rows.row_intrinsics(f16c, vnni), (njit(kv_rows.score_rows_reference),
                                                       njit(kv_rows.add_rows_reference))

    def passes(score_rows, add_rows):
        @njit
        def run(q, k, ks, p, scores, acc, rows):             # positions 3.. in two passes
            G = q.shape[1] // k.shape[1]
            for kvh in range(k.shape[1]):
                for first, n in ((3, 15), (18, k.shape[0] - 18)):
                    score_rows(q, 0, kvh * G, G, k, ks, first, n, kvh, np.float32(0.5), scores, first - 3, rows)
                    add_rows(acc, 0, kvh * G, G, p, first - 3, n, k, ks, first, kvh, rows)
        return run

    rng = np.random.default_rng(5)
    stored_kv, _ = stored(rng, (40, 2, head_dim), kv_dtype, 3.0)
    k, ks = kv_formats.kernel_operands(stored_kv)
    q = rng.normal(size=(1, H, head_dim)).astype(np.float32)
    p = rng.random((1, H, 37)).astype(np.float32)
    results = []
    for score_rows, add_rows in (fast, plain):
        scores, acc = np.zeros((1, H, 37), np.float32), np.ones((1, H, head_dim), np.float32)
        passes(score_rows, add_rows)(q, k, ks, p, scores, acc, kv_rows.row_shape_of(k, ks, H // 2))
        results.append((scores, acc))
    (got_scores, got_acc), (want_scores, want_acc) = results
    assert np.abs(want_scores).max() > 1.0 and np.abs(want_acc).max() > 1.0       # not a comparison of zeros
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_acc, want_acc, rtol=1e-5, atol=1e-4)

    @njit
    def other_shape(q, k, ks, p, scores, acc):              # compiled for head size 64, 2 heads per KV head
        score_rows(q, 0, 0, 2, k, ks, 0, 5, 0, np.float32(0.5), scores, 0, (0.0, 0.0, 0.0, 0.0, 0, 0))
        add_rows(acc, 0, 0, 2, p, 0, 5, k, ks, 0, 0, (0.0, 0.0, 0.0, 0.0, 0, 0))
    score_rows, add_rows = fast
    scores, acc = np.zeros((1, H, 37), np.float32), np.zeros((1, H, head_dim), np.float32)
    other_shape(q, k, ks, p, scores, acc)
    written_out = kv_rows.row_shape_of(k, ks, 2) == (0.0, 0.0, 0.0, 0.0, 0, 0)   # the rows are what it was compiled for
    assert written_out == (head_dim == 64 and (ks is None or group == 32))
    assert np.isnan(scores[0, :2, :5]).all() != written_out and np.isnan(acc[0, :2]).all() != written_out
    assert not np.isnan(scores[0, 2:]).any()                 # only the two heads it was asked for


def test_int8_attention_rounds_q_to_int8_blocks_in_every_twin():
    """Over an int8 cache q is rounded to int8 blocks (kv_cache.query_for, numpy) exactly as the compiled code's
    int8_levels does it, each value within half a level (max|group| / 254) of q; float caches leave q alone."""
    from tinyllm.kernels.kv_formats import int8_levels
    rng = np.random.default_rng(3)
    q = (rng.normal(size=(2, 3, 64)) * rng.uniform(0.01, 30, size=(2, 3, 1))).astype(np.float32)
    q[1, 2, :32] = 0.0                                           # a group of zeros: levels 0, no division by 0
    rounded = kv_cache.query_for("int8", q)
    for t in range(2):
        for h in range(3):
            levels, factors = int8_levels(q[t, h], 32, np.float32(1.0))
            assert np.all(levels == np.round(levels)) and np.abs(levels).max() <= 127
            np.testing.assert_allclose(rounded[t, h], levels * np.repeat(factors, 32), rtol=1e-6, atol=0)
    half_level = np.repeat(np.abs(q.reshape(2, 3, 2, 32)).max(-1) / 254, 32, axis=-1).reshape(q.shape)
    assert np.all(np.abs(rounded - q) <= half_level * 1.0001) and not np.array_equal(rounded, q)
    assert not rounded[1, 2, :32].any()
    for kv_dtype in ("float32", "float16"):
        assert kv_cache.query_for(kv_dtype, q) is q


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("vnni", [True, False])
def test_int8_scores_of_a_nan_q_are_nan(head_dim, vnni):
    """A NaN in q gives its head NaN scores over an int8 cache (written out: head size 64, by VNNI or not; and the
    generic path), as float arithmetic would: the rounding to int8 does not hide it. The other heads are finite."""
    from numba import njit
    from tinyllm.kernels import kv_formats, kv_rows
    if vnni and not kernels.HAVE_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI")
    score_rows, _ = kv_rows.row_intrinsics(kv_formats.F16C, vnni)

    @njit
    def run(q, k, ks, scores, shape):
        score_rows(q, 0, 0, 3, k, ks, 0, k.shape[0], 0, np.float32(0.125), scores, 0, shape)
    rng = np.random.default_rng(4)
    k, ks = kv_formats.kernel_operands(stored(rng, (9, 1, head_dim), "int8")[0])
    q = rng.normal(size=(1, 3, head_dim)).astype(np.float32)
    q[0, 1, 5] = np.nan
    scores = np.zeros((1, 3, 9), np.float32)
    run(q, k, ks, scores, kv_rows.row_shape_of(k, ks, 3))
    assert np.isnan(scores[0, 1]).all() and np.isfinite(scores[0, [0, 2]]).all()


@pytest.mark.parametrize("head_dim, kv_dtype", [(64, "float32"), (48, "float32"), (48, "int8")] + [
    pytest.param(h, d, marks=pytest.mark.slow) for h, d in [(48, "float16"), (64, "float16"), (64, "int8")] + [
        (128, d) for d in KV_DTYPES]])
def test_decode_attention_on_each_head_size(kv_dtype, head_dim):
    """The decode and paged kernels equal numpy attention (which dequantizes the stored format itself, and over
    int8 rounds q as the kernels do) for head sizes kv_rows writes out (64, 128) and one it does not (48: its
    generic path), on every stored format."""
    rng = np.random.default_rng(11)
    H, KVH, T, start = 6, 2, 3, 70
    q = rng.normal(size=(T, H, head_dim)).astype(np.float32)
    k, v = (stored(rng, (start + T, KVH, head_dim), kv_dtype)[0] for _ in range(2))
    np.testing.assert_allclose(kernels.attention(q, k, v, start), NumpyOps.attention(q, k, v, start), atol=2e-6)
    NB, BS = 10, 8
    kb, vb = (stored(rng, (NB, BS, KVH, head_dim), kv_dtype)[0] for _ in range(2))
    lens, tables = np.array([5, 30], np.int32), np.array([[7, 0, 0, 0], [2, 9, 4, 1]], np.int32)
    qb = q[:2]
    np.testing.assert_allclose(kernels.paged_attention(qb, kb, vb, tables, lens),
                               NumpyOps.paged_attention(qb, kb, vb, tables, lens), atol=2e-6)


# --- kernels == numpy twins on each stored format ----------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ROUNDED)
@pytest.mark.parametrize("T, start", [(1, 40), (4, 7), (17, 3), (20, 200), (1, 600), (3, 1200)])
def test_attention_kernels_read_the_stored_format(kv_dtype, T, start):
    """decode (T <= FEW_TOKENS; one task up to 64 positions, up to 16 on both threads past it) and causal attention
    on float16 / int8 K and V equal numpy attention on their dequantized values (over int8 with q rounded to int8
    blocks as attention uses it: kv_cache.query_for)."""
    rng = np.random.default_rng(19)
    H, KVH, Dh = 9, 3, 64
    q = rng.normal(size=(T, H, Dh)).astype(np.float32)
    (k, k32), (v, v32) = stored(rng, (start + T, KVH, Dh), kv_dtype, 3.0), stored(rng, (start + T, KVH, Dh), kv_dtype)
    want = ops.attention(kv_cache.query_for(kv_dtype, q), k32, v32, start)
    np.testing.assert_allclose(NumpyOps.attention(q, k, v, start), want, atol=1e-6)    # the twin dequantizes itself
    np.testing.assert_allclose(kernels.attention(q, k, v, start), want, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", ROUNDED)
def test_paged_kernel_reads_the_stored_format(kv_dtype):
    rng = np.random.default_rng(19)
    NB, BS, KVH, H, Dh = 12, 4, 2, 6, 32
    (kb, kb32), (vb, vb32) = stored(rng, (NB, BS, KVH, Dh), kv_dtype), stored(rng, (NB, BS, KVH, Dh), kv_dtype)
    lens = np.array([1, 7, 13], dtype=np.int32)
    tables = np.array([[5, 0, 0, 0], [3, 9, 0, 0], [11, 2, 7, 1]], dtype=np.int32)
    q = rng.normal(size=(3, H, Dh)).astype(np.float32)
    want = ops.paged_attention(kv_cache.query_for(kv_dtype, q), kb32, vb32, tables, lens)
    np.testing.assert_allclose(NumpyOps.paged_attention(q, kb, vb, tables, lens), want, atol=1e-6)
    np.testing.assert_allclose(kernels.paged_attention(q, kb, vb, tables, lens), want, atol=2e-5)


# --- the model on every format ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ROUNDED)
def test_fused_block_stores_what_the_op_by_op_path_stores(kv_dtype):
    """The fused decode block rounds K/V itself (kernels/kv_formats.py): the same stored values (int8 scales to
    the last bit of a division), hence the same logits, as the op-by-op path storing through numpy."""
    rng = np.random.default_rng(19)
    m = random_model("llama", dim=64, ffn_dim=64)
    ids = rng.integers(0, 50, 30)
    chunks = [ids[:5], ids[5:6], ids[6:9], ids[9:25], ids[25:26]]
    logits, caches = {}, {}
    for fused in (False, True):
        m.fused_decode = fused
        caches[fused] = m.new_cache(30, kv_dtype)
        logits[fused] = np.concatenate([m.forward(c, caches[fused]) for c in chunks])
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-4)
    for name in ("k", "v"):
        a, b = getattr(caches[True], name)[:, :26], getattr(caches[False], name)[:, :26]
        if kv_dtype == "int8":
            np.testing.assert_array_equal(a.values, b.values)
            np.testing.assert_allclose(a.scales, b.scales, rtol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_paged_equals_contiguous_for_each_format(kv_dtype, backend):
    rng = np.random.default_rng(19)
    model = random_model("llama", context_length=64)
    model.backend = backend
    prompt = list(rng.integers(0, 50, 11))
    ref, ref_logits = greedy(model, prompt, 20, model.new_cache(64, kv_dtype))
    pool = PagedKVCache(model.config, block_size=4, num_blocks=10, kv_dtype=kv_dtype)
    got, got_logits = greedy(model, prompt, 20, pool.new_sequence())
    assert got == ref
    np.testing.assert_allclose(got_logits, ref_logits, atol=1e-4)


def test_rounded_caches_stay_near_float32_and_int8_loses_more():
    rng = np.random.default_rng(19)
    model = random_model("llama", context_length=64, dim=64, ffn_dim=64)
    ids = rng.integers(0, 50, 40)
    exact = model.logits(ids)
    err = {}
    for d in ROUNDED:
        cache = model.new_cache(40, d)
        got = np.concatenate([model.forward(ids[:30], cache)] + [model.forward(ids[i:i + 1], cache)
                                                                 for i in range(30, 40)])
        err[d] = np.abs(got - exact).max()
    assert 0 < err["float16"] < 0.05 and err["float16"] < err["int8"] < 1.0, err


@pytest.mark.parametrize("kv_dtype", ROUNDED)
def test_engine_with_forks_and_prefix_hits_equals_each_request_alone(kv_dtype):
    """Batched decode through the paged kernel, n=2 samples (fork + copy-on-write of blocks with their scales),
    a repeated prompt (prefix-cache hit): greedy outputs equal each request alone on a contiguous cache of the
    same format, and every block is back in the pool at the end."""
    rng = np.random.default_rng(19)
    model = random_model("llama", context_length=128)
    prompts = [list(rng.integers(0, 50, n)) for n in (9, 21, 14)]
    prompts.append(prompts[1][:17] + [3, 4])                        # shares a full block prefix with prompt 1
    engine = Engine(model, num_blocks=64, block_size=4, max_num_seqs=8, kv_dtype=kv_dtype)
    outs: dict = {}
    for batch in (range(3), [3]):                                   # prompt 3 comes once prompt 1's blocks are cached
        for i in batch:
            engine.add_request(str(i), prompts[i], max_tokens=12, stop_token_ids=(), n=2 if i == 0 else 1)
        for e in engine.run():
            outs.setdefault((e.request_id, e.index), []).append(e.token_id)
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.num_used == 0
    assert engine.pool.allocator.hit_tokens > 0
    for i, p in enumerate(prompts):
        want, _ = greedy(model, p, 12, model.new_cache(64, kv_dtype))
        assert outs[(str(i), 0)] == want
    assert outs[("0", 1)] == outs[("0", 0)]                          # greedy samples of one prompt agree


@pytest.mark.parametrize("kv_dtype", ROUNDED)
@pytest.mark.parametrize("source", ["ngram", "layers:1"])
def test_greedy_speculative_equals_plain_greedy_on_each_format(kv_dtype, source):
    """Verification passes, rollback (truncate) and a draft sharing the target's cache, on a rounded cache."""
    model = random_model("llama", context_length=64)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 8, 9]
    want, _ = greedy(model, prompt, 24, model.new_cache(64, kv_dtype))
    r = speculative_generate(model, prompt, source, num_draft=3, max_new_tokens=24, kv_dtype=kv_dtype)
    assert r.token_ids == want and r.cache.kv_dtype == kv_dtype


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_trace_reports_the_values_attention_read(kv):
    """With an int8 cache the trace's k and v are the stored, rounded values, not the exact ones."""
    p = Path(__import__("tempfile").mkdtemp()) / "tiny.gguf"
    tiny_llama(p)
    model = tinyllm.load(p)
    out = tinyllm.generate(model, "hello world", max_new_tokens=4, trace=True, kv=kv, kv_dtype="int8")
    exact = tinyllm.generate(model, "hello world", max_new_tokens=4, trace=True)
    k, k_exact = out.trace._cat(0, "k"), exact.trace._cat(0, "k")           # [S, KVH, Dh]
    group = int8_group(k.shape[-1])
    q, s = quantize_int8(k_exact, group)
    np.testing.assert_allclose(k, q * np.repeat(s.astype(np.float32), group, axis=-1), atol=1e-6)                          # the int8 round trip of the exact k
    assert np.abs(k - k_exact).max() > 0
    assert out.stats.kv_bytes_per_token == model.config.kv_bytes_per_token("int8")


def test_cli_kv_dtype(tmp_path):
    p = tmp_path / "tiny.gguf"
    tiny_llama(p)
    script = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
    run = [sys.executable, str(script), "--model", str(p), "--prompt", "hi", "--raw", "--max-new-tokens", "3",
           "--backend", "numpy", "--json"]
    out = subprocess.run(run + ["--kv-dtype", "float16"], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["stats"]["kv_bytes_per_token"] == tinyllm.load(p).config.kv_bytes_per_token(2)
    bad = subprocess.run(run + ["--kv-dtype", "fp8"], capture_output=True, timeout=300)
    assert bad.returncode == 2 and b"--kv-dtype" in bad.stderr


WARMUP_CHECK = """
import sys
from numba.core.registry import CPUDispatcher
from test_model import random_model
from tinyllm import paged
from tinyllm.kernels import attention_kernels, block

kv_dtype = sys.argv[1]
model = random_model("llama", context_length=64, dim=64, ffn_dim=64, quant="q4_1")
def signatures():
    return {(mod.__name__, name, sig) for mod in (attention_kernels, block) for name, f in vars(mod).items()
            if isinstance(f, CPUDispatcher) for sig in f.signatures}
cache = model.new_cache(64, kv_dtype)                                  # warms up this format's kernels
pool = paged.PagedKVCache(model.config, block_size=4, num_blocks=32, kv_dtype=kv_dtype)
model.warm_up_pool(pool)                                               # and the paged ones
before = signatures()
model.prefill([1, 2, 3, 4, 5], cache)
model.decode_step(6, cache)
model.forward([7, 8, 9], cache)
model.prefill(list(range(1, 21)), model.new_cache(64, kv_dtype))
seqs = [pool.new_sequence() for _ in range(3)]
model.forward_batch([[1, 2], [3], [4, 5, 6]], seqs)
model.decode_batch([1, 2, 3], seqs)
new = signatures() - before
assert not new, new
"""


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ROUNDED)
def test_a_rounded_cache_compiles_its_kernels_when_made_not_mid_request(kv_dtype):
    """In a fresh process (kernels compiled by earlier tests would hide a gap)."""
    r = subprocess.run([sys.executable, "-c", WARMUP_CHECK, kv_dtype], cwd=Path(__file__).parent,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


# --- the real model ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_float16_cache_keeps_the_reference_greedy_outputs(default_model):
    """Every reference fixture prompt's 40 greedy tokens, with a float16 cache: as with float32 (the near-tie rule
    of test_reference_model: only a step whose reference top-2 margin is a near-tie may differ, and ends it)."""
    from test_reference_model import FIXTURE_NPZ, PROMPTS, _compare_greedy
    with np.load(FIXTURE_NPZ, allow_pickle=False) as z:
        margins = {k: z[f"p{k}_gen_margin"] for k in range(len(PROMPTS))}
    for k, p in enumerate(PROMPTS):
        n = len(p["greedy_ids"])
        got, _ = greedy(default_model, p["ids"], n, default_model.new_cache(len(p["ids"]) + n + 1, "float16"))
        agreed, note = _compare_greedy(got, p["greedy_ids"], margins[k])
        assert agreed == len(got) or note.startswith("stopped at near-tie"), (p["name"], note)
