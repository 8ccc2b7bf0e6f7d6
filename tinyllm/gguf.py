"""GGUF reader: header, metadata, tensor index, memory-mapped tensor data, and dequantization.

GGUF (llama.cpp's file format) is one file holding everything a model needs:

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type: u32, value)          <- metadata (config, tokenizer, chat template)
    tensor_count x (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32)
    tensor data (each tensor at data_start + offset, aligned)

Strings are (u64 length, UTF-8 bytes). Dims are in ggml order: dims[0] is the fastest-varying axis, so a
matrix listed as [576, 49152] is 49152 rows of 576 values; numpy's shape is the reverse.

Quantized types store blocks of 32 values (formats below at `dequantize`), or super-blocks of 256 (the K-quants,
kquants.py). This module reads GGUF v2/v3 and dequantizes F32, F16, BF16, Q8_0, Q4_0 and Q4_1 here, Q5_0, Q5_1,
Q2_K .. Q6_K, IQ4_NL and IQ4_XS with kquants.py; other types are listed but raise a clear error when read.
It deliberately does not write GGUF files.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .kquants import DEQUANTIZERS

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")
QK = 32  # values per block in Q8_0 / Q4_0 / Q4_1
MAX_DIM = 1 << 40      # a tensor dim at or above this is corruption (keeps numpy shapes and byte counts in range)
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are corruption (real files nest at most 1 level)


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated, or uses something this reader does not support."""


# --- metadata value types (gguf_type in ggml's gguf.h) ------------------------------------------------------
_SCALAR_FORMATS = {  # type id -> (struct format, python name)
    0: ("<B", "uint8"), 1: ("<b", "int8"), 2: ("<H", "uint16"), 3: ("<h", "int16"),
    4: ("<I", "uint32"), 5: ("<i", "int32"), 6: ("<f", "float32"), 7: ("<?", "bool"),
    10: ("<Q", "uint64"), 11: ("<q", "int64"), 12: ("<d", "float64"),
}
_STRING, _ARRAY = 8, 9

# --- tensor types (ggml_type): name, values per block, bytes per block --------------------------------------
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
BLOCK_BYTES = {name: block_bytes for name, _, block_bytes in GGML_TYPES.values()}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1") + tuple(DEQUANTIZERS)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index. `shape` is numpy order (slowest axis first)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Sequential little-endian reader over a buffer that names the region it is in when it runs out."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.region = buf, 0, path, "header"

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFError(
                f"{self.path}: file is truncated in the {self.region} (needs byte {end:,}, file has "
                f"{len(self.buf):,}); the download is incomplete: fetch the file again"
            )
        view = memoryview(self.buf)[self.pos:end]
        self.pos = end
        return view

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a string in the {self.region} is not valid UTF-8 (file corrupt)") from None

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocab and its merges: 98,000 of them) in one tight loop: calling `string`
        per item would make this most of a load's time."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        raw = []
        for _ in range(count):
            end = pos + 8 + (length_at(buf, pos)[0] if pos + 8 <= size else 0)
            if end > size:
                self.pos = pos
                self.string()                                    # runs past the end: raises the truncation error
            raw.append(buf[pos + 8:end])
            pos = end
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a string in the {self.region} is not valid UTF-8 (file corrupt)") from None

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR_FORMATS:  # numeric arrays: one struct call, not `count` of them
                fmt = _SCALAR_FORMATS[etype][0]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * size)))
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:
                if depth >= MAX_ARRAY_NESTING:
                    raise GGUFError(f"{self.path}: metadata arrays nested more than {MAX_ARRAY_NESTING} deep in the "
                                    f"{self.region} (file corrupt?)")
                return [self.value(_ARRAY, depth + 1) for _ in range(count)]
            raise GGUFError(f"{self.path}: unknown array element type {etype} in the {self.region} (file corrupt?)")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in the {self.region} (file corrupt?)")


class GGUFFile:
    """A parsed GGUF file: `.metadata` (dict), `.tensors` (name -> TensorInfo), `.tensor(name)` (fp32 array).

    Tensor data stays memory-mapped: nothing is read until a tensor is asked for.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size == 0:
                    raise GGUFError(f"{self.path}: file is empty; fetch it again")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        cur = _Cursor(self._mmap, self.path)
        magic = bytes(cur.take(4))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (only 2 and 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")

        cur.region = "metadata"
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))

        cur.region = "tensor index"
        raw_index = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims (max 4): file corrupt?")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            if any(d >= MAX_DIM for d in dims):
                raise GGUFError(f"{self.path}: tensor {name!r} has dims {dims}, beyond any real model (file corrupt?)")
            raw_index.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not (type(self.alignment) is int and self.alignment > 0 and self.alignment & (self.alignment - 1) == 0):
            raise GGUFError(f"{self.path}: general.alignment is {self.alignment!r}, not a power of two (file corrupt?)")
        data_start = -(-cur.pos // self.alignment) * self.alignment  # round up to the alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, rel_offset in raw_index:
            if type_id not in GGML_TYPES:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}")
            type_name, block, block_bytes = GGML_TYPES[type_id]
            n = math.prod(dims)   # Python ints: a corrupt dim cannot overflow here
            if dims and dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of "
                                f"the {type_name} block size {block}")
            info = TensorInfo(name, tuple(int(d) for d in reversed(dims)), type_name,
                              data_start + rel_offset, n // block * block_bytes)
            if info.offset + info.nbytes > len(self._mmap):
                raise GGUFError(
                    f"{self.path}: file is truncated in the tensor data (tensor {name!r} ends at byte "
                    f"{info.offset + info.nbytes:,}, file has {len(self._mmap):,}); fetch the file again"
                )
            self.tensors[name] = info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map (no copy)."""
        info = self._info(name)
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to a new float32 array of `info.shape`."""
        info = self._info(name)
        return dequantize(self.raw(name), info.type_name, info.shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages of the file from this process's memory (once its data has been copied out): a
        load then never holds the whole file and the whole model at once. Reading the tensor again re-reads them."""
        info = self._info(name)
        start = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = info.offset + info.nbytes - (info.offset + info.nbytes) % mmap.PAGESIZE   # whole pages inside only
        if end > start and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor named {name!r} in this file")
        return self.tensors[name]

    def close(self) -> None:
        self._mmap.close()


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Turn a tensor's raw bytes into float32 values of `shape`.

    Block formats of 32 values here (within a block, value j is in byte j's low nibble, value j+16 in its high;
    the others: kquants.py):
      Q8_0: f16 d, int8 q[32]            -> x = d * q                          (34 bytes)
      Q4_0: f16 d, 16 bytes of nibbles    -> x = d * (q - 8)                   (18 bytes)
      Q4_1: f16 d, f16 m, 16 bytes nibbles -> x = d * q + m                     (20 bytes)
    """
    if type_name not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED_TYPES)}); "
                        f"convert the model to one of those, e.g. with llama.cpp's llama-quantize")
    if type_name == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":  # bf16 is the top half of an fp32: shift it back into place
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if type_name in DEQUANTIZERS:
        with np.errstate(invalid="ignore", over="ignore"):          # a corrupt scale: weights.check_finite names it
            return DEQUANTIZERS[type_name](raw.reshape(-1, BLOCK_BYTES[type_name])).reshape(shape)

    # Each value is written straight into the output, so a load holds no temporary copy of a tensor.
    blocks = raw.reshape(-1, BLOCK_BYTES[type_name])                # [n_blocks, block_bytes]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)   # [n_blocks, 1] scale
    out = np.empty((blocks.shape[0], QK), dtype=np.float32)         # [n_blocks, 32]
    with np.errstate(invalid="ignore", over="ignore"):              # a corrupt scale: weights.check_finite names it
        if type_name == "Q8_0":
            np.multiply(blocks[:, 2:].view(np.int8), d, out=out)
            return out.reshape(shape)
        nibbles = blocks[:, -16:]                                   # [n_blocks, 16]
        if type_name == "Q4_0":                                     # centred on 8: (q - 8) * d, as ggml rounds it
            np.multiply((nibbles & 0x0F).view(np.int8) - np.int8(8), d, out=out[:, :16])
            np.multiply((nibbles >> 4).view(np.int8) - np.int8(8), d, out=out[:, 16:])
            return out.reshape(shape)
        np.multiply(nibbles & 0x0F, d, out=out[:, :16])             # values 0..15 times the scale
        np.multiply(nibbles >> 4, d, out=out[:, 16:])
        out += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)   # Q4_1 adds a stored minimum
    return out.reshape(shape)
