"""The K-quants and the other GGUF block types: read bit for bit as gguf-py (llama.cpp's own Python package) reads
them; the q4_k format and its quantizer; a file holding every type, loaded."""
import numpy as np
import pytest

import tinyllm
from tinyllm import quant
from tinyllm.gguf import GGML_TYPES, dequantize
from tinyllm.gguf_weights import load_gguf, unpermute_rope_rows
from tinyllm.kquants import DEQUANTIZERS

from tiny_gguf import TYPES, q4_k_bytes, random_blocks, tiny_llama

gguf_py = pytest.importorskip("gguf")      # the reference extra
pytestmark = pytest.mark.reference


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantization of raw blocks [rows, row bytes] -> [rows, row values] float32."""
    return gguf_py.quants.dequantize(raw, gguf_py.GGMLQuantizationType[type_name]).astype(np.float32)


def assert_bits_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_type_table_is_ggmls():
    for type_id, (name, block, size) in GGML_TYPES.items():
        ggml_type = gguf_py.GGMLQuantizationType(type_id)
        assert ggml_type.name == name
        if name != "Q8_1":       # (gguf-py lists 40 bytes, float d and s; ggml's block_q8_1 holds two halves: 36)
            assert gguf_py.constants.GGML_QUANT_SIZES[ggml_type] == (block, size)


@pytest.mark.parametrize("type_name", [*DEQUANTIZERS, "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_is_bit_exact(type_name):
    """Random bytes with fp16 scales of every magnitude (subnormal to 65504, both signs): equal bit for bit."""
    rng = np.random.default_rng(sum(map(ord, type_name)))
    block = TYPES[type_name][1]
    raw = random_blocks(type_name, 3 * 2048 // block, rng).reshape(3, -1)          # 3 rows of 2048 values
    assert_bits_equal(dequantize(raw.ravel(), type_name, (3, 2048)), reference(raw, type_name))


# --- q4_k: the format and its quantizer -----------------------------------------------------------------------
def test_q4_k_file_blocks_repack_exactly():
    """A file's Q4_K blocks kept as a Q4KBlock (and as the Q4_1 arrays the kernels run) give ggml's values."""
    raw = random_blocks("Q4_K", 4 * 3, np.random.default_rng(1)).reshape(4, -1)     # 4 rows of 768
    qw = quant.from_gguf_block(raw.ravel(), "Q4_K", (4, 768))
    expected = reference(raw, "Q4_K")
    assert_bits_equal(qw.dequantize(), expected)
    assert_bits_equal(qw.as_q4_1.dequantize(), expected)
    assert_bits_equal(qw.dequantize(np.array([3, 1])), expected[[3, 1]])
    np.testing.assert_array_equal(q4_k_bytes(qw), raw)                               # and back to the same bytes


def test_q6_k_file_blocks_repack_exactly():
    """A file's Q6_K blocks kept natively (its bytes made planar): ggml's values, bit for bit, in 0.83 bytes a
    weight."""
    raw = random_blocks("Q6_K", 3 * 3, np.random.default_rng(7)).reshape(3, -1)     # 3 rows of 768
    qw = quant.from_gguf_block(raw.ravel(), "Q6_K", (3, 768))
    assert isinstance(qw, quant.Q6KBlock) and qw.shape == (3, 768)
    assert qw.values().min() == -32 and qw.values().max() == 31
    assert qw.nbytes == raw.nbytes + 2 * 3 * 3                                       # (d widened to float32)
    expected = reference(raw, "Q6_K")
    assert_bits_equal(qw.dequantize(), expected)
    assert_bits_equal(qw.take_rows(np.array([2, 0])).dequantize(), expected[[2, 0]])


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_q6_k_dot_matches_its_reference_body(isa):
    """The Q6_K integer dot in each instruction set the host has, against its plain-Numba body, on values at the
    ends of their ranges (-32 and 31 against -127 and 127: AVX2's 16-bit pair sums stay exact)."""
    from numba import njit
    from tinyllm.kernels import kquant_kernels
    from tinyllm.kernels.linear_kernels import quantize_rows
    dots = getattr(kquant_kernels, "Q6K_DOTS", {})
    if isa not in dots:
        pytest.skip(f"no {isa} on this CPU")
    rng = np.random.default_rng(8)
    qw = quant.from_gguf_block(random_blocks("Q6_K", 4 * 2, rng, scale=0.01).ravel(), "Q6_K", (4, 512))
    qw.low[0], qw.high[0] = 0, 0                                                    # extreme rows: every value -32
    qw.low[1], qw.high[1] = 0xFF, 0xFF                                              # and 31
    x = rng.normal(0, 1, (1, 512)).astype(np.float32)
    x[0, ::2] = 100.0                                                               # rounded to +-127
    xq, xstart, xs = quantize_rows(x)

    def rows(dot):
        @njit
        def each(low, high, scales, d, xq, xstart, xs):
            out = np.empty(low.shape[0], np.float32)
            for o in range(low.shape[0]):
                out[o] = dot(low, high, scales, d, o, xq, xstart, xs)
            return out
        return each(*qw.arrays, xq[0], xstart[0], xs[0])
    got, want = rows(dots[isa]), rows(kquant_kernels.dot_q6k_reference)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = (qw.dequantize() * np.repeat(xs[0], 32)) @ xq[0].astype(np.float32)      # the plain body's meaning
    np.testing.assert_allclose(want, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


def test_q6_k_kernels_match_their_numpy_twin():
    """linear_q6k_a8 (int8 inputs, vector dot and reference body) and linear_q6k (float inputs) against the numpy
    backend's linear of the same weight, through the dispatch that runs them."""
    from tinyllm.backend import NumpyOps
    from tinyllm.kernels import dispatch
    rng = np.random.default_rng(9)
    qw = quant.from_gguf_block(random_blocks("Q6_K", 40 * 3, rng, scale=0.002).ravel(), "Q6_K", (40, 768))
    for rows in (1, 3, 9, 20):                                 # row dots (to 16 rows); a prompt chunk's
        x = rng.normal(0, 1, (rows, 768)).astype(np.float32)
        for int8_inputs in (True, False):
            expected = NumpyOps.linear(x, qw, int8_inputs=int8_inputs)                # [rows, 40]
            got = dispatch.linear(x, qw, int8_inputs=int8_inputs)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    from tinyllm.kernels.kquant_kernels import linear_q6k_a8
    from tinyllm.kernels.weight_formats import kernel_weight
    out = np.empty((3, 40), np.float32)
    linear_q6k_a8(kernel_weight(qw), x[:3], out, False)                               # the reference body
    expected = NumpyOps.linear(x[:3], qw, int8_inputs=True)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_q4_k_quantizer_writes_ggmls_format_and_beats_q4_1():
    w = np.random.default_rng(2).normal(0, 0.05, (32, 512)).astype(np.float32)
    qw = quant.quantize_q4_k(w)
    assert_bits_equal(qw.dequantize(), reference(q4_k_bytes(qw), "Q4_K"))           # llama.cpp reads what it means
    assert qw.scales.max() <= 63 and qw.mins.max() <= 63
    assert np.all(qw.d == qw.d.astype(np.float16)) and np.all(qw.dmin == qw.dmin.astype(np.float16))
    _, rms_k = quant.quantization_error(w, qw)
    _, rms_1 = quant.quantization_error(w, quant.quantize_q4_1(w))
    assert rms_k < rms_1                          # the fitted scale and minimum win over min-max, 6-bit scales or not
    assert qw.nbytes / w.size < 0.6 < 0.75 <= quant.quantize_q4_1(w).nbytes / w.size


def test_q4_k_rows_need_not_be_whole_super_blocks():
    """576 values a row (the default model's width): two super-blocks of 8 blocks and one of 2."""
    w = np.random.default_rng(3).normal(0, 0.05, (8, 576)).astype(np.float32)
    qw = quant.quantize_q4_k(w)
    assert qw.d.shape == (8, 3) and qw.scales.shape == (8, 18)
    err = np.abs(qw.dequantize() - w).reshape(8, 18, 32)
    span = np.ptp(w.reshape(8, 18, 32), axis=2)                                      # [8, 18]
    assert np.all(err.max(axis=2) <= span / 15)   # within a 4-bit step of the block's range, the last blocks too


def test_fit_scale_and_min_is_a_least_squares_fit():
    """On values that lie on a 4-bit grid the fit finds that grid exactly."""
    q = np.random.default_rng(4).integers(0, 16, (5, 32)).astype(np.float32)
    q[:, 0], q[:, 1] = 0, 15                                                         # the grid's full range
    x = 0.125 * q - 0.5                                                              # [5, 32]
    s, m = quant.fit_scale_and_min(x)
    np.testing.assert_allclose(s, 0.125, rtol=1e-6)
    np.testing.assert_allclose(m, 0.5, rtol=1e-6)


# --- a file with every type ------------------------------------------------------------------------------------
FILE_TYPES = {  # GGUF name -> (type, canonical name)
    "token_embd.weight": ("Q6_K", "tok_embed"), "blk.0.attn_q.weight": ("Q4_K", "layers.0.wq"),
    "blk.0.attn_k.weight": ("Q5_K", "layers.0.wk"), "blk.0.attn_v.weight": ("Q3_K", "layers.0.wv"),
    "blk.0.attn_output.weight": ("Q2_K", "layers.0.wo"), "blk.0.ffn_gate.weight": ("IQ4_XS", "layers.0.w_gate"),
    "blk.0.ffn_up.weight": ("Q5_0", "layers.0.w_up"), "blk.0.ffn_down.weight": ("Q5_1", "layers.0.w_down"),
    "blk.1.ffn_down.weight": ("IQ4_NL", "layers.1.w_down"), "blk.1.attn_q.weight": ("Q4_K", "layers.1.wq"),
    "blk.1.attn_k.weight": ("Q4_K", "layers.1.wk"), "blk.1.attn_v.weight": ("Q4_K", "layers.1.wv"),
}


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquants") / "kquants.gguf"
    tensors = tiny_llama(path, dim=256, n_heads=4, n_kv_heads=2, ffn=256,
                         types={name: t for name, (t, _) in FILE_TYPES.items()})
    return path, tensors


def test_file_of_every_type_loads_as_gguf_py_reads_it(kquant_file):
    path, tensors = kquant_file
    config, weights, _ = load_gguf(path)
    for name, (type_name, canonical) in FILE_TYPES.items():
        expected = reference(tensors[name], type_name)
        if canonical.endswith((".wq", ".wk")):                 # the loader un-permutes the RoPE rows
            expected = unpermute_rope_rows(expected, config.n_heads if canonical.endswith("wq") else
                                           config.n_kv_heads)
        assert_bits_equal(weights[canonical], expected)


def test_file_runs_dequantized_natively_and_requantized(kquant_file):
    """fp32 and native (Q4_K kept, the rest float32) are the same weights, so the same logits; int8 runs too."""
    path, _ = kquant_file
    ids = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    fp32 = tinyllm.load(path, backend="numpy")
    native = tinyllm.load(path, quant="native", backend="numpy")
    assert isinstance(native.layers[1].wqkv, quant.Q4KBlock)            # q, k, v all Q4_K: kept, fused
    assert isinstance(native.layers[0].wqkv, np.ndarray)                # Q4_K beside Q5_K, Q3_K: float32
    expected = fp32.logits(ids)
    assert np.all(np.isfinite(expected))
    np.testing.assert_array_equal(native.logits(ids), expected)
    int8 = tinyllm.load(path, quant="int8", backend="numpy")
    assert np.abs(int8.logits(ids) - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_q4_k_on_the_numba_backend_matches_numpy(kquant_file, activations):
    """The kernels read q4_k's super-blocks (a prompt's pass, op by op; decode steps, the fused block): the numpy
    backend's logits up to summation order, with either activations setting."""
    path, _ = kquant_file
    ids = [1, 72, 101, 108, 108, 111]
    plain = tinyllm.load(path, quant="q4_k", backend="numpy", activations=activations)
    fast = tinyllm.load(path, quant="q4_k", activations=activations)
    assert isinstance(fast.layers[0].w_in, quant.Q4KBlock)
    np.testing.assert_allclose(fast.logits(ids), plain.logits(ids), atol=2e-4)
    caches = plain.new_cache(16), fast.new_cache(16)
    for model, cache in zip((plain, fast), caches):
        model.prefill(ids[:-1], cache)
    np.testing.assert_allclose(fast.decode_step(ids[-1], caches[1]), plain.decode_step(ids[-1], caches[0]),
                               atol=2e-4)


@pytest.mark.parametrize("cols", [576, 608])
def test_native_q4_k_kernel_matches_its_numpy_twin(cols):
    """The kernel reading Q4_K's super-blocks (int8 activations) against the numpy backend's rounded-input linear;
    rows of 576: a last super-block of 2 blocks; of 608: an odd last block, added after the fused dot."""
    from tinyllm.backend import NumpyOps
    from tinyllm.kernels import intdot
    from tinyllm.kernels.kquant_kernels import linear_q4k_a8
    from tinyllm.kernels.q4_kernels import linear_q4_a8
    from tinyllm.kernels.weight_formats import kernel_weight
    rng = np.random.default_rng(5)
    w = quant.quantize_q4_k(rng.normal(0, 0.05, (40, cols)).astype(np.float32))
    for rows in (1, 3):
        x = rng.normal(0, 1, (rows, cols)).astype(np.float32)
        out, bridge = np.empty((rows, 40), np.float32), np.empty((rows, 40), np.float32)
        linear_q4k_a8(w.arrays, x, out, intdot.USE_INT_DOTS)
        expected = NumpyOps.linear(x, w, int8_inputs=True)                        # [rows, 40]
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        linear_q4_a8(kernel_weight(w.as_q4_1), x, bridge, intdot.USE_INT_DOTS)    # the Q4_1 arrays it equals
        # the same products and sums; fastmath may order a float sum differently in each compile (seen: 1 ulp)
        np.testing.assert_allclose(out, bridge, rtol=1e-6, atol=1e-6 * np.abs(bridge).max())


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_fused_q4_k_dot_matches_the_q4_1_reference_bodies(isa):
    """dot_q4k (each block's scale and minimum made in registers from the 6-bit integers) in each instruction set
    the host has, against intdot's 4-bit reference body on the Q4_1 arrays the weight equals (and, VNNI, against
    its own plain body); rows of 576 (a last super-block of 2 blocks), every value 15 in one row."""
    from numba import njit
    from tinyllm.kernels import intdot, kquant_kernels
    from tinyllm.kernels.linear_kernels import quantize_rows
    from tinyllm.kernels.q4_kernels import _group_layout
    if isa not in getattr(kquant_kernels, "Q4K_DOTS", {}):
        pytest.skip(f"no {isa} on this CPU")
    rng = np.random.default_rng(14)
    w = quant.quantize_q4_k(rng.normal(0, 0.05, (6, 576)).astype(np.float32))
    w.packed[0] = 0xFF
    x = rng.normal(0, 1, (1, 576)).astype(np.float32)
    x[0, ::2] = 100.0                                                               # rounded to +-127
    xq, _, xs = quantize_rows(x)
    xg, scales, sums = _group_layout(xq, xs, isa == "vnni")

    def rows(dot, arrays):
        @njit
        def each(arrays, xg, scales, sums):
            out = np.empty(arrays[0].shape[0], np.float32)
            for o in range(out.shape[0]):
                out[o] = dot(arrays[0], o, *arrays[1:], xg, scales, sums)
            return out
        return each(arrays, xg[0], scales[0], sums[0])
    got = rows(kquant_kernels.Q4K_DOTS[isa], w.arrays)
    plain = intdot.dot_q4_reference if isa == "vnni" else intdot.dot_q4_blocks_reference
    want = rows(plain, w.as_q4_1.arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if isa == "vnni":
        np.testing.assert_allclose(rows(kquant_kernels.dot_q4k_reference, w.arrays), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())


# --- a Q4_K_M-like file: its layers mix formats --------------------------------------------------------------------
MIXED_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
import tinyllm
from tinyllm.kernels import (attention_kernels, block, dispatch, intdot, kquant_kernels, linear_kernels, panel_kernels,
                             pointwise, q4_kernels, q5_kernels)
from tiny_gguf import tiny_llama

def signatures():
    modules = (attention_kernels, block, dispatch, intdot, kquant_kernels, linear_kernels, panel_kernels, pointwise,
               q4_kernels, q5_kernels)
    return {(mod.__name__, name, sig) for mod in modules for name, f in vars(mod).items()
            if isinstance(f, CPUDispatcher) for sig in f.signatures}

types = {f"blk.{i}.{name}.weight": "Q5_0" for i in range(2) for name in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                         "ffn_gate", "ffn_up")}
types |= {"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0"}
tiny_llama(PATH, dim=256, n_heads=4, n_kv_heads=2, ffn=256, types=types)
m = tinyllm.load(PATH, quant="native", activations="int8")
kinds = {tuple(type(w).__name__ for w in (l.wqkv, l.wo, l.w_in, l.w_out)) for l in m.layers}
assert kinds == {("Q5Block",) * 3 + ("Q4KBlock",), ("Q5Block",) * 3 + ("Q6KBlock",)}, kinds
before = signatures()
cache = m.new_cache(32)
m.prefill([1, 72, 101, 108], cache)
for t in (108, 111, 44):
    m.decode_step(t, cache)
new = signatures() - before
assert not new, new
"""


@pytest.mark.slow
def test_a_file_mixing_formats_in_a_layer_compiles_nothing_mid_request(tmp_path):
    """Q4_K_M's layers: Q5_0 matrices (kept as they are) beside a Q4_K or Q6_K ffn_down. Warm-up compiles the
    fused block of each kind of layer the model has, so a first decode compiles nothing. In a fresh process:
    signatures compiled by earlier tests would hide a gap."""
    import subprocess
    import sys
    from pathlib import Path
    code = f"PATH = {str(tmp_path / 'mixed.gguf')!r}\n" + MIXED_CHECK
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
