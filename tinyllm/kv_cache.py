"""ContiguousKVCache: the keys and values of every past token, so each decode step computes only the new one.

Without a cache, generating token n recomputes K and V for all n earlier tokens (O(n^2) work over a
generation); with it, each step computes one token's K/V and reads the rest back (O(n) memory).

Storage is preallocated once for `max_seq_len` positions: k and v are each [L, S_max, KVH, Dh]. The cost per
token is 2 * L * KVH * Dh * 4 bytes in float32 (SmolLM2-135M: 2*30*3*64*4 = 46,080 bytes = 45 KiB).
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


class CacheFullError(ValueError):
    """The sequence would grow past the cache's capacity."""


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, dtype=np.float32):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        shape = (config.n_layers, max_seq_len, config.n_kv_heads, config.head_dim)
        self.k = np.zeros(shape, dtype=dtype)   # [L, S_max, KVH, Dh]
        self.v = np.zeros(shape, dtype=dtype)   # [L, S_max, KVH, Dh]
        self.max_seq_len = max_seq_len
        self.length = 0                          # positions 0 .. length-1 hold valid K/V

    def check_room(self, n_new: int) -> None:
        """Raise a clear error if `n_new` more tokens would not fit."""
        if self.length + n_new > self.max_seq_len:
            raise CacheFullError(
                f"KV cache full: {self.length} cached + {n_new} new tokens > capacity {self.max_seq_len}; "
                f"use a larger max_seq_len or a shorter prompt / fewer new tokens"
            )

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v ([T, KVH, Dh]) at positions start .. start+T-1 of `layer`; return views of 0 .. start+T-1.

        The returned arrays are views into the preallocated storage ([start+T, KVH, Dh] each): no copy.
        """
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (their slots are simply overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @property
    def bytes_per_token(self) -> int:
        L, _, KVH, Dh = self.k.shape
        return 2 * L * KVH * Dh * self.k.itemsize

    @property
    def nbytes(self) -> int:
        """Memory reserved (all max_seq_len positions, used or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        return self.length * self.bytes_per_token

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(length={self.length}/{self.max_seq_len}, {self.bytes_per_token:,} B/token, "
                f"reserved {self.nbytes / 2**20:.1f} MiB)")
