"""ContiguousKVCache: the keys and values of every past token, so each decode step computes only the new one.

Without a cache, generating token n recomputes K and V for all n earlier tokens (O(n^2) work over a
generation); with it, each step computes one token's K/V and reads the rest back (O(n) memory).

Storage is preallocated once for `max_seq_len` positions: k and v are each [L, S_max, KVH, Dh]. The cost per
token is 2 * L * KVH * Dh * bytes per value (SmolLM2-135M: 2*30*3*64 = 11,520 values: 46,080 bytes in float32).

`kv_dtype` is how each value is stored (llama.cpp keeps K/V in fp16 by default and offers 8-bit; vLLM fp8):
    "float32"  exact                                          46,080 B/token for SmolLM2
    "float16"  rounded to half precision when stored          23,040 B/token
    "int8"     int8 values + a float16 scale per 32 values    12,240 B/token (Q8_0's layout, per position and head)
The values are rounded once, when a token's K/V are written; attention reads the stored format (the kernels
convert as they load; the numpy backend dequantizes first: `attention_inputs`), so every reader sees the same
rounded values. Over an int8 cache, attention rounds q to int8 blocks too (`query_for`), so that the kernels'
q . k runs in integers.
The contract (shared with the paged cache): `update` writes new positions and returns views of the whole
history, `length` counts committed tokens, `truncate` rolls back (speculative decoding's rejected drafts).

A forward pass over several sequences stacks their rows; each sequence is a `Segment` of that pass, and
`attention_groups` says which segments attend together (paged.py's batched decode) and which alone.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import ModelConfig


class Segment(NamedTuple):
    """One sequence's part of a forward pass: its rows of the stacked activations [N, D], its cache (None: the
    no-cache reference forward) and the position of its first row."""
    rows: slice
    cache: object
    start: int

    @property
    def n_tokens(self) -> int:
        return self.rows.stop - self.rows.start

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, ops) -> np.ndarray:
        """Store this pass's k, v ([T, KVH, Dh]) in the cache and attend q [T, H, Dh] to the whole history, with
        `ops` (the numpy reference or the kernels). -> [T, H*Dh]"""
        if self.cache is not None:
            k, v = self.cache.update(layer, self.start, k, v)     # [S, KVH, Dh], S = start + T
        return ops.attention(q, k, v, self.start)


def attention_groups(segments: list[Segment]) -> list:
    """The segments of a pass as the groups that attend together. One-token segments whose caches share one
    paged pool form a single batch (the pool's `decode_batch`: one attention call per layer reads every
    sequence's blocks in place); every other segment attends alone. Each group has `rows` and `attend`."""
    paged = [s for s in segments if s.n_tokens == 1 and getattr(s.cache, "pool", None) is not None]
    if not paged or len({id(s.cache.pool) for s in paged}) > 1:
        return list(segments)
    batched = {id(s) for s in paged}
    return [paged[0].cache.pool.decode_batch(paged)] + [s for s in segments if id(s) not in batched]


# --- how K and V are stored -------------------------------------------------------------------------------------
KV_DTYPES = ("float32", "float16", "int8")
INT8_GROUP = 32   # int8: values per scale (None: one per position and KV head); 32 loses less (benchmarks/kv_dtype.py)


def check_kv_dtype(kv_dtype) -> str:
    """"float32" / "float16" / "int8" (numpy's np.float32, np.float16, np.int8 are accepted too) -> the name."""
    name = kv_dtype
    if kv_dtype is not None and not isinstance(kv_dtype, str):
        try:
            name = np.dtype(kv_dtype).name
        except TypeError:
            pass
    if not isinstance(name, str) or name not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPES)}")
    return name


def int8_group(head_dim: int) -> int:
    """Values that share one int8 scale: the whole head, or INT8_GROUP when set and it divides the head."""
    return INT8_GROUP if INT8_GROUP and head_dim % INT8_GROUP == 0 else head_dim


def bytes_per_value(kv_dtype: str, head_dim: int) -> float:
    """Average bytes one stored K or V value costs, its share of a scale included."""
    kv_dtype = check_kv_dtype(kv_dtype)
    return {"float32": 4.0, "float16": 2.0}.get(kv_dtype, 1.0 + 2.0 / int8_group(head_dim))


def quantize_int8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 rounding in groups of `group` values along the last axis, as llama.cpp's Q8_0: the scale
    max|x| / 127 is stored in float16, and the values are rounded against that stored scale.
    x [..., Dh] -> (q [..., Dh] int8, scales [..., Dh/group] float16), x ~= q * scale. The fused decode block
    (kernels/kv_formats.py) quantizes with the same arithmetic."""
    xg = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], -1, group)         # [..., NG, group]
    scales = (np.max(np.abs(xg), axis=-1) / np.float32(127.0)).astype(np.float16)  # [..., NG]
    d = scales.astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.maximum(d, np.float32(1e-30)), np.float32(0.0))   # [..., NG]
    q = np.clip(np.rint(xg * inv[..., None]), -127, 127)                           # [..., NG, group]
    return q.astype(np.int8).reshape(x.shape), scales


class QuantizedKV:
    """int8 K or V, used like an array of its leading axes: values [..., KVH, Dh] int8 and scales
    [..., KVH, Dh/group] float16 (x ~= value * its group's scale). Indexing the leading axes gives a view of both;
    assigning float32 values quantizes them (`quantize_int8`), assigning a QuantizedKV copies bytes and scales."""
    __slots__ = ("values", "scales")

    def __init__(self, values: np.ndarray, scales: np.ndarray):
        self.values, self.scales = values, scales

    @classmethod
    def zeros(cls, shape: tuple, group: int) -> "QuantizedKV":
        return cls(np.zeros(shape, np.int8), np.zeros(shape[:-1] + (shape[-1] // group,), np.float16))

    @property
    def group(self) -> int:
        return self.values.shape[-1] // self.scales.shape[-1]

    @property
    def shape(self) -> tuple:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def __getitem__(self, index) -> "QuantizedKV":
        return QuantizedKV(self.values[index], self.scales[index])

    def __setitem__(self, index, x) -> None:
        if isinstance(x, QuantizedKV):                   # a copy of stored values (copy-on-write): bytes as they are
            self.values[index], self.scales[index] = x.values, x.scales
        else:
            self.values[index], self.scales[index] = quantize_int8(np.asarray(x, np.float32), self.group)

    def reshape(self, *shape) -> "QuantizedKV":
        """A view with new leading axes (the last, Dh, stays)."""
        return QuantizedKV(self.values.reshape(shape), self.scales.reshape(shape[:-1] + (self.scales.shape[-1],)))

    def dequantize(self) -> np.ndarray:
        """-> float32 [..., KVH, Dh]: every value times its group's scale."""
        scale = np.repeat(self.scales.astype(np.float32), self.group, axis=-1)    # [..., KVH, Dh]
        return self.values.astype(np.float32) * scale


def kv_storage(shape: tuple, kv_dtype: str, mapped: bool = False):
    """Zeroed storage for K or V of `shape` [..., KVH, Dh]: a float32 / float16 array, or a QuantizedKV.
    mapped: write the zeros now, so that the OS maps every page at once (np.zeros leaves that to the first write to
    each page, and a first write to a huge page can stall the step that makes it for milliseconds)."""
    kv_dtype = check_kv_dtype(kv_dtype)
    store = (QuantizedKV.zeros(shape, int8_group(shape[-1])) if kv_dtype == "int8"
             else np.zeros(shape, dtype=kv_dtype))
    if mapped:
        for array in (store.values, store.scales) if kv_dtype == "int8" else (store,):
            array.fill(0)
    return store


def query_for(kv_dtype: str, q: np.ndarray, group: int | None = None) -> np.ndarray:
    """q [..., Dh] as attention over a cache of kv_dtype uses it. Over int8, q is rounded to int8 blocks as well
    (llama.cpp does the same with a Q8_0 cache): each group of `group` values (the cache's; by default
    int8_group(Dh)) to levels of max|group| / 127 (a float32 step, not float16), so that the kernels' q . k is an
    integer dot product (kernels/kv_rows.py, AVX-512 VNNI). Float caches: q as it is."""
    if kv_dtype != "int8":
        return q
    group = group or int8_group(q.shape[-1])
    qg = q.reshape(*q.shape[:-1], -1, group)                                              # [..., NG, group]
    amax = np.max(np.abs(qg), axis=-1, keepdims=True)                                     # [..., NG, 1]
    step = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)    # [..., NG, 1]
    return (np.rint(qg * step) * (amax * np.float32(1.0 / 127.0))).astype(np.float32).reshape(q.shape)


def as_float32(kv) -> np.ndarray:
    """What attention computes with: stored K or V (any kv_dtype) as float32 values. float32 arrays pass as is."""
    if isinstance(kv, QuantizedKV):
        return kv.dequantize()
    return kv if kv.dtype == np.float32 else kv.astype(np.float32)


def attention_inputs(q: np.ndarray, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as attention computes with them over K and V in a stored format: K and V as float32, and over an
    int8 cache q rounded to int8 blocks as the kernels round it (`query_for`). -> q [T, H, Dh], k, v [S, KVH, Dh]"""
    return query_for(kv_dtype_of(k), q, getattr(k, "group", None)), as_float32(k), as_float32(v)


def kv_dtype_of(kv) -> str:
    """The kv_dtype name of stored K or V."""
    return "int8" if isinstance(kv, QuantizedKV) else kv.dtype.name


class CacheFullError(ValueError):
    """The sequence would grow past the cache's capacity."""


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, kv_dtype: str = "float32"):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        shape = (config.n_layers, max_seq_len, config.n_kv_heads, config.head_dim)
        self.k = kv_storage(shape, self.kv_dtype)   # [L, S_max, KVH, Dh] (a QuantizedKV for int8)
        self.v = kv_storage(shape, self.kv_dtype)   # [L, S_max, KVH, Dh]
        self.config = config
        self.max_seq_len = max_seq_len
        self.length = 0                          # positions 0 .. length-1 hold valid K/V

    def check_room(self, n_new: int) -> None:
        """Raise a clear error if `n_new` more tokens would not fit."""
        if self.length + n_new > self.max_seq_len:
            raise CacheFullError(
                f"KV cache full: {self.length} cached + {n_new} new tokens > capacity {self.max_seq_len}; "
                f"use a larger max_seq_len or a shorter prompt / fewer new tokens"
            )

    def contiguous(self):
        """(k, v, key): every layer's K and V as one run of positions each ([L, S_max, KVH, Dh]), what the fused
        decode step writes and reads (backend.decode_blocks); key: what they depend on (nothing: they never move)."""
        return self.k, self.v, None

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v ([T, KVH, Dh]) at positions start .. start+T-1 of `layer`; return views of 0 .. start+T-1.

        The returned arrays are views into the preallocated storage ([start+T, KVH, Dh] each): no copy, in the
        stored format (float16 arrays, or QuantizedKV for int8): attention reads it as it is.
        """
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def stored(self, layer: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The K and V attention reads for positions start .. end-1 of `layer`, as float32 [end-start, KVH, Dh]."""
        return as_float32(self.k[layer, start:end]), as_float32(self.v[layer, start:end])

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (their slots are simply overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @property
    def bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(self.kv_dtype)

    @property
    def nbytes(self) -> int:
        """Memory reserved (all max_seq_len positions, used or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        return self.length * self.bytes_per_token

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(length={self.length}/{self.max_seq_len}, {self.kv_dtype}, "
                f"{self.bytes_per_token:,} B/token, "
                f"reserved {self.nbytes / 2**20:.1f} MiB)")
