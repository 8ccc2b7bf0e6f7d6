"""Paged KV cache: the keys and values of many sequences in one pool of fixed-size blocks (PagedAttention).

A contiguous cache reserves max_seq_len positions per sequence up front; most of that memory is never used,
and it caps how many users fit. Here memory is a pool of blocks of `block_size` positions; a sequence holds a
*block table* (logical block i -> physical block id) and takes one more block only when its last one is full,
so at most block_size - 1 slots per sequence are wasted (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", the vLLM paper). Three parts, each testable alone:

    BlockAllocator   pure-Python bookkeeping: free list, ref counts, block tables, prefix-cache hashes
    PagedKVCache     the storage (K and V blocks per layer) + one allocator; `new_sequence()` gives a
    SequenceCache    per-sequence handle with the model's cache contract (length, check_room, update, truncate)

plus `DecodeBatch`: the one-token sequences of a forward pass that live in one pool, attended in one call per
layer (ops.paged_attention / kernels.paged_attention) that reads each sequence's blocks through its block table.
Left out: swapping blocks to
host memory (preemption here is by recompute), sliding windows, and multi-GPU anything.
"""
from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .kv_cache import Segment, as_float32, check_kv_dtype, kv_storage


class OutOfBlocks(RuntimeError):
    """The pool has no free (or evictable) block left. The engine answers by preempting a sequence."""


# --- bookkeeping ------------------------------------------------------------------------------------------------
class BlockAllocator:
    """Which physical block holds which part of which sequence. Knows nothing about K/V values.

    A block is in exactly one of three states:
      free        ref 0, no content worth keeping                   -> `self.free_list` (a FIFO)
      cached      ref 0, a full block registered in the prefix cache -> `self.evictable` (LRU order)
      in use      ref >= 1: listed in that many block tables
    Allocation takes a free block first and evicts the least recently used cached block only when none is left,
    so a prefix stays reusable for as long as memory allows.

    Prefix caching (vLLM's automatic prefix caching; nano-vllm's block manager): a *full* block is keyed by a
    chained hash h_i = hash((h_{i-1}, tokens of block i)), so equal keys mean equal whole prefixes, not just
    equal blocks. A new sequence walks its prompt block by block and reuses every block whose key is cached.
    A cached block is immutable: writing into it needs copy-on-write when it is shared (see `make_writable`).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks                        # [NB] how many block tables list each block
        self.free_list: deque[int] = deque(range(num_blocks))   # ref 0, nothing cached
        self.evictable: OrderedDict[int, None] = OrderedDict()   # ref 0, cached; first = least recently used
        self.block_hash: list[int | None] = [None] * num_blocks  # key of a cached block, else None
        self.cached: dict[int, int] = {}                   # prefix key -> block id
        self.tables: dict = {}                             # seq id -> [physical block id per logical block]
        self.hashed: dict = {}                             # seq id -> keys of its leading full, hashed blocks
        self.hit_tokens = self.query_tokens = 0            # prefix-cache hit rate = hit / query

    # ---- counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: truly free plus evictable cached ones."""
        return len(self.free_list) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)              # ceil

    # ---- the life of a sequence
    def allocate(self, seq_id, token_ids) -> int:
        """Give a new sequence blocks for all of `token_ids`, reusing cached blocks for its longest cached prefix.

        -> how many leading tokens already have their K/V in the cache (a multiple of block_size, and always
        < len(token_ids): the last token must run through the model to produce logits). All or nothing: on
        OutOfBlocks nothing is held.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        n, bs = len(token_ids), self.block_size
        table, keys = self._cached_prefix(token_ids)
        n_new = self.blocks_for(n) - len(table)
        if self._taken(table, n) > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {n_new} new blocks, {self.num_free} free")
        for b in table:                                    # take the hits first, so eviction cannot take them
            self._take(b)
        for _ in range(n_new):
            table.append(self._pop_free(after=table[-1] if table else None))
        self.tables[seq_id], self.hashed[seq_id] = table, keys
        hit = max(0, min(len(keys) * bs, n - 1))           # full-prompt hit: still run the last token
        self.hit_tokens += hit
        self.query_tokens += n
        return hit

    def _cached_prefix(self, token_ids) -> tuple[list[int], list[int]]:
        """The longest run of leading full blocks of `token_ids` already in the prefix cache: (blocks, keys)."""
        table, keys, key, bs = [], [], None, self.block_size
        if self.prefix_caching:
            for i in range(len(token_ids) // bs):
                key = hash((key, tuple(token_ids[i * bs:(i + 1) * bs])))
                block = self.cached.get(key)
                if block is None:
                    break
                table.append(block)
                keys.append(key)
        return table, keys

    def blocks_taken(self, token_ids) -> int:
        """How far `allocate(token_ids)` would lower num_free: its new blocks, plus the cached prefix blocks it
        would take back from the evictable pool (those nobody holds). Changes nothing."""
        return self._taken(self._cached_prefix(token_ids)[0], len(token_ids))

    def _taken(self, hits: list[int], n_tokens: int) -> int:
        """Free blocks used by a sequence of n_tokens whose cached prefix is `hits`."""
        return self.blocks_for(n_tokens) - len(hits) + sum(1 for b in hits if self.ref[b] == 0)

    def ensure_slots(self, seq_id, n_tokens: int) -> None:
        """Grow the block table to cover positions 0 .. n_tokens-1 (decode: one block every block_size steps)."""
        table = self.tables[seq_id]
        need = self.blocks_for(n_tokens) - len(table)
        if need > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more blocks, {self.num_free} free")
        for _ in range(need):
            table.append(self._pop_free(after=table[-1] if table else None))

    def make_writable(self, seq_id, start: int, end: int) -> list[tuple[int, int]]:
        """Prepare positions start .. end-1 of a sequence for writing. -> [(src, dst)] block copies to perform.

        Copy-on-write: a block listed in other tables too (ref > 1) is replaced, in this table only, by a fresh
        copy. A cached block owned by this sequence alone leaves the prefix cache (its content is changing).
        """
        table, bs, copies = self.tables[seq_id], self.block_size, []
        shared = sum(1 for b in table[start // bs:self.blocks_for(end)] if self.ref[b] > 1)
        if shared > self.num_free:                         # all or nothing: never leave a copy half-recorded
            raise OutOfBlocks(f"sequence {seq_id!r} needs {shared} blocks for copy-on-write, {self.num_free} free")
        for i in range(start // bs, self.blocks_for(end)):
            b = table[i]
            if self.ref[b] > 1:
                new = self._pop_free()
                self.ref[b] -= 1
                table[i] = new
                copies.append((b, new))
            elif self.block_hash[b] is not None:
                self._uncache(b)
        del self.hashed[seq_id][start // bs:]              # keys of the blocks being written are recomputed later
        return copies

    def register(self, seq_id, token_ids, n_computed: int) -> None:
        """Add the sequence's full blocks whose K/V are now computed (positions < n_computed) to the prefix cache.
        Called after each forward; only blocks not yet hashed are looked at."""
        if not self.prefix_caching:
            return
        table, keys, bs = self.tables[seq_id], self.hashed[seq_id], self.block_size
        for i in range(len(keys), n_computed // bs):
            key = hash((keys[-1] if keys else None, tuple(token_ids[i * bs:(i + 1) * bs])))
            keys.append(key)
            b = table[i]
            if key not in self.cached and self.block_hash[b] is None:
                self.cached[key], self.block_hash[b] = b, key
            # else: another block already holds this prefix (computed concurrently); this one stays private

    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (parallel sampling, beams); copy-on-write splits them later."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        self.tables[child] = list(self.tables[parent])
        self.hashed[child] = list(self.hashed[parent])
        for b in self.tables[child]:
            self.ref[b] += 1

    def truncate(self, seq_id, n_tokens: int) -> None:
        """Release the blocks past position n_tokens-1 (speculative rollback)."""
        table = self.tables[seq_id]
        keep = self.blocks_for(n_tokens)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]
        del self.hashed[seq_id][n_tokens // self.block_size:]

    def free(self, seq_id) -> None:
        """The sequence is done (finished, aborted or preempted): drop its references. Cached blocks stay cached."""
        for b in reversed(self.tables.pop(seq_id)):       # reversed: a prefix's tail is evicted before its head
            self._release(b)
        del self.hashed[seq_id]

    # ---- block states
    def _pop_free(self, after: int | None = None) -> int:
        """A block for a sequence: the one after `after` (its last block) if that one is free, so that a sequence's
        blocks tend to be one run (SequenceCache.contiguous), else the oldest free one, else the least recently used
        cached one."""
        nxt = None if after is None else after + 1
        if nxt is not None and nxt < self.num_blocks and self.ref[nxt] == 0 and self.block_hash[nxt] is None:
            self.free_list.remove(nxt)
            b = nxt
        elif self.free_list:
            b = self.free_list.popleft()
        elif self.evictable:                               # LRU eviction of an unreferenced cached block
            b, _ = self.evictable.popitem(last=False)
            self._uncache(b)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.ref[b] = 1
        return b

    def _take(self, b: int) -> None:
        """One more table lists cached block b (a prefix-cache hit)."""
        if self.ref[b] == 0:
            del self.evictable[b]
        self.ref[b] += 1

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.block_hash[b] is not None:
                self.evictable[b] = None                   # most recently used end
            else:
                self.free_list.append(b)

    def _uncache(self, b: int) -> None:
        del self.cached[self.block_hash[b]]
        self.block_hash[b] = None
        if b in self.evictable:
            del self.evictable[b]
            self.free_list.append(b)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests after every operation)."""
        counted = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                counted[b] += 1
        assert counted == self.ref, "ref counts differ from the number of tables listing each block"
        free, evict = set(self.free_list), set(self.evictable)
        assert len(free) == len(self.free_list) and not free & evict, "a block is listed twice among the unused"
        assert all(self.ref[b] == 0 for b in free | evict), "an unused block has references"
        assert len(free) + len(evict) + sum(r > 0 for r in self.ref) == self.num_blocks, "free + used != total"
        assert all(self.block_hash[b] is None for b in free), "a free block is still in the prefix cache"
        assert all(self.block_hash[b] == k for k, b in self.cached.items()), "prefix index and blocks disagree"
        assert all(self.block_hash[b] is not None for b in evict), "an evictable block is not cached"


# --- storage ----------------------------------------------------------------------------------------------------
def parse_bytes(size: str | int) -> int:
    """'512MiB' (x 1024^2), '2GB' (x 1000^3), '64M' (x 1024^2), or a plain int -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(iB|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {size!r}; write e.g. 512MiB or 2GB")
    number, prefix, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1000 if suffix == "b" and prefix else 1024
    return int(number * base ** " KMGT".index(prefix or " "))


class PagedKVCache:
    """K and V for every layer as blocks: k, v each [L, NB, BS, KVH, Dh], one allocator, many sequences.

    Size the pool by a block count or a memory budget (`memory="512MiB"`). Position p of a sequence lives in
    slot table[p // BS] * BS + p % BS of the flattened [NB * BS, KVH, Dh] view (the *slot mapping*).
    kv_dtype: how K and V are stored ("float32", "float16", "int8": kv_cache.py); a budget holds 2x the blocks in
    float16 and about 3.8x in int8. With int8, k and v are kv_cache.QuantizedKV (values and their scales), and
    copy-on-write copies both.
    """

    def __init__(self, config: ModelConfig, block_size: int = 16, num_blocks: int | None = None,
                 memory: str | int | None = None, prefix_caching: bool = True, kv_dtype: str = "float32"):
        L, KVH, Dh = config.n_layers, config.n_kv_heads, config.head_dim
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.block_bytes = block_size * config.kv_bytes_per_token(self.kv_dtype)   # K and V, all layers
        if (num_blocks is None) == (memory is None):
            raise ValueError("size the KV pool with exactly one of num_blocks or memory")
        if num_blocks is None:
            num_blocks = parse_bytes(memory) // self.block_bytes
            if num_blocks < 1:
                raise ValueError(f"KV memory {memory} is less than one block ({self.block_bytes:,} bytes)")
        shape = (L, num_blocks, block_size, KVH, Dh)
        # mapped now, as llama.cpp clears its KV buffer: a request reaching fresh blocks of every layer (the first
        # one: a huge page per layer) would otherwise stall on the page faults, and the step's thread governor
        # would take that stall for a busy machine and drop to one thread
        self.k = kv_storage(shape, self.kv_dtype, mapped=True)    # [L, NB, BS, KVH, Dh]
        self.v = kv_storage(shape, self.kv_dtype, mapped=True)    # [L, NB, BS, KVH, Dh]
        self.k_slots = self.k.reshape(L, num_blocks * block_size, KVH, Dh)   # [L, NB*BS, KVH, Dh] (a view)
        self.v_slots = self.v.reshape(L, num_blocks * block_size, KVH, Dh)
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.block_size, self.num_blocks, self.max_positions = block_size, num_blocks, config.context_length
        self._next_id = 0                                 # (compiles nothing: the model warms up for a pool)

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def new_sequence(self, token_ids=None, seq_id=None) -> "SequenceCache":
        """A cache handle for one sequence. With `token_ids`, blocks for all of them are allocated at once
        (reusing the prefix cache); `.length` then says how many leading tokens need no compute."""
        if seq_id is None:
            seq_id, self._next_id = f"seq{self._next_id}", self._next_id + 1
        seq = SequenceCache(self, seq_id)
        if token_ids is not None:
            seq.length = self.allocator.allocate(seq_id, list(token_ids))
        else:
            self.allocator.allocate(seq_id, [])
        return seq

    def decode_batch(self, segments: list[Segment]) -> DecodeBatch:
        """One-token segments of a pass whose caches are sequences of this pool -> their DecodeBatch."""
        width = max(len(s.cache.block_table) for s in segments)
        tables = np.zeros((len(segments), width), dtype=np.int32)                  # [B, max blocks]
        for j, s in enumerate(segments):
            tables[j, :len(s.cache.block_table)] = s.cache.block_table
        return DecodeBatch(rows=np.array([s.rows.start for s in segments]), pool=self, block_tables=tables,
                           context_lens=np.array([s.start + 1 for s in segments], dtype=np.int32),
                           new_slots=np.array([s.cache.slots[s.start] for s in segments]))

    def copy_blocks(self, copies) -> None:
        for src, dst in copies:                            # copy-on-write, every layer at once (int8: with scales)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def usage(self, sequences) -> dict:
        """Blocks in use, and slots allocated but empty (the paged cache's only waste: partial last blocks)."""
        fill = {}                                          # block -> filled slots (max over sharing sequences)
        for s in sequences:
            for i, b in enumerate(s.block_table):
                fill[b] = max(fill.get(b, 0), min(self.block_size, s.length - i * self.block_size))
        slots = len(fill) * self.block_size
        filled = sum(max(f, 0) for f in fill.values())
        return dict(blocks_used=len(fill), blocks_total=self.num_blocks, slots_allocated=slots, slots_filled=filled,
                    waste=(slots - filled) / slots if slots else 0.0)


class SequenceCache:
    """One sequence's view of a PagedKVCache, with the contiguous cache's contract, so the model runs unchanged:
    `length`, `check_room(n)`, `update(layer, start, k, v) -> (K, V)`, `truncate(n)`."""

    def __init__(self, pool: PagedKVCache, seq_id):
        self.pool, self.seq_id = pool, seq_id
        self.length = 0                                    # positions 0 .. length-1 hold valid K/V
        self.slots = np.zeros(0, dtype=np.int64)           # [S] flat slot of each position (the slot mapping)

    @property
    def kv_dtype(self) -> str:
        return self.pool.kv_dtype

    @property
    def block_table(self) -> list[int]:
        return self.pool.allocator.tables[self.seq_id]

    def check_room(self, n_new: int) -> None:
        """Make positions length .. length+n_new-1 writable: new blocks if needed, copy-on-write of shared ones.
        Raises OutOfBlocks when the pool cannot provide them."""
        end = self.length + n_new
        if end > self.pool.max_positions:
            raise OutOfBlocks(f"{end} positions exceed the model's context {self.pool.max_positions}")
        alloc = self.pool.allocator
        alloc.ensure_slots(self.seq_id, end)
        self.pool.copy_blocks(alloc.make_writable(self.seq_id, self.length, end))
        table = np.asarray(self.block_table, dtype=np.int64)                       # [n_blocks]
        pos = np.arange(end)                                                       # [S]
        self.slots = table[pos // self.pool.block_size] * self.pool.block_size + pos % self.pool.block_size

    def contiguous(self):
        """(k, v, key) as ContiguousKVCache.contiguous gives them ([L, capacity, KVH, Dh] views of the pool), when
        this sequence's blocks happen to be consecutive (the allocator prefers that): the fused decode step then
        runs on them as on a contiguous cache. key: the run's first block and length. None when they are not."""
        table = self.block_table
        if not table or table[-1] - table[0] != len(table) - 1 or any(b - i != table[0] for i, b in enumerate(table)):
            return None
        first, end = table[0] * self.pool.block_size, (table[-1] + 1) * self.pool.block_size
        return self.pool.k_slots[:, first:end], self.pool.v_slots[:, first:end], (table[0], len(table))

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v ([T, KVH, Dh]) at positions start .. start+T-1; return the whole history [start+T, KVH, Dh].

        The history is gathered from the blocks (a copy): the plain way of reading through the block table.
        Batched decode skips the gather and reads the blocks in place (`DecodeBatch`).
        """
        end = start + k.shape[0]
        self.write(layer, start, k, v)
        return self.pool.k_slots[layer, self.slots[:end]], self.pool.v_slots[layer, self.slots[:end]]

    def stored(self, layer: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The K and V attention reads for positions start .. end-1 of `layer`, as float32 [end-start, KVH, Dh]."""
        slots = self.slots[start:end]
        return as_float32(self.pool.k_slots[layer, slots]), as_float32(self.pool.v_slots[layer, slots])

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        slots = self.slots[start:start + k.shape[0]]                               # [T]
        self.pool.k_slots[layer, slots] = k                                        # [T, KVH, Dh] into the blocks
        self.pool.v_slots[layer, slots] = v

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self.pool.allocator.truncate(self.seq_id, length)
        self.slots = self.slots[:length]

    def register(self, token_ids) -> None:
        """Offer this sequence's computed full blocks to the prefix cache (token_ids: at least `length` ids)."""
        self.pool.allocator.register(self.seq_id, token_ids, self.length)

    def free(self) -> None:
        self.pool.allocator.free(self.seq_id)
        self.length, self.slots = 0, self.slots[:0]

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def nbytes(self) -> int:
        """Memory held by this sequence's blocks."""
        return len(self.block_table) * self.pool.block_bytes

    def __repr__(self) -> str:
        return f"SequenceCache({self.seq_id!r}, length={self.length}, blocks={self.block_table})"


# --- batched decode attention over the blocks (PagedAttention) ----------------------------------------------------
@dataclass
class DecodeBatch:
    """One-token segments of a forward pass that all live in one pool: attended together, one call per layer."""
    rows: np.ndarray            # [B] row of each sequence's token in the stacked activations
    pool: PagedKVCache
    block_tables: np.ndarray    # [B, max blocks] int32, padded with 0 (never read past context_lens)
    context_lens: np.ndarray    # [B] int32: positions to attend, including the new token
    new_slots: np.ndarray       # [B] int64: slot the new token's K/V goes to

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, ops) -> np.ndarray:
        """Write each sequence's new k, v ([B, KVH, Dh]) into its slot, then attend q [B, H, Dh]. -> [B, H*Dh]"""
        self.pool.k_slots[layer, self.new_slots] = k                               # [B, KVH, Dh]
        self.pool.v_slots[layer, self.new_slots] = v
        return ops.paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.block_tables, self.context_lens)
