"""Every Numba kernel against its numpy twin, on odd shapes; and the two backends give the same tokens."""
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from tinyllm import kernels, ops, quant
from tinyllm.backend import NumpyOps
from tinyllm.kernels import int8_tiles_avx2, intdot, kquant_kernels, linear_kernels as lin, panel_kernels as panels, q4_kernels
from tinyllm.kernels.weight_formats import kernel_weight

RNG = np.random.default_rng(0)
KERNEL_FORMATS = ("int8", "int8-block", "q4_1")   # formats with tiles of their own (q4_k's are the q4_1 it equals)


@pytest.mark.parametrize("fmt", ["fp32"] + list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 17, 64, 101, 130])
@pytest.mark.parametrize("O, I", [(1, 32), (33, 64), (130, 96), (7, 1536)])
def test_linear_matches_numpy(fmt, M, O, I):
    w = RNG.normal(0, 0.1, (O, I)).astype(np.float32)
    x = RNG.normal(0, 1, (M, I)).astype(np.float32)
    qw = w if fmt == "fp32" else quant.quantize(w, fmt)
    b = RNG.normal(size=O).astype(np.float32)
    want = NumpyOps.linear(x, qw, b)                                       # numpy: dequantize, then matmul
    got = kernels.linear(x, qw, b)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(I), rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp32"] + list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 17, 64])
@pytest.mark.parametrize("O, I", [(1, 32), (33, 64), (130, 96), (7, 1536)])
def test_linear_panels_matches_numpy(fmt, M, O, I):
    """The prompt-chunk kernel on every format (dispatch sends it fp32 and 4-bit weights from PANEL_MIN_ROWS rows,
    and int8 ones too on a CPU without AVX-512): any row count (x^T padded to whole vectors), a short last task of
    weight rows."""
    w = RNG.normal(0, 0.1, (O, I)).astype(np.float32)
    x = RNG.normal(0, 1, (M, I)).astype(np.float32)
    qw = w if fmt == "fp32" else quant.quantize(w, fmt)
    got = np.full((M, O), np.nan, dtype=np.float32)
    panels.linear_panels(kernel_weight(qw.as_q4_1 if fmt == "q4_k" else qw), x, got)   # (q4_k: dispatch's bridge)
    np.testing.assert_allclose(got, NumpyOps.linear(x, qw), atol=2e-5 * np.sqrt(I), rtol=1e-5)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 16, 17, 64, 130])
@pytest.mark.parametrize("O, I", [(1, 32), (33, 64), (130, 96), (7, 1536), (5, 544)])
def test_linear_with_int8_inputs_matches_numpy(fmt, M, O, I):
    """Weights that multiply int8-rounded inputs: the integer row dots below TILE_MIN_ROWS rows (4-bit weights: up
    to 16), the integer tiles from dispatch.integer_tiles_from rows (8-bit weights: 8; 12
    for Q5_0, 17 for 4-bit ones; run under TINYLLM_ISA=avx2 too), else the tiled float kernels on the rounded rows, BLAS beyond SMALL_M rows, all
    against NumpyOps.linear."""
    w = RNG.normal(0, 0.1, (O, I)).astype(np.float32)
    x = RNG.normal(0, 1, (M, I)).astype(np.float32)
    x[:, :3] *= 20                                                    # an outlier block, as real activations have
    qw = quant.quantize(w, fmt)
    want = NumpyOps.linear(x, qw, int8_inputs=True)
    np.testing.assert_allclose(kernels.linear(x, qw, int8_inputs=True), want, atol=2e-5 * np.sqrt(I), rtol=1e-5)
    assert np.abs(NumpyOps.linear(x, qw) - want).max() > 1e-4              # and the setting is what decides


@pytest.mark.parametrize("I", [1, 31, 32, 33, 100, 576])
def test_quantize_rows_rounds_exactly_as_numpy(I):
    x = RNG.normal(0, 1, (3, I)).astype(np.float32)
    x[1] = 0.0                                                        # all-zero blocks: scale 1, zeros
    x[2, : min(I, 32)] = np.arange(min(I, 32)) * 0.5                  # exact halves: ties round to even
    xq, xstart, xs = lin.quantize_rows(x)
    want_q, want_s = quant.quantize_activations(x)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xs, want_s)
    full = I // 32 * 32                                               # VNNI's starting sums, over the full blocks
    np.testing.assert_array_equal(xstart, -128 * want_q[:, :full].astype(np.int32).reshape(3, -1, 4).sum(-1))
    np.testing.assert_array_equal(lin.round_rows(x), quant.round_activations(x))


@pytest.mark.parametrize("int_dots", [pytest.param(True, marks=pytest.mark.skipif(
    not intdot.INT_DOTS, reason="this CPU has neither AVX-512 VNNI nor AVX2")), False])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS + ("q4_k",))
# blocks: 3 (a pair, an odd one), 8 (fours), 9 (fours, an odd one), 10 (fours, a pair), 11 (all three): dot_q4's groups
@pytest.mark.parametrize("I", [96, 256, 288, 320, 352])
def test_integer_kernels_match_the_float_kernels_on_rounded_inputs(fmt, I, int_dots):
    """The two implementations of int8 inputs agree: integer dot products (the host's VNNI or AVX2 versions, or
    their plain reference bodies: int_dots=False, what a CPU with neither runs) and the float kernels given the
    rounded rows (the tiled path)."""
    w = RNG.normal(0, 0.1, (67, I)).astype(np.float32)
    x = RNG.normal(0, 1, (5, I)).astype(np.float32)
    qw = quant.quantize(w, fmt)
    got, want = np.empty((5, 67), np.float32), np.empty((5, 67), np.float32)
    xr = lin.round_rows(x)
    integer, floats = ((q4_kernels.linear_q4_a8, q4_kernels.linear_q4) if fmt == "q4_1"
                       else (kquant_kernels.linear_q4k_a8, kquant_kernels.linear_q4k) if fmt == "q4_k"
                       else (lin.linear_int8_a8, lin.linear_tiled))
    integer(kernel_weight(qw), x, got, int_dots)
    floats(kernel_weight(qw), xr, want)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in int8_tiles_avx2.TILES, reason=f"this CPU has no {isa}")) for isa in ("vnni", "avx2")])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("O, I", [(16, 64), (21, 96), (48, 576), (35, 1536)])
def test_integer_panels_and_tiles_equal_their_reference_bodies(fmt, O, I, isa):
    """int8_tiles.py's contract: the IR panel (16 whole rows and I a multiple of 64; otherwise the plain loops run)
    and the IR tile of each instruction set the host has (VNNI, AVX2) against their plain bodies, a tile written
    at an offset into a larger output and nowhere else, and against the float product of the rounded rows; the
    last panel short (rows past O zero). The ends of AVX2's 16-bit sums are in: int8 weights -128 against inputs
    +-127 (2 x 128 x 127 a pair), a 4-bit block of 15s against 32 inputs of 127 (8 x 2 x 15 x 127 in one sum)."""
    from numba import njit
    from tinyllm.kernels import int8_tiles

    @njit
    def pack(q, o0, panel):
        int8_tiles.pack_words(q, o0, panel)

    (int8_tile, cols), four_bit = int8_tiles_avx2.TILES[isa], fmt == "q4_1"

    @njit
    def tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0):
        int8_tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, out, m0, o0, cols, four_bit)   # (constants)

    rng = np.random.default_rng(7)
    qw = quant.quantize(rng.normal(0, 0.1, (O, I)).astype(np.float32), fmt)
    x = rng.normal(0, 1, (11, I)).astype(np.float32)
    x[3, :5] *= 40                                                    # an outlier block
    x[0, :64], x[1, :64] = 2.0, -2.0                                  # inputs 127 and -127 in blocks 0-1
    if four_bit:
        qw.packed[0, :16] = 0xFF                                      # block 0 of row 0: every value 15
    else:
        qw.arrays[0][0, :64] = -128
    xq, xcorr, xs, xsum = panels.tile_inputs(x, cols)                 # 11 rows padded to whole tiles
    assert xq.shape[0] == -(-11 // cols) * cols and not xq[11:].any() and not xs[11:].any()
    want_q, _, want_s = lin.quantize_rows(x)                          # rounded as everywhere else
    np.testing.assert_array_equal(xq[:11], want_q)
    np.testing.assert_array_equal(xs[:11], want_s)
    np.testing.assert_array_equal(xcorr[:11], -128 * want_q.astype(np.int32).reshape(11, -1, 32).sum(-1))
    for o0 in range(0, O, int8_tiles.PANEL_ROWS):
        panel, want = np.empty((I // 4, 64), np.int8), np.full((I // 4, 64), 99, np.int8)
        scales, minimums = np.empty((I // 32, 16), np.float32), np.zeros((I // 32, 16), np.float32)
        if four_bit:
            values = np.empty((16, I), np.int8)
            int8_tiles.pack_q4_panel(qw.packed, qw.d, qw.m, o0, values, panel, scales, minimums)
            rows = np.zeros((16, I), np.int8)                         # the 4-bit values, unpacked in numpy
            nib = qw.packed[o0:o0 + 16].reshape(-1, I // 32, 16)
            rows[:len(nib)] = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(len(nib), I)
            np.testing.assert_array_equal(values, rows)
            int8_tiles.pack_words_reference(values, 0, want)
        else:
            q, s = qw.arrays[0], qw.arrays[1].reshape(O, -1)
            int8_tiles.pack_panel(q, s, o0, panel, scales)            # the IR where the panel is whole
            int8_tiles.pack_words_reference(q, o0, want)
            if O - o0 >= 16:
                pack(q, o0, want)
        np.testing.assert_array_equal(panel, want)
        for c0 in range(0, xq.shape[0], cols):                        # each tile, the last one padded
            got, ref = np.full((20, 40), np.nan, np.float32), np.full((20, 40), np.nan, np.float32)
            tile(panel, scales, minimums, xq, xcorr, xs, xsum, c0, got, 3, 7)
            int8_tiles.int8_tile_reference(panel, scales, minimums, xq, xcorr, xs, xsum, c0, ref, 3, 7, cols,
                                           four_bit)
            written = np.zeros((20, 40), bool)
            written[3:3 + cols, 7:23] = True
            assert np.isnan(got[~written]).all() and not np.isnan(got[written]).any()
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.sqrt(I))
            n = min(O - o0, 16)                                       # and the float product of the rounded rows
            m = min(11 - c0, cols)
            exact = quant.round_activations(x)[c0:c0 + m] @ qw.dequantize()[o0:o0 + n].T
            np.testing.assert_allclose(got[3:3 + m, 7:7 + n], exact, rtol=1e-5, atol=2e-5 * np.sqrt(I))
            assert (got[3 + m:3 + cols, 7:23] == 0).all()              # the padded rows: zeros
            assert (got[3:3 + m, 7 + n:23] == 0).all()                 # the short panel's zero rows


def _dot_contract_inputs(fmt, rng, I=256):
    """One weight matrix of format fmt and one input row, prepared as intdot.py's contract says."""
    w = quant.quantize(rng.normal(0, 0.1, (9, I)).astype(np.float32), fmt)
    x = rng.normal(0, 1, (1, I)).astype(np.float32)
    x[0, :3] *= 30
    xq, xstart, xs = lin.quantize_rows(x)
    return w, xq, xstart, xs


@pytest.mark.parametrize("isa", [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in getattr(intdot, "DOTS", {}), reason=f"this CPU has no {isa}")) for isa in ("vnni", "avx2")])
@pytest.mark.parametrize("fmt, I", [(f, 256) for f in KERNEL_FORMATS] + [("q4_1", 64), ("q4_1", 192), ("q4_1", 576),
                                                                         ("int8", 288), ("int8-block", 96)])
def test_each_vector_dot_equals_its_reference_body(fmt, I, isa):
    """intdot.py's contract, row by row: the LLVM-IR dot product in each instruction set the host has (AVX-512
    VNNI, AVX2) and its plain-Numba reference body agree (they add the same integer products; only the order of
    the float sums differs; the 4-bit dot is dot_q4 in VNNI and dot_q4_blocks in AVX2). q4_1 also with a pair of
    blocks alone (64 inputs), fours and a pair (192), and SmolLM2's width (576: four fours and a pair); the int8
    formats with an odd block after their pairs (288, 96). The weights include -128 (4-bit: 15) and the inputs
    +-127, the ends of AVX2's 16-bit sums (int8: 2 x 128 x 127; 4-bit, both nibbles in one: 2 x 2 x 15 x 127)."""
    from numba import njit
    w, xq, xstart, xs = _dot_contract_inputs(fmt, np.random.default_rng(5), I)
    xq[0, :64], xq[0, 64:128] = 127, -127                             # the extremes, in whole pairs of values
    if fmt == "q4_1":
        w.arrays[0][0, :32], w.arrays[0][1, 32:64] = 0xFF, 0xFF      # every value 15, in blocks 0-1 and 2-3
    else:
        w.arrays[0][0, :64] = -128
        w.arrays[0][1, :64] = 127
        w.arrays[0][2, 64:128] = -128
        xstart[0] = -128 * xq[0, :I // 32 * 32].astype(np.int32).reshape(-1, 4).sum(-1)

    int8, int8_block, q4 = intdot.DOTS[isa]
    if fmt == "q4_1":                                                 # VNNI: dot_q4, AVX2: dot_q4_blocks
        xg, scales, sums = q4_kernels._group_layout(xq, xs, isa == "vnni")
        args = (w.d, w.m, xg[0], scales[0], sums[0])
        fast, ref = q4, intdot.dot_q4_reference if isa == "vnni" else intdot.dot_q4_blocks_reference
    elif fmt == "int8":
        args = (xq[0], xstart[0], xs[0])
        fast, ref = int8, intdot.dot_int8_reference
    else:
        args = (w.scale, xq[0], xstart[0], xs[0])
        fast, ref = int8_block, intdot.dot_int8_block_reference

    def rows(f):                                                      # f on every row of the weight
        @njit
        def each(q, args):
            out = np.empty(q.shape[0], np.float32)
            for o in range(q.shape[0]):
                out[o] = f(q, o, *args)
            return out
        return each(w.arrays[0], args)
    got, want = rows(fast), rows(ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert fast is not ref
    x64 = xq[0].astype(np.int64).reshape(-1, 32)                      # the extreme rows, in exact integers
    if fmt == "q4_1":
        nb = I // 32
        packed = w.arrays[0][:2].reshape(2, nb, 16).astype(np.int64)
        values = np.concatenate([packed & 15, packed >> 4], axis=-1)                # [2, blocks, 32]
        even = nb - nb % 2
        exact = (w.d[:2] * xs[0] * (values * x64).sum(-1) + w.m[:2] * xs[0] * x64.sum(-1))[:, :even].sum(-1)
        np.testing.assert_allclose(got[:2], exact, rtol=1e-5, atol=1e-5)
    else:
        q64 = w.arrays[0].astype(np.int64)
        scale = (w.scale if fmt == "int8-block" else np.ones((9, I // 32)))[:3]
        exact = ((q64[:3].reshape(3, -1, 32) * x64).sum(-1) * xs[0] * scale).sum(-1)
        np.testing.assert_allclose(got[:3], exact, rtol=1e-5)


def test_the_reference_dots_compute_what_the_contract_says():
    """The reference bodies against the contract written out in numpy (intdot.py's docstring)."""
    from numba import njit
    rng = np.random.default_rng(6)
    w, xq, xstart, xs = _dot_contract_inputs("int8-block", rng)
    blocks = (w.q.astype(np.int64).reshape(9, 8, 32) * xq[0].astype(np.int64).reshape(8, 32)).sum(-1)   # [O, 8]
    want = (blocks * xs[0] * w.scale).sum(-1)

    @njit
    def rows(q, ws, xq, xstart, xs):
        return np.array([intdot.dot_int8_block_reference(q, o, ws, xq, xstart, xs) for o in range(q.shape[0])])
    np.testing.assert_allclose(rows(w.q, w.scale, xq[0], xstart[0], xs[0]), want, rtol=1e-5)


@pytest.mark.parametrize("per_lane", [True, False])
@pytest.mark.parametrize("I", [64, 192, 224, 256])
def test_the_q4_reference_dots_on_the_grouped_layout_are_the_plain_block_sum(I, per_lane):
    """dot_q4_reference and dot_q4_blocks_reference over _group_layout's reordered input (fours, a last pair; per
    lane or per block) are the sum over the even blocks of d * xs * (4-bit values . rounded x) + min * xs *
    sum(rounded x), written out in numpy from the unpacked nibbles: whichever group a block falls in, it meets its
    own 32 input values."""
    from numba import njit
    w, xq, _, xs = _dot_contract_inputs("q4_1", np.random.default_rng(7), I)
    nb = I // quant.BLOCK
    even = nb - nb % 2
    packed = w.arrays[0].reshape(9, nb, 16).astype(np.int64)
    values = np.concatenate([packed & 15, packed >> 4], axis=-1)                      # [O, blocks, 32]
    x_blocks = xq[0].astype(np.int64).reshape(nb, quant.BLOCK)                          # [blocks, 32]
    dots = (values * x_blocks).sum(-1)                                              # [O, blocks]
    want = (w.d * xs[0] * dots + w.m * xs[0] * x_blocks.sum(-1))[:, :even].sum(-1)
    xg, scales, sums = q4_kernels._group_layout(xq, xs, per_lane)
    dot = intdot.dot_q4_reference if per_lane else intdot.dot_q4_blocks_reference

    @njit
    def rows(p, d, m, xg, scales, sums):
        return np.array([dot(p, o, d, m, xg, scales, sums) for o in range(p.shape[0])])
    np.testing.assert_allclose(rows(w.arrays[0], w.d, w.m, xg[0], scales[0], sums[0]), want, rtol=1e-5, atol=1e-5)


def test_the_disk_cache_is_checked_against_every_kernel_source(tmp_path, monkeypatch):
    """kernels/disk_cache.py: each kernel's cached code is stamped with a hash of all the kernels' sources, so an
    edit to a file it compiles in from (numerics.py's sum inlined into block.py's blocks) invalidates it too, not
    only an edit to its own file; functions outside the package keep Numba's own rule."""
    from numba import njit

    from tinyllm.kernels import block, disk_cache, numerics
    for kernel in (lin.linear_rows, block.BLOCKS[False], numerics.ordered_sum):
        assert kernel._cache._impl._locator.get_source_stamp() == disk_cache.STAMP
    assert numerics.__file__ in map(str, disk_cache.SOURCES) and str(Path(block.__file__)) in map(str,
                                                                                                  disk_cache.SOURCES)
    copies = []
    for path in disk_cache.SOURCES:
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    monkeypatch.setattr(disk_cache, "SOURCES", tuple(copies))
    assert disk_cache.sources_stamp() == disk_cache.STAMP
    (tmp_path / "numerics.py").write_bytes((tmp_path / "numerics.py").read_bytes() + b"# an edit")
    assert disk_cache.sources_stamp() != disk_cache.STAMP

    @njit(cache=True)
    def elsewhere(x):
        return x + 1
    assert not type(elsewhere._cache._impl._locator).__name__.startswith("TinyllmKernels")


@pytest.mark.slow
def test_no_vnni_switch_forces_the_reference_bodies_in_a_whole_model():
    """TINYLLM_NO_VNNI=1 (intdot.USE_VNNI False): a quantized model with int8 activations runs the reference
    bodies in the fused decode steps and agrees with its no-cache forward (the tiled kernels on rounded rows)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = """
import numpy as np
from tinyllm.kernels import intdot
from test_model import random_model
assert intdot.USE_VNNI is False
for quant in ("int8", "int8-block", "q4_1"):
    m = random_model("llama", dim=64, ffn_dim=64, quant=quant, activations="int8")
    ids = np.random.default_rng(1).integers(0, 50, 12)
    cache = m.new_cache(16)
    got = np.stack([m.prefill(ids[:8], cache)] + [m.decode_step(int(t), cache) for t in ids[8:]])
    np.testing.assert_allclose(got, m.logits(ids)[7:], atol=1e-4)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, TINYLLM_NO_VNNI="1"))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("I", [1, 5, 45, 65])
@pytest.mark.parametrize("int8_inputs", [False, True])
def test_int8_channel_odd_width_not_multiple_of_block(I, int8_inputs):
    """Per-channel int8 works for any width; with int8 inputs the last, short block is added apart."""
    w = RNG.normal(0, 0.1, (9, I)).astype(np.float32)
    qw = quant.quantize_int8_channel(w)
    x = RNG.normal(size=(2, I)).astype(np.float32)
    np.testing.assert_allclose(kernels.linear(x, qw, int8_inputs=int8_inputs),
                               NumpyOps.linear(x, qw, int8_inputs=int8_inputs), atol=1e-5)


@pytest.mark.parametrize("S, H, KVH, Dh", [(1, 4, 4, 8), (5, 9, 3, 64), (37, 6, 2, 16), (300, 8, 1, 32)])
def test_decode_attention_matches_numpy(S, H, KVH, Dh):
    q = RNG.normal(size=(1, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(S, KVH, Dh)).astype(np.float32)
    want = NumpyOps.attention(q, k, v, start=S - 1)                        # [1, H*Dh]: the last position sees all
    np.testing.assert_allclose(kernels.attention(q, k, v, S - 1), want, atol=1e-5)


@pytest.mark.parametrize("T, start", [(1, 0), (7, 40), (3, 300)])
def test_decode_attention_on_one_thread_is_the_parallel_one(T, start, monkeypatch):
    """A first run's decode attention (dispatch.one_thread_attention, while the parallel kernel compiles in the
    background) is decode_attention's own code on one thread: the same outputs, bit for bit."""
    import importlib
    dispatch = importlib.import_module("tinyllm.kernels.dispatch")
    q = RNG.normal(size=(T, 9, 64)).astype(np.float32)
    k, v = (RNG.normal(size=(start + T, 3, 64)).astype(np.float32) for _ in range(2))
    parallel = kernels.attention(q, k, v, start)
    monkeypatch.setattr(dispatch, "one_thread_attention", True)
    np.testing.assert_array_equal(kernels.attention(q, k, v, start), parallel)
    np.testing.assert_allclose(parallel, NumpyOps.attention(q, k, v, start), atol=1e-5)


@pytest.mark.parametrize("T, start", [(2, 0), (5, 7), (16, 40), (17, 0), (4, 300), (37, 63), (128, 1000)])
@pytest.mark.parametrize("H, KVH, Dh", [(9, 3, 64), (4, 4, 8), (6, 2, 6)])
def test_causal_attention_matches_numpy(T, start, H, KVH, Dh):
    """Several query tokens (a prompt chunk, a speculative verification) after `start` cached positions: up to
    FEW_TOKENS the flash-decoding kernel (with chunks that a token sees in part or not at all), more the tiled
    kernel (query blocks of 32 and key blocks of 64 cut anywhere, a head size that is not a multiple of 16)."""
    q = RNG.normal(size=(T, H, Dh)).astype(np.float32)
    k = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    v = RNG.normal(size=(start + T, KVH, Dh)).astype(np.float32)
    np.testing.assert_allclose(kernels.attention(q, k, v, start), NumpyOps.attention(q, k, v, start), atol=1e-5)


@pytest.mark.parametrize("M, K, N", [(8, 64, 16), (64, 64, 48), (96, 64, 64), (16, 5, 80), (8, 1, 128), (24, 33, 112)])
@pytest.mark.parametrize("a_transposed", [False, True])
@pytest.mark.parametrize("width", ["wide", "narrow"])
def test_register_tiles_multiply_like_numpy(M, K, N, a_transposed, width):
    """register_tiles' products (prefill attention's two, the prompt-chunk linears'): tiles of 8 rows and 3, 2 or
    1 vectors of 16 columns (wide: AVX-512) or of 6 rows (then 4, 2) and 1 vector (narrow: AVX2), whichever the host runs, A
    read as it is or transposed, against numpy; and the LLVM IR tile against its plain-loop twin."""
    from numba import njit

    from tinyllm.kernels import register_tiles
    from tinyllm.kernels.register_tiles import product_tile, product_tile_reference
    product = register_tiles.product_wide if width == "wide" else register_tiles.product_narrow
    assert register_tiles.product is (register_tiles.product_wide if register_tiles.WIDE else
                                      register_tiles.product_narrow)
    a = RNG.normal(size=(K, M) if a_transposed else (M, K)).astype(np.float32)
    b = RNG.normal(size=(K, N)).astype(np.float32)
    c = np.full((M, N), np.nan, dtype=np.float32)
    product(a, b, c, a_transposed)
    np.testing.assert_allclose(c, (a.T if a_transposed else a) @ b, rtol=1e-5, atol=1e-5)

    @njit
    def one_tile(a, b, c):                      # rows, vectors and the flag must be constants where it is called
        if a_transposed:
            product_tile(a, b, c, 8, 16, 8, 2, True)
        else:
            product_tile(a, b, c, 8, 16, 8, 2, False)
    if M >= 16 and N >= 48:
        fast, slow = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
        one_tile(a, b, fast)
        product_tile_reference(a, b, slow, 8, 16, 8, 2, a_transposed)
        np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5)
        assert np.count_nonzero(fast) == 8 * 32             # the tile's rows and columns, nothing else


@pytest.mark.parametrize("I", [1, 15, 16, 17, 100, 576])
def test_dot_tile_matches_its_twin_and_numpy(I):
    """dot_tiles.dot_tile (LLVM IR: vector sums along I, the columns past the last vector one by one) against its
    plain-loop twin and numpy, for a tile in the middle of w and out: its DOT_ROWS x DOT_INPUTS outputs, nothing
    else; and linear_tiled's fp32 tiles with rows and inputs left over (8 to 31 input rows)."""
    from numba import njit

    from tinyllm.kernels.dot_tiles import DOT_INPUTS, DOT_ROWS, dot_tile, dot_tile_reference
    w = RNG.normal(size=(3 * DOT_ROWS + 1, I)).astype(np.float32)
    x = RNG.normal(size=(2 * DOT_INPUTS + 3, I)).astype(np.float32)
    fast, slow = np.zeros((x.shape[0], w.shape[0]), np.float32), np.zeros((x.shape[0], w.shape[0]), np.float32)
    njit(lambda w, x, out: dot_tile(w, DOT_ROWS, x, DOT_INPUTS, out))(w, x, fast)    # (an intrinsic: compiled callers)
    dot_tile_reference(w, DOT_ROWS, x, DOT_INPUTS, slow)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5 * np.sqrt(I))
    tile = (slice(DOT_INPUTS, 2 * DOT_INPUTS), slice(DOT_ROWS, 2 * DOT_ROWS))
    np.testing.assert_allclose(fast[tile], x[tile[0]] @ w[tile[1]].T, rtol=1e-5, atol=1e-5 * np.sqrt(I))
    assert np.count_nonzero(fast) == DOT_ROWS * DOT_INPUTS
    for M in (8, 13, 31):                                             # linear_tiled: fp32 takes the dot tiles
        xm = RNG.normal(size=(M, I)).astype(np.float32)
        out = np.full((M, w.shape[0]), np.nan, np.float32)
        lin.linear_tiled(kernel_weight(w), xm, out)
        np.testing.assert_allclose(out, xm @ w.T, rtol=1e-5, atol=2e-5 * np.sqrt(I))


@pytest.mark.parametrize("T", [6, 20])
def test_causal_attention_reads_strided_views(T):
    """Without a cache the model passes k and v as column slices of the fused qkv activation."""
    H, KVH, Dh = 4, 2, 8
    qkv = RNG.normal(size=(T, (H + 2 * KVH) * Dh)).astype(np.float32)
    q = qkv[:, :H * Dh].reshape(T, H, Dh)
    k = qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh)
    v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)
    np.testing.assert_allclose(kernels.attention(q, k, v, 0), NumpyOps.attention(q, k, v, 0), atol=1e-5)


def test_exp32_matches_the_library_exponential():
    """The vectorisable exponential the kernels use: within 3e-7 relative over float32's range, clamped outside."""
    from numba import njit

    from tinyllm.kernels.numerics import exp32

    @njit
    def apply(a, out):
        for i in range(a.size):
            out[i] = exp32(a[i])

    x = np.concatenate([np.linspace(-87, 88, 100_001), RNG.normal(0, 3, 10_000)]).astype(np.float32)
    got = np.empty_like(x)
    apply(x, got)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 3e-7
    edges = np.array([-1000.0, 1000.0], dtype=np.float32)
    apply(edges, got[:2])
    assert 0 < got[0] < 1e-37 and np.isfinite(got[1]) and got[1] > 1e38   # clamped to exp(-87), exp(88)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 36, 100, 1000])
def test_ordered_sum_adds_in_its_written_order(n):
    """numerics.ordered_sum, the sum that attention's softmax shares between block.py's threaded block and the
    kernels: exactly the tree of pairs per 16 values and the running total it says (emulated in float32 numpy),
    whether it is called from a compiled caller or on its own."""
    from numba import njit

    from tinyllm.kernels.numerics import ordered_sum

    @njit
    def inside(row, n):                                               # a compiled caller
        return ordered_sum(row, n) * np.float32(1.0)

    row = RNG.normal(0, 1, n + 3).astype(np.float32)                 # (values past n are not read)
    total = np.float32(0.0)
    for i in range(0, n - n % 16, 16):
        pairs = row[i:i + 16]
        while len(pairs) > 1:                                         # 16 -> 8 -> 4 -> 2 -> 1, neighbours added
            pairs = pairs[0::2] + pairs[1::2]
        total = np.float32(total + pairs[0])
    for i in range(n - n % 16, n):
        total = np.float32(total + row[i])
    assert ordered_sum(row, n) == total == inside(row, n)
    assert abs(float(total) - float(row[:n].astype(np.float64).sum())) < 1e-5 * max(1, n)


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
    """A pass runs on backend.NumpyOps (ops.py over any weight and cache format), kernels/ or, for a long pass,
    kernels/blas.py: the same names in each; each backend says which by row count."""
    from tinyllm.backend import NumbaBackend, NumpyBackend, NumpyOps
    from tinyllm.kernels import blas
    names = ["linear", "rmsnorm", "layernorm", "apply_rope", "attention", "paged_attention", "swiglu", "gelu_tanh"]
    for namespace in (NumpyOps, kernels, blas):
        assert all(callable(getattr(namespace, n)) for n in names), namespace.__name__
    numba_backend = NumbaBackend()
    assert NumpyBackend().ops_for(10_000) is NumpyOps and not NumpyBackend().fuses(1)
    assert numba_backend.ops_for(1) is kernels and numba_backend.ops_for(10_000) is blas
    assert numba_backend.fuses(kernels.FUSED_ROWS) != numba_backend.fuses(kernels.FUSED_ROWS + 1)


WARMUP_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
from test_model import random_model
from tinyllm import kernels, paged
from tinyllm.kernels import (attention_kernels, block, dispatch, intdot, linear_kernels, numerics, panel_kernels,
                             pointwise, q4_kernels)

def signatures():
    modules = (attention_kernels, block, dispatch, intdot, linear_kernels, numerics, panel_kernels, pointwise,
               q4_kernels)
    return {(mod.__name__, name, sig) for mod in modules for name, f in vars(mod).items()
            if isinstance(f, CPUDispatcher) for sig in f.signatures}

for quant in (None, "int8", "int8-block", "q4_1"):
    model = random_model("llama", context_length=64, dim=64, ffn_dim=64, quant=quant)   # warms up its kernels
    pool = paged.PagedKVCache(model.config, block_size=4, num_blocks=64)
    model.warm_up_pool(pool)                                        # warms up the batched paged kernel
    for activations in ("float32", "int8") if quant else ("float32",):
        model.activations = activations                             # warms up this setting's kernels
        before = signatures()
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
        assert not new, (quant, activations, new)
"""


FIRST_RUN_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
from test_model import random_model
from tinyllm.kernels import linear_kernels, q4_kernels

model = random_model("llama", context_length=64, dim=64, ffn_dim=64, quant="q4_1")
compiled = {name for module in (linear_kernels, q4_kernels) for name, f in vars(module).items()
            if isinstance(f, CPUDispatcher) and f.signatures}
assert "linear_q4" in compiled and "linear_q4_a8" not in compiled and "linear_int8_a8" not in compiled, compiled
assert "linear_rows" in compiled and "linear_tiled" not in compiled, compiled     # the 8-bit head: one row each
"""


def test_a_slow_warm_up_says_it_is_compiling_and_for_what(capsys, monkeypatch):
    """The compile notice: a warm-up that takes longer than `after` says on stderr what it compiles for, and whether
    this is a fresh install's first run (nothing cached) or the first run with a format not used before, then how
    long it took; a quick one (kernels loaded from the cache) prints nothing."""
    import importlib
    import time

    warmup = importlib.import_module("tinyllm.kernels.warmup")
    for fresh, why in ((True, "a fresh install's first run"), (False, "the first run with these")):
        monkeypatch.setattr(warmup, "nothing_cached", lambda: fresh)
        with warmup.compile_notice(time.perf_counter(), "q4_1 weights with int8 activations", after=0.05):
            time.sleep(0.3)
        err = capsys.readouterr().err.splitlines()
        assert err[0] == (f"tinyllm: compiling the Numba kernels for q4_1 weights with int8 activations ({why}; "
                          "they are cached on disk) ...")
        assert err[1].startswith("tinyllm: kernels compiled in")
    compile_notice = warmup.compile_notice
    with compile_notice(time.perf_counter(), after=0.5):
        pass
    time.sleep(0.6)                                         # (past the timer: it was cancelled)
    assert capsys.readouterr().err == ""


def test_nothing_cached_is_true_for_an_empty_cache_folder(tmp_path):
    import os
    import subprocess
    import sys
    code = "import importlib; print(importlib.import_module('tinyllm.kernels.warmup').nothing_cached())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))).stdout
    assert out.strip() == "True"


CACHE_KEYS = """
import importlib, pkgutil
from numba.core.registry import CPUDispatcher
import tinyllm.kernels as package
found = {}
for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"tinyllm.kernels.{info.name}")
    for name, value in vars(module).items():
        for i, f in enumerate(value.values() if isinstance(value, dict) else [value]):
            if isinstance(f, CPUDispatcher) and hasattr(f._cache, "_index_key") and f.py_func.__closure__:
                key = f._cache._index_key((), f.targetctx.codegen())[2]
                found[f"{info.name}.{name}.{i}"] = key
print(sorted(found.items()))
"""


def test_cached_closures_have_the_same_cache_key_in_every_process():
    """Numba keys a cached closure on its captured values (pickled): a value that pickles differently in each
    process (a dispatcher did, in the threaded block's wrapper) makes every run recompile it. Two processes must
    compute the same key for every closure kernel in the package."""
    import subprocess
    import sys
    runs = [subprocess.run([sys.executable, "-c", CACHE_KEYS], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert "block.THREADED_BLOCKS.1" in runs[0], "the threaded block's wrappers are closures: the check sees them"
    assert runs[0] == runs[1]


BOTH_SETTINGS = """
import sys
import numpy as np
from test_model import random_model
from tinyllm.kernels import block
ids = np.random.default_rng(2).integers(0, 50, 40)
chunks = [ids[:5], ids[5:6], ids[6:7], ids[7:10], ids[10:19], ids[19:35], ids[35:36]]
for activations in ("int8", "float32"):
    m = random_model("llama", dim=64, ffn_dim=64, quant="q4_1", activations=activations)
    out = {}
    for fused in (False, True):
        m.fused_decode, block._plain_only = fused, False
        cache = m.new_cache(40)
        out[fused] = np.concatenate([m.forward(c, cache) for c in chunks])
    print(activations, float(np.abs(out[True] - out[False]).max()))
"""


def test_each_activations_setting_compiles_blocks_of_its_own_name():
    """Numba names a compiled function (and its cache file) by its qualified name; the two settings' blocks are
    closures of one function, so each takes a name of its own (block.named_for): see the test below."""
    from tinyllm.kernels import block
    for kernels in (block.BLOCKS, block.THREADED_BLOCKS, {False: block.threaded_block_float,
                                                          True: block.threaded_block_int8}):
        assert kernels[False].py_func.__qualname__ != kernels[True].py_func.__qualname__


@pytest.mark.slow
def test_both_activations_settings_in_one_process_each_run_their_own_threaded_block():
    """A process that runs a quantized model with int8 activations and then one with float activations (or the
    other way round), their threaded blocks loaded from Numba's cache: each gives the op-by-op logits. With one name
    for both, the second ran the first's code (off by 0.37). Twice: the first run may compile, the second loads."""
    import subprocess
    import sys
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", BOTH_SETTINGS], cwd=Path(__file__).parent, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        for line in r.stdout.splitlines():
            assert float(line.split()[1]) < 1e-4, r.stdout


HELPER_CHECK = """
import importlib
import json
import os
import signal
import time
import numpy as np
from test_model import random_model
from tinyllm.kernels import attention_kernels, block, dispatch
warmup = importlib.import_module("tinyllm.kernels.warmup")     # (the package exports the function of that name)

def tiny():
    return random_model("llama", dim=96, ffn_dim=64, n_heads=6, n_kv_heads=2, quant="q4_1", context_length=128)

model = tiny()                                                  # warms up: a first run
blocks = [("q4_1", False, "float32", (model.config.head_dim, model.config.kv_mul))]
signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C in a terminal reaches its whole process group: the
os.killpg(os.getpgrp(), signal.SIGINT)           # background compile is in a session of its own and goes on
assert attention_kernels.decode_attention_one_thread._cache._cache_file._load_index(), "from the helper"
assert warmup._pending_prompt and dispatch.one_thread_attention, "the prompt kernels: in the background, first"
assert warmup._pending and not block.BLOCKS[False].overloads, "the fused blocks: compiling in the background"
assert not model.compute.fuses(1) and block._plain_only

ids = np.random.default_rng(3).integers(0, 50, 12)
reference = tiny()
reference.fused_decode = False                                  # op by op throughout
ref_cache, cache = reference.new_cache(128), model.new_cache(128)
reference.prefill(ids, ref_cache), model.prefill(ids, cache)
waited, fused_steps, LIMIT = 0, 0, 300          # (seconds: the helper runs at nice 19, behind other work)
for token in range(60):                 # decoding goes on op by op until the blocks are in the cache, then fuses
    fused = model.compute.fuses(1)
    if not fused and waited < LIMIT and token > 40:
        while not model.compute.fuses(1) and waited < LIMIT:
            time.sleep(1)
            waited += 1
        fused = model.compute.fuses(1)
    fused_steps += fused
    assert np.abs(model.decode_step(token % 50, cache) - reference.decode_step(token % 50, ref_cache)).max() < 1e-4
assert fused_steps and block.BLOCKS[False].overloads, "the plain blocks: loaded once the second process made them"
assert not warmup._pending and block._plain_only, "the plain blocks run until the threaded ones are ready too"
while not warmup._in_the_cache(blocks, "threaded") and waited < 2 * LIMIT:
    time.sleep(1)
    waited += 1
assert warmup._in_the_cache(blocks, "threaded"), "the helper filled the cache (later runs load the threaded blocks)"
assert warmup._in_the_cache(blocks, "plain")
time.sleep(warmup.LOOK_EVERY_S)
for token in range(60, 64):             # this run loads the threaded blocks too, and runs them: the same logits
    assert model.compute.fuses(1)
    assert np.abs(model.decode_step(token % 50, cache) - reference.decode_step(token % 50, ref_cache)).max() < 1e-4
assert not warmup._pending_threaded and not block._plain_only and block.THREADED_BLOCKS[False].overloads
print(json.dumps(blocks))
"""


@pytest.mark.slow
def test_first_run_compiles_in_second_processes_and_fuses_when_the_blocks_are_ready(tmp_path):
    """On a first run (an empty Numba cache) a second process compiles decode attention on one thread while this
    one compiles the one-row linears, and this one waits for it; the prompt kernels and then the fused blocks compile
    in another, not waited for: this process prefills in short chunks and decodes op by op (the same logits) until
    the plain blocks are in the cache, then loads and runs
    them, and the threaded ones when they are there too (warmup.py); later runs load both. A Ctrl-C to the run's process group does not stop that
    compile (it killed it, and the stale lock file held the blocks off for 15 minutes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), TINYLLM_COMPILE_HELPER="1", TINYLLM_WAIT_FOR_BLOCKS="0")
    r = subprocess.run([sys.executable, "-c", HELPER_CHECK], cwd=Path(__file__).parent, env=env, capture_output=True,
                       text=True, timeout=1500, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("(the prompt kernels and fused decode blocks go on in the background: until then, prompts and decoding "
            "are slower)") in r.stderr, r.stderr
    # a process that has run no parallel kernel loads the plain blocks from that cache (as a helper may): with
    # Numba's threading layer not started, calling one crashed
    load = f"from tinyllm.kernels.warmup import compile_blocks; compile_blocks({r.stdout.strip()}, ('plain',))"
    r = subprocess.run([sys.executable, "-c", load.replace("false", "False")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _lock_in(tmp_path, monkeypatch, holder: str, age_s: float = 0.0) -> Path:
    """A fused blocks' lock file in tmp_path (as the temporary folder) naming `holder`, its mtime age_s ago."""
    import importlib
    import os
    import tempfile
    import time
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = warmup._lock_path([["q4_1", False, "float32", [64, 3]]])
    path.write_text(holder)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_first_run_prefills_in_short_chunks_until_its_prompt_kernels_are_compiled(tmp_path, monkeypatch):
    """While a first run's background process compiles the prompt kernels (warmup), a prompt of up to LONG_PROMPT
    tokens goes through in chunks of FIRST_RUN_CHUNK, which the decode kernels take; for a longer one they are
    compiled here at once, with the notice (as at load before), and it takes chunks of PREFILL_CHUNK; once that
    process has written its marker file, or has ended (done, or failed: then a chunk compiles what it needs),
    PREFILL_CHUNK again."""
    import importlib
    import subprocess
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    dispatch = importlib.import_module("tinyllm.kernels.dispatch")
    assert warmup.prefill_chunk(12) == warmup.PREFILL_CHUNK, "no background compile: the whole chunk"
    compiled_here = []
    monkeypatch.setattr(warmup, "warm_prompt_kernels", compiled_here.append)
    monkeypatch.setattr(dispatch, "one_thread_attention", True)
    compiling = subprocess.Popen(["sleep", "60"])
    try:
        lock = _lock_in(tmp_path, monkeypatch, str(compiling.pid))      # held by a live process
        blocks, marker = [["q4_1", False, "float32", [64, 3]]], lock.with_suffix(".prompt")
        assert warmup._prompt_marker(blocks) == marker
        monkeypatch.setattr(warmup, "_pending_prompt", [(marker, blocks)])
        assert warmup.prefill_chunk(12) == warmup.FIRST_RUN_CHUNK < warmup.TILE_MIN_ROWS
        assert warmup.prefill_chunk(warmup.LONG_PROMPT) == warmup.FIRST_RUN_CHUNK
        assert warmup._pending_prompt and not warmup.prompt_kernels_ready() and not compiled_here
        assert dispatch.one_thread_attention, "decode attention on one thread until then"
        marker.touch()
        assert warmup.prefill_chunk(12) == warmup.PREFILL_CHUNK
        assert not warmup._pending_prompt and not dispatch.one_thread_attention
        monkeypatch.setattr(warmup, "_pending_prompt", [(tmp_path / "other.prompt", blocks)])
        assert warmup.prefill_chunk(warmup.LONG_PROMPT + 1) == warmup.PREFILL_CHUNK
        assert compiled_here == [blocks] and not warmup._pending_prompt, "a long prompt: compiled here, once"
        assert warmup.prefill_chunk(12) == warmup.PREFILL_CHUNK and compiled_here == [blocks]
        monkeypatch.setattr(warmup, "_pending_prompt", [(tmp_path / "other.prompt", blocks)])
        compiling.kill(), compiling.wait()
        assert warmup.prompt_kernels_ready(), "its process ended (done, or failed): the lock is no longer held"
    finally:
        compiling.kill(), compiling.wait()


def test_a_compile_lock_is_taken_over_when_its_holder_is_gone(tmp_path, monkeypatch):
    """The lock of a background compile of fused blocks (one per machine) names the helper's pid: a lock whose
    process died (SIGKILL, the out-of-memory killer: it never removed its file), or is a zombie, or that is older
    than LOCK_STALE_S is taken over at once; a live holder's, or one too new to name its holder yet, is not. Before,
    a dead helper's lock held every run off the blocks for 15 minutes, each decoding op by op."""
    import importlib
    import subprocess
    import time
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    blocks = [["q4_1", False, "float32", [64, 3]]]
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    dead = reaped.pid                                                   # (exited and reaped)
    zombie = subprocess.Popen(["true"])                                 # exits; not reaped until .wait()
    living = subprocess.Popen(["sleep", "30"])
    try:
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        for holder, age, held in [(str(dead), 0, False), (str(zombie.pid), 0, False), (str(living.pid), 0, True),
                                  (str(living.pid), warmup.LOCK_STALE_S + 1, False), ("", 0, True),
                                  ("", warmup.UNWRITTEN_S + 1, False)]:
            path = _lock_in(tmp_path, monkeypatch, holder, age)
            assert warmup._held(path) == held, (holder, age)
            claimed = warmup._claim(blocks)
            assert (claimed is None) == held, (holder, age)
            assert path.exists() and (held or path.read_text() == ""), "taken over: a new, empty lock file"
        path.unlink()
        assert not warmup._held(path) and warmup._claim(blocks) == str(path)
    finally:
        living.kill(), living.wait(), zombie.wait()


def test_a_waiting_process_starts_the_background_compile_again_if_its_helper_died(tmp_path, monkeypatch):
    """A process decoding op by op while a helper compiles its fused blocks looks for them once a second; if the
    helper died without filling the cache, it starts another (once: a helper that fails every time is not started
    forever), else it would decode op by op for the rest of its life (a server: for days)."""
    import importlib
    import subprocess
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    group = [("q4_1", False, "float32", (64, 3))]
    started = []
    monkeypatch.setattr(warmup, "_pending", list(group))
    monkeypatch.setattr(warmup, "_pending_groups", [group])
    monkeypatch.setattr(warmup, "_restarts_left", 1)
    monkeypatch.setattr(warmup, "_in_the_cache", lambda blocks, kind: False)
    monkeypatch.setattr(warmup, "_in_a_second_process", lambda task, blocks: started.append((task, blocks)))
    living = subprocess.Popen(["sleep", "30"])
    try:
        path = _lock_in(tmp_path, monkeypatch, str(living.pid))
        monkeypatch.setattr(warmup, "_next_look", 0.0)
        assert not warmup.blocks_ready() and not started, "its helper is alive: it waits"
    finally:
        living.kill(), living.wait()
    for _ in range(2):
        monkeypatch.setattr(warmup, "_next_look", 0.0)
        assert not warmup.blocks_ready()
    assert started == [(("plain", "threaded"), group)], "the helper died: started again, once"


def test_a_first_run_loads_the_plain_blocks_then_the_threaded_ones_when_each_is_in_the_cache(monkeypatch):
    """While a helper compiles a first run's fused blocks, this process decodes op by op; it loads the plain blocks
    when they are in the cache, and then the threaded ones when they are there too, and runs those (before, only a
    restart did: a server started on a fresh install ran the plain blocks, 10-20% slower, for its whole life)."""
    import importlib
    from tinyllm.kernels import block
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    group = [("q4_1", False, "float32", (64, 3))]
    cached, loaded = set(), []
    monkeypatch.setattr(warmup, "_pending", list(group))
    monkeypatch.setattr(warmup, "_pending_threaded", list(group))
    monkeypatch.setattr(warmup, "_pending_groups", [group])
    monkeypatch.setattr(warmup, "_in_the_cache", lambda blocks, kind: kind in cached)
    monkeypatch.setattr(warmup, "compile_blocks", lambda blocks, kinds: loaded.append(kinds))
    monkeypatch.setattr(warmup, "_restart_dead_helpers", lambda: None)
    monkeypatch.setattr(block, "_plain_only", True)

    def look():
        monkeypatch.setattr(warmup, "_next_look", 0.0)
        return warmup.blocks_ready()
    assert not look() and not loaded, "nothing in the cache yet: op by op"
    cached.add("plain")
    assert look() and loaded == [("plain",)] and block._plain_only, "the plain blocks, loaded and run"
    assert warmup.blocks_ready(), "between looks too"
    assert look() and len(loaded) == 1, "the threaded ones are not in the cache yet"
    cached.add("threaded")
    assert look() and loaded[-1] == ("plain", "threaded") and not block._plain_only, "the threaded blocks run"
    assert not warmup._pending_threaded and not warmup._pending_groups
    assert look() and len(loaded) == 2, "nothing more to load"


def test_a_quantized_models_plain_block_is_left_in_the_disk_cache_until_a_pass_runs_it(monkeypatch):
    """Warm (the disk cache holds them), a quantized model loads the threaded block its decode steps run and leaves
    the plain one (passes of 8-16 rows) to load on its first call; compiled here, or for fp32 weights (whose decode
    steps run the plain block), or asked for alone, a block is made at once."""
    import importlib
    warmup = importlib.import_module("tinyllm.kernels.warmup")
    cached, made = set(), []
    monkeypatch.setattr(warmup, "_in_the_cache", lambda blocks, kind: kind in cached)
    monkeypatch.setattr(warmup, "_warm_decode_block", lambda fmt, int8, kv, heads, kinds: made.append((fmt, kinds)))
    both = ("plain", "threaded")
    for fmt in ("q4_1", None):
        warmup.compile_blocks([(fmt, False, "float32", (64, 3))], both)
    cached.add("plain")
    for fmt in ("q4_1", None):
        warmup.compile_blocks([(fmt, False, "float32", (64, 3))], both)
    warmup.compile_blocks([("q4_1", False, "float32", (64, 3))], ("plain",))
    assert made == [("q4_1", both), (None, both), ("q4_1", ("threaded",)), (None, both), ("q4_1", ("plain",))]


def test_a_model_compiles_only_its_own_kernels():
    """A q4_1 model with float activations warms the 4-bit float kernels and its 8-bit head's one-row kernel (the
    tiled one waits for a paged pool: batches), not the integer kernels of int8 activations: a first run compiles
    only what it will use."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", FIRST_RUN_CHECK], cwd=Path(__file__).parent, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
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
from tinyllm.kernels import (attention_kernels, block, dispatch, intdot, linear_kernels, numerics, panel_kernels,
                             pointwise, q4_kernels)
from tinyllm.speculative import make_draft, speculative_generate

def signatures():
    modules = (attention_kernels, block, dispatch, intdot, linear_kernels, numerics, panel_kernels, pointwise,
               q4_kernels)
    return {(mod.__name__, name, sig) for mod in modules for name, f in vars(mod).items()
            if isinstance(f, CPUDispatcher) for sig in f.signatures}

model = random_model("llama", context_length=64, dim=64, ffn_dim=64)        # fp32: warms the fp32 kernels only
drafts = [make_draft(model, spec) for spec in ("self-q4", "self-int8")]     # each warms its own formats
before = signatures()
for draft in drafts:
    speculative_generate(model, [1, 2, 3, 4, 5], draft, num_draft=3, max_new_tokens=12)
new = signatures() - before
assert not new, new
"""


@pytest.mark.slow
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


@pytest.mark.slow
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


DISABLE_JIT_CHECK = """
import numpy as np
from numba.core.registry import CPUDispatcher
from tinyllm import kernels
from tinyllm.kernels import linear_kernels
from test_model import random_model
assert not isinstance(linear_kernels.linear_rows, CPUDispatcher)   # plain Python functions
for quant in (None, "int8", "int8-block", "q4_1"):
    for activations in ("float32", "int8") if quant else ("float32",):
        m = random_model("llama", dim=64, ffn_dim=64, n_layers=1, quant=quant, activations=activations)
        ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
        cache = m.new_cache(16)
        got = np.stack([m.prefill(ids[:8], cache)] + [m.decode_step(t, cache) for t in ids[8:]])
        assert m.compute.ops_for(8) is kernels
        m.backend = "numpy"
        np.testing.assert_allclose(got, m.logits(ids)[7:], atol=1e-4 if activations == "float32" else 5e-2)
"""


def test_numba_disable_jit_runs_the_kernels_as_python():
    """NUMBA_DISABLE_JIT=1 (to step into the kernels with a debugger): every kernel runs as plain Python and the
    numba backend still agrees with numpy, for every format and both activations settings (with int8 activations
    a rounding flip moves a value by a whole int8 step: the tolerance is wider)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", DISABLE_JIT_CHECK], cwd=Path(__file__).parent, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, NUMBA_DISABLE_JIT="1"))
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


def test_spin_barrier_holds_every_thread_until_all_arrive():
    """The threads of one parallel region meeting at spin_barrier.barrier 200 times: after each barrier every
    thread sees what all the others wrote before it, and the barrier's arrival count is back to 0 at the end."""
    from numba import get_num_threads, njit, prange

    from tinyllm.kernels.spin_barrier import COUNT, GENERATION, barrier, new_state

    @njit(parallel=True)
    def meet(state, written, seen, n):
        for tid in prange(n):
            for r in range(written.shape[0]):
                written[r, tid] = r + 1
                barrier(state, n)
                low = written[r, 0]
                for other in range(1, n):
                    low = min(low, written[r, other])
                seen[r, tid] = low                              # r + 1 only if every thread had written round r
    n = get_num_threads()
    state, written, seen = new_state(), np.zeros((200, n), np.int64), np.zeros((200, n), np.int64)
    meet(state, written, seen, n)
    np.testing.assert_array_equal(seen, np.arange(1, 201)[:, None] * np.ones((1, n), np.int64))
    assert state[COUNT] == 0 and state[GENERATION] == (200 if n > 1 else 0)


@pytest.mark.slow
def test_threaded_block_gives_the_same_bits_on_one_thread(monkeypatch):
    """The threaded block splits its work by thread count; with one thread (numba.set_num_threads(1)) it must give
    the logits and cache it gives with all of them (each share is computed by the same functions)."""
    import numba

    from test_model import random_model
    from tinyllm.kernels import block
    m = random_model("llama", dim=64, ffn_dim=64, quant="q4_1", activations="int8")
    ids = np.random.default_rng(3).integers(0, 50, 12)
    results = []
    threads = numba.get_num_threads()
    try:
        for n in (threads, 1):
            numba.set_num_threads(n)
            cache = m.new_cache(16)
            monkeypatch.setattr(block, "_plain_only", False)    # (the cache's warmup may have chosen the plain one)
            results.append((np.concatenate([m.forward(c, cache) for c in (ids[:5], ids[5:6], ids[6:9])]),
                            cache.k[:, :9].copy()))
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_the_threaded_block_stays_off_where_a_region_could_have_fewer_threads(monkeypatch):
    """With OMP_DYNAMIC, or an OMP_THREAD_LIMIT below Numba's thread count, OpenMP may run a region's iterations on
    fewer threads than there are, and a thread would wait at a barrier for one that never comes: the plain block
    runs instead (block.threads_can_wait)."""
    import numba

    from tinyllm import kernels
    from tinyllm.kernels import block
    kernels.swiglu(np.ones((4, 8), np.float32))                 # a parallel region: the threading layer is chosen
    layer = numba.threading_layer()
    monkeypatch.setattr(block, "_layer_ok", False)
    assert block.threads_can_wait() == (layer in ("omp", "workqueue"))
    if layer != "omp" or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"the OpenMP settings matter only to the omp layer with 2+ threads (here {layer})")
    for name, value in (("OMP_DYNAMIC", "true"), ("OMP_THREAD_LIMIT", "1")):
        monkeypatch.setattr(block, "_layer_ok", False)
        monkeypatch.setenv(name, value)
        assert not block.threads_can_wait(), name
        monkeypatch.delenv(name)


@pytest.mark.parametrize("fmt", [None, "int8", "int8-block", "q4_1"])
@pytest.mark.parametrize("a8", [False, True])
def test_the_threads_shares_of_a_linear_make_the_whole(fmt, a8):
    """dispatch.linear_share: threads 0 .. n-1 each writing their share of the tasks give, bit for bit, the output
    of linear_into (the kernel runs the same task functions in its parallel loop), for any thread count. (Rows of
    an even number of 32-value blocks, as every model here has: with an odd count, per-row int8 with int8 inputs
    came out 1 ulp apart, the compiled contexts rounding the last block's share differently. 4-bit weights with
    float inputs differ in the last bits at this size; at the model's shapes tests/test_model.py finds the
    threaded, plain and op-by-op paths equal bit for bit.)"""
    from tinyllm.kernels import intdot
    from tinyllm.kernels.dispatch import linear_into
    from tinyllm.quant import quantize
    rng = np.random.default_rng(4)
    w = rng.standard_normal((70, 128)).astype(np.float32)               # 5 tasks, the last short; 4 blocks of 32
    arrays = kernel_weight(w if fmt is None else quantize(w, fmt))
    x = rng.standard_normal((3, 128)).astype(np.float32)
    a8 = a8 and fmt is not None
    whole = np.empty((3, 70), np.float32)
    linear_into(arrays, x, whole, a8, intdot.USE_INT_DOTS)
    every_share = _every_share(a8)
    for n in (1, 2, 3):
        shares = np.full((3, 70), np.nan, np.float32)
        every_share(arrays, x, shares, intdot.USE_INT_DOTS, n)
        if fmt == "q4_1" and not a8:    # q4_rows_task's float sum, vectorised differently in the two callers here
            np.testing.assert_allclose(shares, whole, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(shares, whole)


def _every_share(a8: bool):
    """Compiled, as the threaded block calls it: linear_share for threads 0 .. n-1 in turn."""
    from numba import njit

    from tinyllm.kernels.dispatch import linear_share

    @njit
    def every_share(w, x, out, int_dots, n):
        for tid in range(n):
            linear_share(w, x, out, a8, int_dots, tid, n)
    return every_share
