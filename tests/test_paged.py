"""Paged KV cache: allocator invariants (property-based), prefix-cache edge cases, copy-on-write, the batched
paged-attention kernel against its numpy twin, and the model on a paged cache == on a contiguous one."""
import ctypes
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm import kernels, ops
from tinyllm.paged import BlockAllocator, OutOfBlocks, PagedKVCache, parse_bytes
from test_model import random_model


# --- allocator ----------------------------------------------------------------------------------------------------
def test_allocate_grow_free_and_named_exception():
    a = BlockAllocator(num_blocks=4, block_size=4)
    assert a.allocate("x", list(range(6))) == 0           # 6 tokens -> 2 blocks, nothing cached yet
    assert len(a.tables["x"]) == 2 and a.num_used == 2
    a.ensure_slots("x", 9)                                 # position 8 needs a third block
    assert len(a.tables["x"]) == 3
    with pytest.raises(OutOfBlocks):
        a.allocate("y", list(range(100, 108)))             # needs 2, 1 free
    assert "y" not in a.tables and a.num_free == 1         # all or nothing: the failed call holds nothing
    a.free("x")
    a.check_invariants()
    assert a.num_free == 4 and a.ref == [0] * 4


def test_prefix_hit_reuses_blocks_and_partial_last_block_is_not_cached():
    a = BlockAllocator(num_blocks=8, block_size=4)
    prompt = list(range(10))                               # 2 full blocks + a partial one of 2 tokens
    a.allocate("x", prompt)
    a.register("x", prompt, n_computed=10)
    assert len(a.cached) == 2                              # only full blocks get a key
    assert a.allocate("y", prompt + [99]) == 8             # hit on both full blocks
    assert a.tables["y"][:2] == a.tables["x"][:2] and a.tables["y"][2] != a.tables["x"][2]
    assert [a.ref[b] for b in a.tables["x"]] == [2, 2, 1]
    assert a.allocate("z", [0, 1, 2, 3, 7, 7, 7, 7]) == 4  # same first block, different second: a 1-block hit
    a.check_invariants()


def test_blocks_taken_predicts_allocate_without_side_effects():
    """What admission control asks before allocating: how far num_free would drop (new blocks + cached ones
    nobody holds, which leave the evictable pool)."""
    a = BlockAllocator(num_blocks=8, block_size=4)
    prompt = list(range(10))
    a.allocate("x", prompt)
    a.register("x", prompt, n_computed=10)
    a.free("x")                                            # its 2 full blocks stay cached, held by nobody
    for ids in (prompt + [99], [5] * 9, [1]):
        before, hits = a.num_free, (a.hit_tokens, a.query_tokens)
        taken = a.blocks_taken(ids)
        assert (a.num_free, (a.hit_tokens, a.query_tokens)) == (before, hits)   # a question, not an action
        a.allocate(str(ids), ids)
        assert before - a.num_free == taken
        a.free(str(ids))
    a.check_invariants()


def test_chained_hash_needs_the_whole_prefix():
    a = BlockAllocator(num_blocks=8, block_size=2)
    a.allocate("x", [1, 2, 3, 4, 5])
    a.register("x", [1, 2, 3, 4, 5], 5)
    assert a.allocate("y", [9, 9, 3, 4, 5]) == 0           # block [3, 4] matches, but its prefix does not


def test_full_prompt_hit_still_runs_one_token_and_copies_on_write():
    pool = PagedKVCache(random_model("llama").config, block_size=4, num_blocks=8)
    prompt = list(range(8))                                # exactly 2 full blocks
    x = pool.new_sequence(prompt, seq_id="x")
    x.check_room(8)
    x.length = 8
    for layer in range(pool.k.shape[0]):
        x.write(layer, 0, np.ones((8, *pool.k.shape[3:]), np.float32), np.ones((8, *pool.k.shape[3:]), np.float32))
    x.register(prompt)
    y = pool.new_sequence(prompt, seq_id="y")
    assert y.length == 7                                   # not 8: the last token must produce logits
    shared = x.block_table[1]
    assert y.block_table[1] == shared
    y.check_room(1)                                        # position 7 lives in a shared block -> copy it
    assert y.block_table[1] != shared and pool.allocator.ref[shared] == 1
    np.testing.assert_array_equal(pool.k[:, y.block_table[1]], pool.k[:, shared])
    y.write(0, 7, np.full((1, *pool.k.shape[3:]), 5, np.float32), np.zeros((1, *pool.k.shape[3:]), np.float32))
    assert pool.k[0, shared, 3].max() == 1                 # x's block is untouched
    pool.allocator.check_invariants()


def test_lru_eviction_takes_the_oldest_unreferenced_block_never_a_shared_one():
    a = BlockAllocator(num_blocks=4, block_size=2)
    for sid, p in (("old", [1, 2]), ("new", [3, 4]), ("live", [5, 6])):
        a.allocate(sid, p)
        a.register(sid, p, 2)
    a.free("old")
    a.free("new")                                          # evictable in LRU order: old, new; "live" in use
    a.allocate("s", [5, 6, 8])                             # shares live's block, takes the free one
    assert a.tables["s"][0] == a.tables["live"][0]
    a.allocate("t", [7, 7])                                # nothing free: evict "old" (least recently used)
    assert a.allocate("u", [3, 4]) == 1                    # "new" is still cached (a full-prompt hit) ...
    with pytest.raises(OutOfBlocks):
        a.allocate("v", [1, 2])                            # ... "old" was evicted: no hit, and no block left
    assert a.block_hash[a.tables["live"][0]] is not None   # the shared block was never a candidate
    a.check_invariants()


def test_fork_shares_blocks_and_truncate_releases_them():
    a = BlockAllocator(num_blocks=6, block_size=2)
    a.allocate("p", [1, 2, 3])
    a.fork("p", "c")
    assert a.tables["c"] == a.tables["p"] and all(a.ref[b] == 2 for b in a.tables["p"])
    copies = a.make_writable("c", 3, 4)                    # child writes into the shared partial block
    assert copies == [(a.tables["p"][1], a.tables["c"][1])]
    a.truncate("c", 1)
    assert len(a.tables["c"]) == 1
    for s in ("p", "c"):
        a.free(s)
    a.check_invariants()
    assert a.num_free == 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "register", "fork", "truncate", "free", "write"]),
                          st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
                max_size=60))
def test_allocator_invariants_under_random_workload(ops_list):
    """free + used == total, ref counts == table references, nothing leaks once every sequence is freed."""
    a = BlockAllocator(num_blocks=10, block_size=3)
    tokens = {}                                            # seq -> its token ids (tiny alphabet: many prefix hits)
    for op, sid, toks in ops_list:
        live = sid in a.tables
        try:
            if op == "alloc" and not live:
                a.allocate(sid, toks)
                tokens[sid] = list(toks)
            elif op == "grow" and live:
                a.ensure_slots(sid, len(tokens[sid]) + len(toks))
                tokens[sid] += toks
            elif op == "register" and live:
                a.register(sid, tokens[sid], len(tokens[sid]))
            elif op == "fork" and live and sid + 1 not in a.tables:
                a.fork(sid, sid + 1)
                tokens[sid + 1] = list(tokens[sid])
            elif op == "truncate" and live:
                n = len(tokens[sid]) // 2
                a.truncate(sid, n)
                del tokens[sid][n:]
            elif op == "write" and live and tokens[sid]:
                a.make_writable(sid, len(tokens[sid]) - 1, len(tokens[sid]))
            elif op == "free" and live:
                a.free(sid)
        except OutOfBlocks:
            pass
        a.check_invariants()
        assert a.num_free + a.num_used == a.num_blocks
    for sid in list(a.tables):
        a.free(sid)
    a.check_invariants()
    assert a.num_free == a.num_blocks and not any(a.ref)


# --- storage and sizing -------------------------------------------------------------------------------------------
def test_pool_sized_from_memory_and_bytes_per_token():
    config = random_model("llama").config
    pool = PagedKVCache(config, block_size=16, memory="1MiB")
    assert pool.bytes_per_token == config.kv_bytes_per_token()
    assert pool.num_blocks == 2**20 // (16 * config.kv_bytes_per_token())
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="exactly one"):
        PagedKVCache(config)


def _resident_fraction(a: np.ndarray) -> float:
    """The fraction of the pages under array a that are in memory (Linux's mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    first = a.ctypes.data // page * page
    length = a.ctypes.data + a.nbytes - first
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), pages):
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(p & 1 for p in pages) / len(pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks Linux's mincore")
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_new_pool_is_resident_before_any_request_writes_to_it(kv_dtype):
    """The pool's pages are mapped when it is made (a first write to a fresh huge page can stall a step): every
    page of its K and V is in memory at once, where np.zeros alone leaves them unmapped until written."""
    config = random_model("llama").config
    pool = PagedKVCache(config, block_size=16, memory="64MiB", kv_dtype=kv_dtype)
    stores = (pool.k, pool.v) if kv_dtype == "float32" else (pool.k.values, pool.k.scales, pool.v.values,
                                                              pool.v.scales)
    assert pool.nbytes > 60 * 2**20 and [_resident_fraction(a) for a in stores] == [1.0] * len(stores)
    assert not any(a.any() for a in stores)                        # still zeros


def test_paged_waste_is_only_the_partial_last_blocks():
    pool = PagedKVCache(random_model("llama").config, block_size=4, num_blocks=16)
    seqs = [pool.new_sequence(list(range(n))) for n in (5, 8, 1)]
    for s, n in zip(seqs, (5, 8, 1)):
        s.length = n
    u = pool.usage(seqs)
    assert u["blocks_used"] == 2 + 2 + 1 and u["slots_filled"] == 14
    assert u["waste"] == pytest.approx(6 / 20)


# --- attention over blocks ----------------------------------------------------------------------------------------
def test_paged_decode_kernel_matches_numpy_twin_and_plain_attention():
    rng = np.random.default_rng(0)
    NB, BS, KVH, H, Dh = 12, 4, 2, 6, 8
    kb = rng.normal(size=(NB, BS, KVH, Dh)).astype(np.float32)    # [NB, BS, KVH, Dh]
    vb = rng.normal(size=(NB, BS, KVH, Dh)).astype(np.float32)
    lens = np.array([1, 7, 13], dtype=np.int32)
    tables = np.array([[5, 0, 0, 0], [3, 9, 0, 0], [11, 2, 7, 1]], dtype=np.int32)
    q = rng.normal(size=(3, H, Dh)).astype(np.float32)            # [B, H, Dh]
    fast = kernels.paged_attention(q, kb, vb, tables, lens)
    twin = ops.paged_attention(q, kb, vb, tables, lens)
    np.testing.assert_allclose(fast, twin, atol=1e-5)
    for b in range(3):                                             # the twin against ops.attention on a gather
        pos = np.arange(lens[b])
        k, v = kb[tables[b, pos // BS], pos % BS], vb[tables[b, pos // BS], pos % BS]
        np.testing.assert_allclose(twin[b], ops.attention(q[b:b + 1], k, v, lens[b] - 1)[0], atol=1e-5)


# --- the model on a paged cache -----------------------------------------------------------------------------------
def _greedy(model, prompt, n, cache):
    logits, out = model.prefill(prompt, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_step(out[-1], cache)
    return out, logits


@pytest.mark.parametrize("arch,backend", [("llama", "numba"), ("llama", "numpy"), ("gpt2", "numba")])
def test_paged_equals_contiguous_single_sequence(arch, backend):
    model = random_model(arch, context_length=64)
    model.backend = backend
    prompt = list(np.random.default_rng(1).integers(0, 50, 11))
    ref, ref_logits = _greedy(model, prompt, 20, model.new_cache(64))
    pool = PagedKVCache(model.config, block_size=4, num_blocks=10)
    got, got_logits = _greedy(model, prompt, 20, pool.new_sequence())
    assert got == ref
    np.testing.assert_allclose(got_logits, ref_logits, atol=1e-5)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_batched_paged_decode_equals_each_alone(backend):
    """Mixed step: two prefills and three decodes in one forward_batch; decodes go through the paged kernel."""
    model = random_model("llama", context_length=64)
    model.backend = backend
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 50, n)) for n in (3, 9, 17, 5, 12)]
    pool = PagedKVCache(model.config, block_size=4, num_blocks=40)
    caches = [pool.new_sequence() for _ in prompts]
    model.forward_batch(prompts[:3], caches[:3], last_only=True)          # three prompts in, together
    toks = [1, 2, 3]
    mixed = model.forward_batch([[t] for t in toks] + prompts[3:], caches, last_only=True)
    for j, p in enumerate(prompts):
        alone = model.logits(p + [toks[j]] if j < 3 else p)[-1]
        np.testing.assert_allclose(mixed[j][0], alone, atol=1e-4)
    pool.allocator.check_invariants()


def test_real_model_paged_equals_contiguous(default_model):
    import tinyllm
    prompt = "The three primary colors are"
    a = tinyllm.generate(default_model, prompt, max_new_tokens=16, kv="contiguous")
    b = tinyllm.generate(default_model, prompt, max_new_tokens=16, kv="paged")
    assert b.token_ids == a.token_ids and len(a.token_ids) == 16


def test_copy_on_write_without_a_free_block_raises_before_changing_anything():
    a = BlockAllocator(num_blocks=2, block_size=2)
    a.allocate("p", [1, 2, 3])                             # 2 blocks: the pool is full
    a.fork("p", "c")
    before = (list(a.tables["c"]), list(a.ref))
    with pytest.raises(OutOfBlocks):
        a.make_writable("c", 0, 4)                         # both blocks shared, nothing free to copy into
    assert (a.tables["c"], a.ref) == before
    a.check_invariants()


def test_a_growing_sequence_takes_the_block_after_its_last_when_it_is_free():
    """The allocator keeps a sequence's blocks one run where it can (SequenceCache.contiguous), and otherwise
    takes any free block: the run is a preference, never a condition."""
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.allocate("x", list(range(5)))                        # blocks 0, 1
    a.allocate("y", list(range(100, 104)))                 # block 2
    a.free("y")                                            # 2 is free again, at the back of the free list
    a.ensure_slots("x", 9)                                 # x's third block: 2, the one after its last
    assert a.tables["x"] == [0, 1, 2]
    a.allocate("z", list(range(200, 204)))                 # takes 3 (the oldest free)
    a.ensure_slots("x", 13)                                # 3 is taken: any free block
    assert a.tables["x"][:3] == [0, 1, 2] and a.tables["x"][3] not in (0, 1, 2, 3)
    a.check_invariants()


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_paged_sequence_on_consecutive_blocks_runs_the_fused_step_and_equals_the_contiguous_cache(kv_dtype):
    """One sequence whose blocks are consecutive runs the fused decode step on its run of the pool: the same
    logits as a contiguous cache's fused step, bit for bit. Once its blocks are not one run, it falls back to the
    op-by-op step, and agrees with the contiguous cache within float rounding."""
    model = random_model("llama", context_length=64, dim=64, ffn_dim=64, quant="q4_1", activations="int8")
    prompt = list(np.random.default_rng(4).integers(0, 50, 7))
    ref, ref_logits = _greedy(model, prompt, 12, model.new_cache(64, kv_dtype))
    pool = PagedKVCache(model.config, block_size=4, num_blocks=12, kv_dtype=kv_dtype)
    seq = pool.new_sequence()
    fused = []
    decode_blocks = model.compute.decode_blocks
    model.compute.decode_blocks = lambda *a: fused.append(1) or decode_blocks(*a)
    try:
        got, got_logits = _greedy(model, prompt, 12, seq)
        assert seq.contiguous() is not None and fused                       # it ran fused
        assert got == ref and np.array_equal(got_logits, ref_logits)
        seq.free()
        split = pool.new_sequence()
        logits, got = model.prefill(prompt, split), []                      # two blocks (7 tokens)
        other = pool.new_sequence(list(range(30, 34)))                      # takes the block after split's last
        fused.clear()
        for _ in range(12):
            got.append(int(np.argmax(logits)))
            logits = model.decode_step(got[-1], split)
        assert split.contiguous() is None        # its third block is not after its second: from then on op by op
        assert len(fused) == 1                   # (position 7, the last slot of its second block, still ran fused)
        assert got == ref
        np.testing.assert_allclose(logits, ref_logits, atol=1e-4)
        other.free()
    finally:
        model.compute.decode_blocks = decode_blocks
    pool.allocator.check_invariants()
