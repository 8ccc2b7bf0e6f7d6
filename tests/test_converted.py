"""The converted-model cache (tinyllm/converted.py): a mapped load gives exactly what converting gives, and a stale,
damaged or hostile entry is never used."""
import hashlib
import json
import mmap
import os
import struct

import numpy as np
import pytest

import tinyllm
from tinyllm import converted
from tinyllm.quant import QuantizedWeight
from tinyllm.weights import load_checkpoint
from tiny_gguf import tiny_llama

TEXT = "hello hell, <|im_start|>user\nhi<|im_end|> \u00e9\U0001F600"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TINYLLM_CONVERTED", str(folder))
    return folder


def entries(folder):
    converted.wait_for_saves()                          # (the loads write in a thread)
    return sorted(folder.glob("*.tinyllm")) if folder.exists() else []


def mapped(a) -> bool:
    """Whether the array's memory is a mapped file."""
    while isinstance(a, (np.ndarray, memoryview)):
        a = a.base if isinstance(a, np.ndarray) else a.obj
    return isinstance(a, mmap.mmap)


def arrays_of(w):
    return w.arrays if isinstance(w, QuantizedWeight) else (w,)


def assert_same_checkpoint(a, b):
    (config_a, weights_a, tok_a, report_a), (config_b, weights_b, tok_b, report_b) = a, b
    assert config_a == config_b and report_a == report_b
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert type(weights_a[name]) is type(weights_b[name]), name
        for x, y in zip(arrays_of(weights_a[name]), arrays_of(weights_b[name]), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert tok_a.tables() == tok_b.tables()
    assert tok_a.encode(TEXT, allow_special=True) == tok_b.encode(TEXT, allow_special=True)


@pytest.mark.parametrize("quant", [None, "int8", "int8-block", "q4_1", "q4_k"])
def test_a_second_load_maps_what_the_first_converted(tmp_path, cache, quant):
    path = tmp_path / "m.gguf"
    tiny_llama(path, ffn=64)                            # rows of whole 32-value blocks
    first = load_checkpoint(path, quant)
    assert len(entries(cache)) == 1
    second = load_checkpoint(path, quant)
    assert_same_checkpoint(first, second)
    for w in second[1].values():
        for a in arrays_of(w):
            # a view of the mapped file, typed as the kernels expect (writable, aligned, contiguous: no recompile)
            assert mapped(a) and a.flags.writeable and a.flags.aligned and a.flags.c_contiguous
    assert not any(mapped(a) for w in first[1].values() for a in arrays_of(w))
    m1 = tinyllm.Transformer(*first[:3], backend="numpy", quant=quant)
    m2 = tinyllm.Transformer(*second[:3], backend="numpy", quant=quant)
    tokens = np.array(first[2].encode("hello hell"))
    assert np.array_equal(m1.forward(tokens, m1.new_cache()), m2.forward(tokens, m2.new_cache()))


def test_each_format_has_its_own_entry_and_off_writes_none(tmp_path, cache, monkeypatch):
    path = tmp_path / "m.gguf"
    tiny_llama(path, ffn=64)
    load_checkpoint(path, None)
    load_checkpoint(path, "fp32")                       # the same format as None: the same entry
    load_checkpoint(path, "q4_1")
    load_checkpoint(path, "q4_1", head_quant="fp32")
    assert len(entries(cache)) == 3
    monkeypatch.setenv("TINYLLM_CONVERTED", "off")
    assert converted.entry_path(path, None, None) is None
    load_checkpoint(path, "int8")
    assert len(entries(cache)) == 3


def test_a_changed_model_file_or_converting_code_is_converted_again(tmp_path, cache, monkeypatch):
    path = tmp_path / "m.gguf"
    tiny_llama(path, seed=0)
    load_checkpoint(path)
    (old,) = entries(cache)
    tiny_llama(path, seed=1)                            # the same size, other weights
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fresh = load_checkpoint(path)
    expected = tiny_llama(tmp_path / "other.gguf", seed=1)["output_norm.weight"]
    assert np.array_equal(fresh[1]["final_norm"], expected)
    (new,) = entries(cache)                             # the stale entry is gone
    assert new != old
    monkeypatch.setattr(converted, "_source_hash", lambda: "edited")
    assert converted.load(path, None, None) is None


def test_entries_of_a_deleted_model_file_go_when_another_is_written(tmp_path, cache):
    gone, kept = tmp_path / "gone.gguf", tmp_path / "kept.gguf"
    tiny_llama(gone)
    tiny_llama(kept, seed=1)
    load_checkpoint(gone)
    (entry,) = entries(cache)
    gone.unlink()
    load_checkpoint(kept)
    assert entries(cache) != [] and entry not in entries(cache)


@pytest.mark.parametrize("damage", ["truncated", "bad magic", "header bit flip", "header not json",
                                    "header past the end", "object dtype", "other key", "array past the end"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(tmp_path, cache, damage):
    path = tmp_path / "m.gguf"
    tiny_llama(path)
    good = load_checkpoint(path)
    (entry,) = entries(cache)
    data = bytearray(entry.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[48:48 + n])                # after the magic, the length and the header's sha256

    def with_header(h):                                 # an edited header, hashed as the writer would
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * (n - len(text))                  # the same length: the arrays stay where they are
        assert len(text) == n, "the edited header fits where the old one was"
        return data[:16] + hashlib.sha256(text).digest() + text + data[48 + n:]
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "bad magic":
        data[:8] = b"NOTMINE!"
    elif damage == "header bit flip":                  # valid JSON still, but not what was hashed
        at = data.index(b'"n_layers": 2', 48)
        data[at + 12] = ord("9")
    elif damage == "header not json":
        data = with_header(header)
        data[48:52] = b"\xff\xfe{["
        data[16:48] = hashlib.sha256(data[48:48 + n]).digest()
    elif damage == "header past the end":
        data[8:16] = struct.pack("<Q", len(data))
    elif damage == "object dtype":
        header["weights"]["final_norm"]["arrays"][0][0] = "|O"
        data = with_header(header)
    elif damage == "other key":
        header["key"]["quant"] = "int8"
        data = with_header(header)
    elif damage == "array past the end":
        header["weights"]["final_norm"]["arrays"][0][2] = len(data)
        data = with_header(header)
    entry.write_bytes(bytes(data))
    assert converted.load(path, None, None) is None
    assert_same_checkpoint(good, load_checkpoint(path))  # converted again...
    assert converted.load(path, None, None) is not None  # ...and the entry whole again


def test_an_abandoned_save_leaves_no_partial_file(tmp_path, cache, monkeypatch):
    path = tmp_path / "m.gguf"
    tiny_llama(path)
    monkeypatch.setattr(converted, "_abandon", converted.threading.Event())
    converted._abandon.set()                            # as after Ctrl-C: the writer stops at its first array
    load_checkpoint(path)
    assert entries(cache) == [] and list(cache.iterdir()) == []
    converted._abandon.clear()
    load_checkpoint(path)
    assert len(entries(cache)) == 1


def test_a_cache_that_cannot_be_written_says_so_and_loads(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TINYLLM_CONVERTED", str(blocker / "cache"))   # under a file: mkdir fails
    path = tmp_path / "m.gguf"
    tiny_llama(path)
    config, weights, tokenizer, _ = load_checkpoint(path)
    converted.wait_for_saves()
    err = capsys.readouterr().err
    assert "could not keep the converted model" in err and len(err.strip().splitlines()) == 1
    assert config.n_layers == 2 and tokenizer.encode("hell") == [tokenizer.tables()["token_bytes"].index(b"hell")]


@pytest.mark.slow
def test_the_default_model_mapped_generates_what_it_converted_to(default_model_path, cache):
    """The real model in its own format: converted once, mapped once, the same weights, tables and tokens."""
    first = load_checkpoint(default_model_path, "native")
    second = load_checkpoint(default_model_path, "native")
    assert_same_checkpoint(first, second)
    outs = [tinyllm.generate(tinyllm.Transformer(*c[:3], quant="native"), "The capital of France is",
                             max_new_tokens=8).token_ids for c in (first, second)]
    assert outs[0] == outs[1]
