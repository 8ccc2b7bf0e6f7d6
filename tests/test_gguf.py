"""GGUF reader: exact dequantization, metadata, and a clear error for every way a file can be broken."""
import struct

import numpy as np
import pytest

import tinyllm
from tinyllm.gguf import GGUFError, GGUFFile, dequantize
from tinyllm.weights import CheckpointError

from tiny_gguf import tiny_llama, write_gguf


# --- block formats against hand-computed values ------------------------------------------------------------
def _f16(x) -> bytes:
    return np.float16(x).tobytes()


def test_q8_0_block_by_hand():
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.frombuffer(_f16(0.5) + q.tobytes(), dtype=np.uint8)
    np.testing.assert_array_equal(dequantize(raw, "Q8_0", (32,)), q.astype(np.float32) * 0.5)


def test_q4_0_and_q4_1_blocks_by_hand():
    lo, hi = np.arange(16) % 16, (np.arange(16) * 7) % 16       # values 0..15 for positions j and j+16
    nibbles = (lo | (hi << 4)).astype(np.uint8).tobytes()
    expected_q = np.concatenate([lo, hi]).astype(np.float32)     # value j = low nibble of byte j, j+16 = high
    raw0 = np.frombuffer(_f16(0.25) + nibbles, dtype=np.uint8)
    np.testing.assert_array_equal(dequantize(raw0, "Q4_0", (32,)), 0.25 * (expected_q - 8))
    raw1 = np.frombuffer(_f16(0.25) + _f16(-1.5) + nibbles, dtype=np.uint8)
    np.testing.assert_array_equal(dequantize(raw1, "Q4_1", (32,)), 0.25 * expected_q - 1.5)


def test_bf16_f16_f32():
    x = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(dequantize(bf16.view(np.uint8), "BF16", (4,)), x)
    np.testing.assert_array_equal(dequantize(x.astype(np.float16).view(np.uint8), "F16", (2, 2)), x.reshape(2, 2))
    np.testing.assert_array_equal(dequantize(x.view(np.uint8), "F32", (4,)), x)


def test_unsupported_type_is_named():
    with pytest.raises(GGUFError, match=r"IQ2_XXS is not supported \(supported: F32, .*Q4_K.*IQ4_XS\)"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))


# --- tiny files written here -------------------------------------------------------------------------------
def test_tiny_file_roundtrip(tmp_path):
    path = tmp_path / "tiny.gguf"
    tensors = tiny_llama(path, types={"blk.0.ffn_up.weight": "F16"})
    gg = GGUFFile(path)
    assert gg.metadata["llama.block_count"] == 2 and gg.metadata["tokenizer.ggml.merges"][0] == "h e"
    assert gg.tensors["blk.0.attn_q.weight"].shape == (32, 32)
    np.testing.assert_array_equal(gg.tensor("blk.1.ffn_down.weight"), tensors["blk.1.ffn_down.weight"])
    np.testing.assert_array_equal(gg.tensor("blk.0.ffn_up.weight"),
                                  tensors["blk.0.ffn_up.weight"].astype(np.float16).astype(np.float32))


def test_wrong_magic_and_version(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        tinyllm.load(p)
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0))
    with pytest.raises(ValueError, match="version 7 is not supported"):
        tinyllm.load(p)
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        tinyllm.load(p)


def test_missing_file():
    with pytest.raises(ValueError, match="no such file"):
        tinyllm.load("/nonexistent/model.gguf")


def test_unsupported_tensor_type_on_load(tmp_path):
    p = tmp_path / "iq2.gguf"
    tiny_llama(p, dim=256, n_heads=4, n_kv_heads=2, ffn=256, types={"blk.0.ffn_up.weight": "IQ2_XXS"})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS is not supported"):
        tinyllm.load(p)


def test_missing_tensor(tmp_path):
    p = tmp_path / "missing.gguf"
    tiny_llama(p, drop="blk.1.attn_v.weight")
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.attn_v\.weight' is missing"):
        tinyllm.load(p)


def test_shape_mismatch_with_config(tmp_path):
    p = tmp_path / "shape.gguf"
    tiny_llama(p, shapes={"blk.0.ffn_gate.weight": (40, 32)})
    with pytest.raises(ValueError, match=r"layers\.0\.w_gate.*shape \(40, 32\).*config says \(48, 32\)"):
        tinyllm.load(p)


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "arch.gguf"
    write_gguf(p, {"general.architecture": "mamba"}, {"x": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        tinyllm.load(p)


# --- the real file -----------------------------------------------------------------------------------------
def _region_offsets(path):
    """Byte offsets inside each region of a GGUF file: header, metadata, tensor index, data."""
    gg = GGUFFile(path)
    data_start = min(t.offset for t in gg.tensors.values())
    return {"header": 12, "metadata": 5000, "tensor index": data_start - 100,
            "tensor data": (data_start + path.stat().st_size) // 2}


@pytest.mark.parametrize("region", ["header", "metadata", "tensor index", "tensor data"])
def test_truncated_default_model_names_region(default_model_path, tmp_path, region):
    cut = _region_offsets(default_model_path)[region]
    p = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        p.write_bytes(f.read(cut))
    with pytest.raises(ValueError, match=f"truncated in the {region}"):
        tinyllm.load(p)


def test_a_model_is_named_as_its_file_not_by_the_converters_guess(tmp_path, default_model_path):
    from tinyllm.checkpoint import name_from_file
    assert GGUFFile(default_model_path).metadata["general.name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert name_from_file(default_model_path) == "SmolLM2-135M-Instruct"
    assert [name_from_file(n) for n in ("m-7B.q8_0.gguf", "m.IQ4_XS.gguf", "m-f16.gguf", "plain.gguf", "Q4_1.gguf")] \
        == ["m-7B", "m", "m", "plain", "Q4_1"]
    path = tmp_path / "Tiny-2L.Q4_1.gguf"
    tiny_llama(path)                                                    # general.name: "tiny-test"
    model = tinyllm.load(path, backend="numpy")
    assert model.config.name == "Tiny-2L" and repr(model).startswith("Transformer(Tiny-2L:")


def test_default_model_metadata(default_model_path):
    md = GGUFFile(default_model_path).metadata
    assert md["llama.block_count"] == 30 and md["llama.attention.head_count_kv"] == 3
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) == 48900
    types = {t.type_name for t in GGUFFile(default_model_path).tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.slow
@pytest.mark.reference
def test_every_tensor_bit_exact_vs_gguf_package(default_model_path):
    gguf = pytest.importorskip("gguf")
    ours = GGUFFile(default_model_path)
    reader = gguf.GGUFReader(str(default_model_path))
    assert len(reader.tensors) == len(ours.tensors) == 272
    for t in reader.tensors:
        ref = gguf.dequantize(t.data, t.tensor_type)
        mine = ours.tensor(t.name)
        assert mine.shape == ref.shape, t.name
        assert np.array_equal(mine.view(np.uint32), ref.astype(np.float32).view(np.uint32)), t.name
    # metadata too: every key and value the gguf package sees
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        expected = pytest.approx(value) if isinstance(value, float) else value
        assert ours.metadata[key] == expected, key
