"""Quantization formats: round-trip error bounds, exact repacking of the file's own blocks, clear errors."""
import numpy as np
import pytest

import tinyllm
from tinyllm import quant
from tinyllm.gguf import GGUFFile

RNG = np.random.default_rng(0)
W = RNG.normal(0, 0.05, (64, 96)).astype(np.float32)


def test_int8_channel_error_within_half_a_step():
    qw = quant.quantize_int8_channel(W)
    step = np.abs(W).max(axis=1) / 127                               # [O]
    err = np.abs(qw.dequantize() - W)
    assert np.all(err <= step[:, None] / 2 + 1e-7)                   # rounding, not truncation
    assert qw.q.dtype == np.int8 and qw.nbytes == 64 * 96 + 64 * 4


def test_int8_block_error_within_half_a_block_step():
    qw = quant.quantize_int8_block(W)
    step = np.abs(W.reshape(64, -1, 32)).max(axis=2) / 127           # [O, I/32]
    err = np.abs(qw.dequantize() - W).reshape(64, -1, 32)
    assert np.all(err <= step[..., None] / 2 + 1e-7)


def test_q4_1_error_within_half_a_block_step_and_extremes_exact():
    qw = quant.quantize_q4_1(W)
    b = W.reshape(64, -1, 32)
    step = (b.max(axis=2) - b.min(axis=2)) / 15
    deq = qw.dequantize().reshape(64, -1, 32)
    assert np.all(np.abs(deq - b) <= step[..., None] / 2 + 1e-6)
    np.testing.assert_allclose(deq.min(axis=2), b.min(axis=2), atol=1e-7)   # the minimum is stored exactly


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_all_zero_rows_and_blocks_stay_zero(fmt):
    w = W.copy()
    w[3] = 0.0
    w[5, :32] = 0.0
    qw = quant.quantize(w, fmt)
    deq = qw.dequantize()
    assert np.all(np.isfinite(deq)) and np.all(deq[3] == 0) and np.all(deq[5, :32] == 0)


def test_q4_constant_block_is_exact():
    w = np.full((2, 32), 0.3, dtype=np.float32)
    np.testing.assert_array_equal(quant.quantize_q4_1(w).dequantize(), w)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_take_rows_and_concat_are_exact(fmt):
    qw = quant.quantize(W, fmt)
    idx = RNG.permutation(64)
    np.testing.assert_array_equal(qw.take_rows(idx).dequantize(), qw.dequantize()[idx])
    both = type(qw).concat_rows([qw, qw.take_rows(idx)])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([qw.dequantize(), qw.dequantize()[idx]]))
    np.testing.assert_array_equal(qw.dequantize(np.array([2, 7])), qw.dequantize()[[2, 7]])


def test_activation_rounding_error_within_half_a_block_step():
    x = RNG.normal(0, 1, (4, 100)).astype(np.float32)                # 100: the last block has 4 values
    x[0, 40:] = 0.0                                                   # two all-zero blocks and a partial one
    xq, xs = quant.quantize_activations(x)
    assert xq.shape == (4, 100) and xq.dtype == np.int8 and xs.shape == (4, 4)
    step = np.repeat(xs, 32, axis=1)[:, :100]                        # [4, 100] each value's block scale
    assert np.all(np.abs(xq * step - x) <= step / 2 + 1e-7)
    assert np.abs(xq).max() == 127                                    # each block's largest value maps to +-127
    assert xs[0, 2] == 1.0 and xs[0, 3] == 1.0 and not xq[0, 40:].any()
    np.testing.assert_array_equal(quant.round_activations(x), (xq * step).astype(np.float32))


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_row_surgery_keeps_every_array(fmt):
    """take_rows and concat_rows (fusing q/k/v) carry every stored array along; `arrays` is what kernels read."""
    qw = quant.quantize(W, fmt)
    assert qw.nbytes == sum(a.nbytes for a in qw.arrays)
    idx = np.array([2, 0, 1])
    np.testing.assert_array_equal(qw.take_rows(idx).dequantize(), qw.dequantize()[idx])
    both = type(qw).concat_rows([qw, qw])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([qw.dequantize()] * 2))
    assert len(both.arrays) == len(qw.arrays) and both.nbytes == 2 * qw.nbytes


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown quantization format 'int3'"):
        quant.quantize(W, "int3")
    with pytest.raises(ValueError, match="block size 32 does not divide the row length 40"):
        quant.quantize_int8_block(np.ones((2, 40), np.float32))
    with pytest.raises(ValueError, match="block size 32 does not divide the row length 40"):
        quant.quantize_q4_1(np.ones((2, 40), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize_int8_channel(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="unknown quant 'int4'"):
        tinyllm.load("whatever.gguf", quant="int4")


@pytest.mark.slow
def test_native_blocks_equal_the_files_dequantized_values(default_model_path):
    gg = GGUFFile(default_model_path)
    for name in ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"]:
        info = gg.tensors[name]
        qw = quant.from_gguf_block(gg.raw(name), info.type_name, info.shape)
        np.testing.assert_array_equal(qw.dequantize(), gg.tensor(name))


@pytest.mark.slow
def test_quantized_default_model_reports_bytes_and_errors(default_model_path):
    m = tinyllm.load(default_model_path, quant="int8")
    fp32_bytes = m.config.n_params * 4
    assert 0.24 < m.weight_bytes / fp32_bytes < 0.27                  # ~1 byte per weight + scales + fp32 norms
    rows = {r["name"]: r for r in m.quant_report}
    assert rows["tok_embed"]["format"] == "int8" and 0 < rows["tok_embed"]["rms_err"] < rows["tok_embed"]["max_err"]
    assert m.tied_head                                                 # the head shares the quantized table


def _fixture_top1_agreement(model) -> float:
    """Share of positions of the committed reference prompts whose argmax equals transformers' fp32 argmax."""
    import json
    from pathlib import Path

    fx = Path(__file__).parent / "fixtures"
    meta = json.loads((fx / "smollm2_reference.json").read_text())
    arrays = np.load(fx / "smollm2_reference.npz", allow_pickle=False)
    agree = total = 0
    for i, prompt in enumerate(meta["prompts"]):
        got = model.logits(prompt["ids"]).argmax(-1)
        agree += int((got == arrays[f"p{i}_top_ids"][:, 0]).sum())
        total += len(got)
    return agree / total


# Bounds sit just under what benchmarks/quality.py measured over 3,088 positions (int8 95.6%, int8-block 97.4%,
# native 100% against fp32; with int8 activations 94-96%) and this fixture gives (748 positions: int8 96.5%,
# int8-block 97.5%, native 100%; with int8 activations 95.3%, 96.7%, 96.7%): a regression in a quantizer or a
# kernel drops well below them.
@pytest.mark.parametrize("fmt, activations, bound", [("native", "float32", 0.995)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("int8-block", "float32", 0.95), ("int8", "float32", 0.93), ("native", "int8", 0.94), ("int8", "int8", 0.93)]])
def test_quantized_top1_agreement_on_reference_fixture(default_model_path, fmt, activations, bound):
    agreement = _fixture_top1_agreement(tinyllm.load(default_model_path, quant=fmt, activations=activations))
    assert agreement >= bound, f"{fmt} x {activations} activations: top-1 agreement {agreement:.3f} < {bound}"
