"""Corrupt, hostile and wrongly typed model files: every one gives a one-line CheckpointError naming the file,
never another exception. Targeted cases for each field that used to escape, then seeded fuzzing of the GGUF
reader and the Hugging Face loader (bit flips, truncation, fields set to 0, 1, 2, 2^31, 2^63, 2^64-1, wrong
JSON types)."""
from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

import tinyllm
from tinyllm import gguf
from tinyllm.quant import Int8Block, Q4Block
from tinyllm.weights import CheckpointError, load_checkpoint

from tiny_gguf import tiny_llama
from tiny_hf import tiny_hf_llama, write_safetensors

SPECIAL_VALUES = (0, 1, 2, 2**31, 2**63, 2**64 - 1)


def one_line_error(path, where=None) -> CheckpointError:
    """Load `path`; it must fail with a one-line CheckpointError that names `where` (default: the path)."""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(where or path) in message, message
    return info.value


def nested_arrays(depth: int) -> bytes:
    """A metadata value: an array of one array of one array ... `depth` deep (type ids 9 = array, 4 = u32)."""
    return struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)


# --- GGUF: targeted ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata, message", [
    ({"general.alignment": 0}, "general.alignment is 0, not a power of two"),
    ({"general.alignment": 3}, "not a power of two"),
    ({"general.alignment": "32"}, "not a power of two"),
    ({"general.extra": nested_arrays(5000)}, "nested more than 8 deep"),
    ({"llama.block_count": "2"}, "llama.block_count is '2', expected a positive integer"),
    ({"llama.block_count": 0}, "expected a positive integer"),
    ({"llama.context_length": 2**31 - 1}, "context length 2,147,483,647 is more than tinyllm supports"),
    ({"llama.attention.layer_norm_rms_epsilon": "tiny"}, "expected a finite positive number"),
    ({"llama.attention.head_count": 3}, "n_heads (3) must be a multiple of n_kv_heads (2)"),
    ({"tokenizer.ggml.tokens": 7}, "'tokenizer.ggml.tokens' is not a list of str"),
    ({"tokenizer.ggml.merges": [1, 2]}, "'tokenizer.ggml.merges' is not a list of str"),
    ({"tokenizer.ggml.pre": 5}, "'tokenizer.ggml.pre' is not str"),
    ({"tokenizer.ggml.eos_token_id": "2"}, "'tokenizer.ggml.eos_token_id' is not int"),
])
def test_gguf_bad_metadata_is_one_line(tmp_path, metadata, message):
    path = tmp_path / "bad.gguf"
    tiny_llama(path, metadata=metadata)
    assert message in str(one_line_error(path))


def tensor_index_field(path, tensor: str, field: str) -> int:
    """Byte offset of one field of a tensor's index entry: "dim0", "dim1", "type" or "offset"."""
    data = path.read_bytes()
    at = data.index(struct.pack("<Q", len(tensor)) + tensor.encode()) + 8 + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return {"dim0": at + 4, "dim1": at + 12, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}[field]


@pytest.mark.parametrize("field, value, message", [
    ("dim0", 2**63, "beyond any real model"),
    ("dim1", 2**64 - 1, "beyond any real model"),
    ("dim1", 2**39, "truncated in the tensor data"),
    ("offset", 2**63, "truncated in the tensor data"),
    ("type", 99, "unknown ggml type id 99"),
])
def test_gguf_bad_tensor_index_is_one_line(tmp_path, field, value, message):
    path = tmp_path / "bad.gguf"
    tiny_llama(path)
    data = bytearray(path.read_bytes())
    at = tensor_index_field(path, "blk.0.ffn_up.weight", field)
    struct.pack_into("<I" if field == "type" else "<Q", data, at, value)
    path.write_bytes(bytes(data))
    assert message in str(one_line_error(path))


@pytest.mark.parametrize("cut", ["length", "text", "huge length"])
def test_gguf_vocab_cut_short_is_one_line(tmp_path, cut):
    """The vocab's strings are read in one fast loop (gguf._Cursor.strings): a file that ends inside one, or a
    length past the end, still gives the truncation message."""
    path = tmp_path / "bad.gguf"
    tiny_llama(path)
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(b"<|endoftext|>")) + b"<|endoftext|>")  # a token of the vocab array
    if cut == "huge length":
        struct.pack_into("<Q", data, at, 2**63)
    else:
        del data[at + (4 if cut == "length" else 10):]
    path.write_bytes(bytes(data))
    assert "truncated in the metadata" in str(one_line_error(path))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused_with_its_name(tmp_path, value):
    path = tmp_path / "nan.gguf"
    tensors = tiny_llama(path)
    data = bytearray(path.read_bytes())
    target = tensors["blk.1.attn_v.weight"].tobytes()                 # written as F32: find its bytes
    at = data.index(target) + 4 * 37
    struct.pack_into("<f", data, at, value)
    path.write_bytes(bytes(data))
    err = one_line_error(path)
    assert "'layers.1.wv' holds a non-finite value" in str(err) and "index 37" in str(err)


# --- Hugging Face: targeted ----------------------------------------------------------------------------------
def break_json(path, change):
    value = json.loads(path.read_text())
    path.write_text(json.dumps(change(value)))


@pytest.mark.parametrize("change, message", [
    (lambda c: [c], "config.json holds a JSON list, not an object"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "config.json has no 'hidden_size'"),
    (lambda c: c | {"num_hidden_layers": "2"}, "'num_hidden_layers' is '2', expected a positive integer"),
    (lambda c: c | {"vocab_size": 2.5}, "'vocab_size' is 2.5"),
    (lambda c: c | {"rms_norm_eps": [1]}, "'rms_norm_eps' is [1], expected a finite positive number"),
    (lambda c: c | {"rope_scaling": "linear"}, "rope_scaling is 'linear', expected an object"),
    (lambda c: c | {"tie_word_embeddings": "yes"}, "'tie_word_embeddings' is 'yes', expected true or false"),
    (lambda c: c | {"max_position_embeddings": 2**40}, "is more than tinyllm supports"),
])
def test_hf_bad_config_is_one_line(tmp_path, change, message):
    tiny_hf_llama(tmp_path)
    break_json(tmp_path / "config.json", change)
    assert message in str(one_line_error(tmp_path))


@pytest.mark.parametrize("weight_map", [["a"], "x", {"model.norm.weight": 3}, {"model.norm.weight": "../x"}])
def test_hf_bad_index_is_one_line(tmp_path, weight_map):
    tiny_hf_llama(tmp_path, sharded=True)
    break_json(tmp_path / "model.safetensors.index.json", lambda i: {"weight_map": weight_map})
    assert "weight_map" in str(one_line_error(tmp_path)) or "shard name is a path" in str(one_line_error(tmp_path))


def safetensors_with_header(path, header) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))


@pytest.mark.parametrize("header, message", [
    (["not", "an", "object"], "header is a JSON list, not an object"),
    ({"t": "x"}, "tensor 't' has entry 'x' instead of an object"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [8, 0]}}, "data_offsets [8, 0]"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**64]}}, "truncated in tensor 't'"),
    ({"t": {"dtype": "F32", "shape": [2**63], "data_offsets": [0, 16]}}, "shape [9223372036854775808]"),
    ({"t": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, "16 bytes for shape (5,)"),
    ({"t": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, "dtype ['F32']"),
    ({"t": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, "dtype 'I64'"),
])
def test_safetensors_bad_header_is_one_line(tmp_path, header, message):
    tiny_hf_llama(tmp_path)
    safetensors_with_header(tmp_path / "model.safetensors", header)
    assert message in str(one_line_error(tmp_path, tmp_path / "model.safetensors"))


def test_hf_broken_tokenizer_json_is_one_line(tmp_path):
    tiny_hf_llama(tmp_path)
    break_json(tmp_path / "tokenizer.json", lambda t: t | {"model": {"type": "BPE", "merges": []}})
    assert "tokenizer.json: cannot build the tokenizer: missing key 'vocab'" in str(one_line_error(tmp_path))


# --- quantization of the head (issue 15, item 9) -------------------------------------------------------------
def test_q4_1_keeps_an_8_bit_head_unless_asked(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_llama(path, dim=64, n_heads=4, ffn=64)
    default = tinyllm.load(path, quant="q4_1")
    assert isinstance(default.tok_embed, Int8Block) and default.lm_head is default.tok_embed
    assert isinstance(default.layers[0].wqkv, Q4Block)
    four_bit = tinyllm.load(path, quant="q4_1", head_quant="q4_1")
    assert isinstance(four_bit.tok_embed, Q4Block) and four_bit.weight_bytes < default.weight_bytes
    ids = default.tokenizer.encode("hello hello")
    for backend in ("numba", "numpy"):                               # the 4-bit head still runs on both paths
        four_bit.backend = default.backend = backend
        a, b = four_bit.logits(ids), default.logits(ids)
        assert np.isfinite(a).all() and 0 < np.abs(a - b).max() < 0.5 * np.abs(b).max()
    with pytest.raises(ValueError, match="head_quant='q4_1' needs quantized matrices"):
        tinyllm.load(path, head_quant="q4_1")
    with pytest.raises(ValueError, match="unknown head_quant 'q3'"):
        tinyllm.load(path, quant="q4_1", head_quant="q3")


# --- fuzzing -------------------------------------------------------------------------------------------------
def loads_or_fails_in_one_line(path) -> bool:
    """True if `path` loaded (then its model must run), False if it failed with a one-line CheckpointError.
    Any other exception fails the test (pytest shows it)."""
    try:
        config, weights, tokenizer, _ = load_checkpoint(path)
    except CheckpointError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        return False
    model = tinyllm.Transformer(config, weights, tokenizer, backend="numpy")
    ids = list(range(min(3, config.context_length, config.vocab_size)))
    with np.errstate(all="ignore"):                  # flipped exponent bits make finite but huge weights
        assert model.logits(ids).shape == (len(ids), config.vocab_size)
    return True


class RecordingCursor(gguf._Cursor):
    """The GGUF reader's cursor, recording where every integer field of the file is (to set it to extremes)."""
    fields: list[tuple[int, int]] = []

    def scalar(self, fmt: str):
        if fmt in ("<I", "<Q"):
            RecordingCursor.fields.append((self.pos, struct.calcsize(fmt)))
        return super().scalar(fmt)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    tiny_llama(path, n_layers=1)
    RecordingCursor.fields = []
    real, gguf._Cursor = gguf._Cursor, RecordingCursor
    try:
        gguf.GGUFFile(path)
    finally:
        gguf._Cursor = real
    return path, path.read_bytes(), list(RecordingCursor.fields)


def mutations(data: bytes, fields: list[tuple[int, int]], rng: random.Random, n: int):
    """n mutated copies of `data`: an integer field set to an extreme, bit flips, a truncation, or a mix."""
    for _ in range(n):
        out, kind = bytearray(data), rng.choice(["field", "field", "flip", "truncate", "mix"])
        if kind in ("field", "mix"):
            at, size = rng.choice(fields)
            value = rng.choice(SPECIAL_VALUES) % (1 << (8 * size))
            out[at:at + size] = value.to_bytes(size, "little")
        if kind in ("flip", "mix"):
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(len(out)) if rng.random() < 0.3 else rng.randrange(min(len(out), 8192))
                out[at] ^= 1 << rng.randrange(8)
        if kind in ("truncate", "mix") and rng.random() < 0.7:
            out = out[:rng.randrange(len(out))]
        yield kind, bytes(out)


def test_fuzz_gguf_reader(gguf_file, tmp_path):
    path, data, fields = gguf_file
    rng = random.Random(15)
    cases = [("field", at, size, value) for at, size in fields[:40] for value in SPECIAL_VALUES]   # the header
    loaded = 0
    for _, at, size, value in cases:
        out = bytearray(data)
        out[at:at + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
        (tmp_path / "m.gguf").write_bytes(bytes(out))
        loaded += loads_or_fails_in_one_line(tmp_path / "m.gguf")
    for _, out in mutations(data, fields, rng, 1200):
        (tmp_path / "m.gguf").write_bytes(out)
        loaded += loads_or_fails_in_one_line(tmp_path / "m.gguf")
    assert loaded > 0                                                    # some flips only touch weight values


JSON_EXTREMES = [0, 1, 2, -1, 2**31, 2**63, 2**64 - 1, 2**64, 1e308, "x", "", None, True, [], {}, [1, 2], {"a": 1}]


def json_mutations(value, rng: random.Random):
    """One random leaf (or container) of a JSON value replaced by an extreme value or a wrong type."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return value | {key: json_mutations(value[key], rng)} if rng.random() < 0.9 else {
            k: v for k, v in value.items() if k != key}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [json_mutations(value[i], rng)] + value[i + 1:]
    return rng.choice(JSON_EXTREMES)


def test_fuzz_hf_loader(tmp_path):
    rng = random.Random(15)
    directory = tmp_path / "hf"
    directory.mkdir()
    tiny_hf_llama(directory, n_layers=1, sharded=True)
    originals = {p.name: p.read_bytes() for p in directory.iterdir()}
    shard = next(n for n in originals if n.startswith("model-00001"))
    loaded = 0
    for _ in range(300):
        for name, raw in originals.items():
            (directory / name).write_bytes(raw)
        name = rng.choice(["config.json", "model.safetensors.index.json", "tokenizer.json", shard, shard])
        raw = originals[name]
        if name.endswith(".json"):
            mutated = json.dumps(json_mutations(json.loads(raw), rng)).encode()
        else:
            n = struct.unpack("<Q", raw[:8])[0]
            header = json.loads(raw[8:8 + n])
            kind = rng.choice(["json", "json", "flip", "truncate", "length"])
            if kind == "json":
                new = json.dumps(json_mutations(header, rng)).encode()
                mutated = struct.pack("<Q", len(new)) + new + raw[8 + n:]
            elif kind == "flip":
                out = bytearray(raw)
                for _ in range(rng.randint(1, 8)):
                    out[rng.randrange(min(len(out), 8 + n + 64))] ^= 1 << rng.randrange(8)
                mutated = bytes(out)
            elif kind == "truncate":
                mutated = raw[:rng.randrange(len(raw))]
            else:
                mutated = (rng.choice(SPECIAL_VALUES) % 2**64).to_bytes(8, "little") + raw[8:]
        (directory / name).write_bytes(mutated)
        loaded += loads_or_fails_in_one_line(directory)
    assert loaded > 0


def test_safetensors_single_file_header_fuzz(tmp_path):
    """The same for a single model.safetensors (not sharded): write_safetensors headers with mutated fields."""
    rng = random.Random(16)
    tensors = {"model.norm.weight": np.ones(4, np.float32), "x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = tmp_path / "model.safetensors"
    for _ in range(200):
        write_safetensors(path, tensors)
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        new = json.dumps(json_mutations(json.loads(raw[8:8 + n]), rng)).encode()
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
        try:
            from tinyllm.weights import read_safetensors
            out = read_safetensors(path)
        except CheckpointError as e:
            assert "\n" not in str(e) and str(path) in str(e)
        else:
            assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in out.values())


def overflowing_model(path):
    """A tiny GGUF whose finite weights overflow float32 in the forward pass (one matrix of 3e38)."""
    tensors = tiny_llama(path)
    data = bytearray(path.read_bytes())
    w = tensors["blk.0.ffn_up.weight"]
    at = data.index(w.tobytes())
    data[at:at + w.nbytes] = np.full(w.size, 3e38, np.float32).tobytes()
    path.write_bytes(bytes(data))
    return path


def test_weights_that_overflow_stop_generation_with_a_clear_error(tmp_path):
    model = tinyllm.load(overflowing_model(tmp_path / "huge.gguf"), backend="numpy")   # finite: it loads
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="logits hold NaN or infinity"):
        tinyllm.generate(model, "hello", max_new_tokens=2)
