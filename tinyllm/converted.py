"""The converted model, kept on disk: a second load maps it instead of converting the file again.

Loading a GGUF file converts it: Q4_1 blocks become float32 (or are repacked, or requantized), q/k/v rows are
reordered and fused, and the tokenizer's 49,000 tokens and merges are parsed into lookup tables. That costs
0.3-1 s on every start (benchmarks/RESULTS.md, "Startup"). So the first load in a format writes the result to one
file in the cache folder, and later loads map that file (llama.cpp's way of loading: the file holds the arrays as
the kernels read them, so nothing is read or copied at load; the pages come in when the forward pass first
touches them, and processes running the same model share them).

    file   = b"TINYLLM1" | u64 header length | sha256 of the header | header (JSON) | zeros to 64 bytes | arrays
    header = {"key", "config", "report", "weights": {name: {"class", "arrays": [[dtype, shape, offset], ...]}},
              "tokenizer": {"fields", "arrays": [bytes, starts, merges]}}    (offsets from the arrays' start)

An entry is valid only for the same model file (path, size, inode, change times), the same formats, and the same
source of the code that converts (CONVERTING_SOURCES: weights.py, quant.py, gguf.py, the tokenizer's): editing
any of them starts a new entry, and the stale one is deleted when the new one is written (so are entries whose
model file is gone). A file that is short,
or whose header does not match its hash, parse or match the key, is a miss: the model is converted again and the
entry rewritten. (The header's hash guards the shapes and offsets the kernels will trust; a flipped bit in the
arrays would give wrong numbers, not a crash.)
No pickle: the header is JSON, the arrays are raw bytes with their dtype and shape in the header.

The folder is ~/.cache/tinyllm/converted ($TINYLLM_CACHE/converted when that is set, beside the tokenizer suite);
TINYLLM_CONVERTED=<folder> moves it, TINYLLM_CONVERTED=off turns the cache off.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .quant import Int8Block, Int8Channel, Q4Block, Q4KBlock, Q5Block, Q6KBlock, QuantizedWeight
from .tokenizer import Tokenizer

MAGIC = b"TINYLLM1"
PREAMBLE = len(MAGIC) + 8 + 32   # magic, header length, header hash
ALIGN = 64          # every array starts on a cache line (and the kernels' loads are aligned as in memory)
WEIGHT_CLASSES = {cls.__name__: cls for cls in (Int8Channel, Int8Block, Q4Block, Q4KBlock, Q5Block, Q6KBlock)}
CONVERTING_SOURCES = ("weights.py", "quant.py", "gguf.py", "kquants.py", "gguf_weights.py", "checkpoint.py",
                      "vocab_files.py", "tokenizer.py", "pretokenize.py", "config.py", "converted.py")


def cache_dir() -> Path | None:
    """The folder converted models are kept in: $TINYLLM_CONVERTED, else $TINYLLM_CACHE/converted, else
    ~/.cache/tinyllm/converted; None when TINYLLM_CONVERTED=off."""
    setting = os.environ.get("TINYLLM_CONVERTED", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("TINYLLM_CACHE") or Path.home() / ".cache" / "tinyllm") / "converted"


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of the code that converts a model: an entry written by other code is not used."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in CONVERTING_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def entry_path(model_path: Path, quant: str | None, head_quant: str | None) -> tuple[Path, dict] | None:
    """(where the converted model_path in these formats is kept, the key its header must hold), or None when the
    cache is off."""
    folder = cache_dir()
    if folder is None:
        return None
    model_path = model_path.resolve()
    stat = model_path.stat()
    key = dict(model=str(model_path), size=stat.st_size, mtime_ns=stat.st_mtime_ns, ctime_ns=stat.st_ctime_ns,
               inode=stat.st_ino, quant=quant or "fp32", head_quant=head_quant, source=_source_hash())
    formats = f"{key['quant']}-{head_quant}" if head_quant else key["quant"]
    name_hash = hashlib.sha256(str(model_path).encode()).hexdigest()[:8]
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return folder / f"{model_path.stem}.{name_hash}.{formats}.{key_hash}.tinyllm", key


_saving: dict[Path, threading.Thread] = {}     # entry -> the thread writing it
_abandon = threading.Event()                   # set: writers stop and delete what they wrote


class _Abandoned(Exception):
    pass


def save_in_background(model_path: Path, quant: str | None, head_quant: str | None, *converted_model) -> None:
    """`save` in a thread: writing 0.1-0.5 GB can take seconds on a slow disk, which a first run spends compiling
    and a warm one generating. The interpreter waits for it at exit (a script that leaves with os._exit calls
    `wait_for_saves` first), and a load of the same entry waits for it."""
    found = entry_path(model_path, quant, head_quant)
    if found is not None:
        thread = threading.Thread(target=_write, args=(*found, *converted_model), name="tinyllm-save-converted")
        _saving[found[0]] = thread
        thread.start()


def wait_for_saves(abandon: bool = False) -> None:
    """Return once every converted model this process is writing is written, or (abandon=True: the user pressed
    Ctrl-C) once each writer has stopped after its current array and deleted its partial file."""
    if abandon:
        _abandon.set()
    while _saving:
        _saving.popitem()[1].join()


def load(model_path: Path, quant: str | None, head_quant: str | None):
    """-> (config, weights, tokenizer, quant_report) mapped from the cache, or None (off, absent, stale, damaged)."""
    found = entry_path(model_path, quant, head_quant)
    if found is not None and (writer := _saving.pop(found[0], None)) is not None:
        writer.join()
    if found is None or not found[0].is_file():
        return None
    path, key = found
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # writable pages, private to this process
        header, start = _read_header(data)
        if header.get("key") != key:
            return None
        arrays = lambda specs: [_array(data, start, spec) for spec in specs]    # noqa: E731
        weights = {}
        for name, entry in header["weights"].items():
            stored = arrays(entry["arrays"])
            weights[name] = stored[0] if entry["class"] == "ndarray" else WEIGHT_CLASSES[entry["class"]](*stored)
        tokenizer = _tokenizer(header["tokenizer"]["fields"], *arrays(header["tokenizer"]["arrays"]))
        config = ModelConfig(**header["config"])
        report = [dict(r, shape=tuple(r["shape"])) for r in header["report"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError, struct.error):
        return None                         # damaged or from another layout: converted again, and rewritten
    return config, weights, tokenizer, report


def save(model_path: Path, quant: str | None, head_quant: str | None, config: ModelConfig, weights: dict,
         tokenizer: Tokenizer, report: list[dict]) -> Path | None:
    """Write the converted model to the cache (atomically: a reader sees the old entry or the whole new one) and
    delete stale entries of the same model and formats. -> its path, or None (cache off, or it could not be
    written: a note on stderr says why, and loads go on converting)."""
    found = entry_path(model_path, quant, head_quant)
    return None if found is None else _write(*found, config, weights, tokenizer, report)


def _write(path: Path, key: dict, config: ModelConfig, weights: dict, tokenizer: Tokenizer,
           report: list[dict]) -> Path | None:
    layout, offset = [], 0

    def place(a: np.ndarray) -> list:
        nonlocal offset
        offset = -(-offset // ALIGN) * ALIGN
        layout.append((offset, a))
        spec = [a.dtype.str, list(a.shape), offset]
        offset += a.nbytes
        return spec

    header = dict(key=key, config=dataclasses.asdict(config),
                  report=[dict(r, shape=list(r["shape"])) for r in report], weights={})
    for name, w in weights.items():
        stored = w.arrays if isinstance(w, QuantizedWeight) else (w,)
        kind = type(w).__name__ if isinstance(w, QuantizedWeight) else "ndarray"
        header["weights"][name] = {"class": kind, "arrays": [place(np.asarray(a)) for a in stored]}
    fields = tokenizer.tables()
    token_bytes, merges = fields.pop("token_bytes"), fields.pop("merges")
    lengths = np.fromiter(map(len, token_bytes), np.int64, len(token_bytes))
    header["tokenizer"] = {"fields": fields, "arrays": [
        place(np.frombuffer(b"".join(token_bytes), np.uint8)),                     # every token's bytes, in id order
        place(np.concatenate([[0], np.cumsum(lengths)])),                          # [V + 1] where each one starts
        place(np.array(merges, np.int32).reshape(-1, 3))]}                          # [merges, 3] left, right, merged
    text = json.dumps(header).encode("utf-8")
    start = -(-(PREAMBLE + len(text)) // ALIGN) * ALIGN
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".part", delete=False) as f:
            try:
                f.write(MAGIC + struct.pack("<Q", len(text)) + hashlib.sha256(text).digest() + text)
                for at, a in layout:
                    if _abandon.is_set():
                        raise _Abandoned
                    f.seek(start + at)
                    f.write(np.ascontiguousarray(a).data)
                f.truncate(start + offset)
                f.close()
                os.replace(f.name, path)
            except BaseException:
                os.unlink(f.name)
                raise
    except _Abandoned:
        return None
    except OSError as e:
        print(f"tinyllm: could not keep the converted model in {path.parent} ({e.strerror or e}); each load will "
              f"convert the file again (TINYLLM_CONVERTED=off silences this)", file=sys.stderr)
        return None
    stale = f"{path.name.rsplit('.', 2)[0]}."                      # the same model and formats, another key
    for other in path.parent.iterdir():
        if other.suffix == ".tinyllm" and other != path and (other.name.startswith(stale) or _orphaned(other)):
            other.unlink(missing_ok=True)
    return path


def _orphaned(entry: Path) -> bool:
    """Whether the model file `entry` was converted from is gone (a deleted clone or download: its entries would
    only take disk space), or the entry is unreadable."""
    try:
        with open(entry, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return not Path(_read_header(data)[0]["key"]["model"]).exists()
    except (OSError, ValueError, KeyError, TypeError, RecursionError, struct.error):
        return True


def _tokenizer(fields: dict, blob: np.ndarray, starts: np.ndarray, merges: np.ndarray) -> Tokenizer:
    blob, starts = blob.tobytes(), starts.tolist()
    pattern = fields["pattern"]                                     # one regex, or a list of stages (a tuple)
    return Tokenizer(**dict(fields, pattern=pattern if isinstance(pattern, str) else tuple(pattern)),
                     token_bytes=[blob[a:b] for a, b in zip(starts, starts[1:])], merges=merges)


def _read_header(data) -> tuple[dict, int]:
    """(header, where the arrays start); ValueError if the file is not a whole entry."""
    if len(data) < PREAMBLE or data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a converted tinyllm model")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    text = bytes(data[PREAMBLE:PREAMBLE + n])
    if hashlib.sha256(text).digest() != data[PREAMBLE - 32:PREAMBLE]:   # (a header cut short fails too)
        raise ValueError("the header is cut short or damaged")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return header, -(-(PREAMBLE + n) // ALIGN) * ALIGN


def _array(data, start: int, spec) -> np.ndarray:
    """The array `spec` ([dtype, shape, offset]) describes: a view of the mapped file. numpy refuses (ValueError) a
    view past the end of the file and an object dtype (references cannot come from bytes)."""
    dtype, shape = np.dtype(spec[0]), tuple(spec[1])
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(data, dtype, count, start + spec[2]).reshape(shape) if count else np.empty(shape, dtype)
