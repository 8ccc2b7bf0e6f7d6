"""Q5_0 kept as a file holds it (quant.Q5Block) and run by its own kernels (kernels/q5_kernels.py): the repacking
against gguf-py's dequantization, the 5-bit integer dots against their plain bodies in each instruction set, and
the kernels against gguf-py's values times the rounded inputs."""
import numpy as np
import pytest

from tinyllm import quant

from tiny_gguf import random_blocks

gguf_py = pytest.importorskip("gguf")      # the reference extra
pytestmark = pytest.mark.reference


def reference(raw: np.ndarray) -> np.ndarray:
    """gguf-py's dequantization of Q5_0 blocks [rows, row bytes] -> [rows, row values] float32."""
    return gguf_py.quants.dequantize(raw, gguf_py.GGMLQuantizationType.Q5_0).astype(np.float32)


def q5_weight(rows: int, cols: int, seed: int, scale: float | None = 0.01):
    """A random Q5_0 matrix -> (its raw blocks [rows, row bytes], the Q5Block from_gguf_block makes of them)."""
    raw = random_blocks("Q5_0", rows * cols // 32, np.random.default_rng(seed), scale=scale).reshape(rows, -1)
    return raw, quant.from_gguf_block(raw.ravel(), "Q5_0", (rows, cols))


def test_q5_0_file_blocks_are_kept_as_they_are():
    """The file's bytes, planar (0.75 bytes a weight): ggml's values bit for bit, any rows, and as int8 blocks."""
    raw, qw = q5_weight(3, 576, 6, scale=None)                                       # fp16 d of every magnitude
    assert isinstance(qw, quant.Q5Block) and qw.nbytes == 3 * 576 * 3 // 4
    expected = reference(raw)
    np.testing.assert_array_equal(qw.dequantize().view(np.uint32), expected.view(np.uint32))
    np.testing.assert_array_equal(qw.dequantize(np.array([2, 0])).view(np.uint32), expected[[2, 0]].view(np.uint32))
    as_int8 = qw.as_int8_block()
    assert as_int8.q.min() >= -16 and as_int8.q.max() <= 15
    np.testing.assert_array_equal(as_int8.dequantize().view(np.uint32), expected.view(np.uint32))


def test_q5_0_beside_q8_0_fuses_as_int8_blocks():
    """A Q4_K_M file's q, k (Q5_0) beside a Q8_0 v: stacked as int8 blocks (exact), not as float32."""
    from tinyllm.weights import fuse_rows
    _, q = q5_weight(4, 64, 1)
    v = quant.quantize_int8_block(np.random.default_rng(2).normal(0, 1, (2, 64)).astype(np.float32))
    fused = fuse_rows([q, q, v])
    assert isinstance(fused, quant.Int8Block)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([q.dequantize(), q.dequantize(),
                                                                      v.dequantize()]))
    assert isinstance(fuse_rows([q, q]), quant.Q5Block)


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_q5_dot_matches_its_reference_body(isa):
    """The 5-bit integer dot in each instruction set the host has, against its plain-Numba body (each set's own
    input layout), on values at the ends of their ranges: q = 31 and 0 against -127 and 127 (AVX2's 16-bit sums of
    four products stay exact), fifth bits of every pattern; rows of 576 (fours of blocks, then a pair)."""
    from numba import njit
    from tinyllm.kernels import intdot
    from tinyllm.kernels.linear_kernels import quantize_rows
    from tinyllm.kernels.q4_kernels import _group_layout
    if isa not in getattr(intdot, "Q5_DOTS", {}):
        pytest.skip(f"no {isa} on this CPU")
    _, qw = q5_weight(4, 576, 8)
    qw.packed[0], qw.high[0] = 0xFF, 0xFFFFFFFF                                    # q = 31 everywhere
    qw.packed[1], qw.high[1] = 0, 0                                                # q = 0
    x = np.random.default_rng(9).normal(0, 1, (1, 576)).astype(np.float32)
    x[0, ::2] = 100.0                                                               # rounded to +-127
    x[0, 1::4] = -100.0
    xq, _, xs = quantize_rows(x)
    per_lane = isa == "vnni"
    xg, scales, sums = _group_layout(xq, xs, per_lane)
    plain = intdot.dot_q5_reference if per_lane else intdot.dot_q5_blocks_reference

    def rows(dot):
        @njit
        def each(packed, d, high, xg, scales, sums):
            out = np.empty(packed.shape[0], np.float32)
            for o in range(packed.shape[0]):
                out[o] = dot(packed, o, d, high, xg, scales, sums)
            return out
        return each(qw.packed, qw.d, qw.high, xg[0], scales[0], sums[0])
    got, want = rows(intdot.Q5_DOTS[isa]), rows(plain)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("cols", [576, 96, 608])     # blocks: fours then a pair; a pair and an odd one; an odd one
def test_q5_kernels_match_gguf_py_times_the_rounded_inputs(cols):
    """linear_q5_a8 (int8 inputs, vector dot and reference body), linear_q5_panels (a chunk's int8 inputs) and
    linear_q5 (float inputs) through the dispatch, against gguf-py's values times the inputs (rounded as
    quant.round_activations rounds them)."""
    from tinyllm.kernels import dispatch
    from tinyllm.kernels.q5_kernels import linear_q5_a8
    from tinyllm.kernels.weight_formats import kernel_weight
    raw, qw = q5_weight(40, cols, 10)
    w = reference(raw)                                                              # [40, cols]
    rng = np.random.default_rng(11)
    for rows in (1, 3, 9, 20):      # integer dots below 12 rows, integer tiles from 12 (either ISA)
        x = rng.normal(0, 1, (rows, cols)).astype(np.float32)
        for int8_inputs in (True, False):
            expected = (quant.round_activations(x) if int8_inputs else x) @ w.T        # [rows, 40]
            got = dispatch.linear(x, qw, int8_inputs=int8_inputs)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    out = np.empty((3, 40), np.float32)
    linear_q5_a8(kernel_weight(qw), x[:3], out, False)                               # the reference body
    expected = quant.round_activations(x[:3]) @ w.T
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("a8", [False, True])
def test_q5_threaded_shares_make_the_kernels_result(a8):
    """dispatch.linear_share, compiled as the threaded block calls it, threads 0 .. n-1 in turn: linear_into's
    numbers (int8 inputs: bit for bit, the same task function; float inputs: q5_rows_task's float sum may be
    vectorised differently in the two callers, as Q4_1's: tests/test_kernels.py). Rows of whole fours of blocks:
    with a last pair (576) the two compiled contexts round its share differently, 1 ulp here and there, as they
    do Q4_1's (on main too)."""
    from numba import njit
    from tinyllm.kernels import dispatch, intdot
    from tinyllm.kernels.weight_formats import kernel_weight

    @njit
    def every_share(w, x, out, int_dots, n):
        for tid in range(n):
            dispatch.linear_share(w, x, out, a8, int_dots, tid, n)
    _, qw = q5_weight(300, 512, 12)
    w = kernel_weight(qw)
    x = np.random.default_rng(13).normal(0, 1, (2, 512)).astype(np.float32)
    whole = np.empty((2, 300), np.float32)
    dispatch.linear_into(w, x, whole, a8, intdot.USE_INT_DOTS)
    for n in (1, 3):
        parts = np.full((2, 300), np.nan, np.float32)
        every_share(w, x, parts, intdot.USE_INT_DOTS, n)
        if a8:
            np.testing.assert_array_equal(parts, whole)
        else:
            np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())
