"""The transformer: one forward pass, used three ways.

    logits(ids)              no cache: the whole sequence at once (the reference every other path must match)
    prefill(ids, cache)      the prompt (in chunks past 128 tokens): big matmuls (compute-bound), fills the cache
    decode_step(id, cache)   one new token: reads every weight and the whole cache (memory-bound)

All three run the same `forward`; the only difference is where K and V come from. Every family shares the
code, a config field per difference (config.py): Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no
biases) and its kin, GPT-2 (LayerNorm, learned positions, GELU, biases), and the ALiBi families (MPT,
Falcon-RW: no position in the embeddings, a per-head bias on the attention scores instead). Weights arrive as
canonical named arrays from weights.py.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from .backend import BACKENDS, make_backend
from .config import ModelConfig
from .interventions import make_interventions
from .kv_cache import ContiguousKVCache, Segment, attention_groups, attention_inputs, query_for
from .ops import attention, paged_attention, rope_tables
from .quant import QuantizedWeight
from .weights import fuse_layer_matrices

ACTIVATIONS = ("float32", "int8")
PROBED_ROWS = 32     # passes up to this many rows (decode steps, batched or not) have a ThreadGovernor
__all__ = ["Transformer", "LayerWeights", "BACKENDS", "ACTIVATIONS"]


@dataclass(eq=False)        # compared by identity: the backend keeps what it prepared of each layer, weakly
class LayerWeights:
    """One transformer block. Projections are [out, in]; q/k/v and gate/up are fused at load (one matmul each)."""

    attn_norm: np.ndarray            # [D]
    wqkv: np.ndarray                 # [(H + 2*KVH) * Dh, D]: rows of wq, then wk, then wv
    wo: np.ndarray                   # [D, H*Dh]
    ffn_norm: np.ndarray             # [D]
    w_in: np.ndarray                 # llama: [2F, D] (gate rows, then up rows); gpt2: [F, D]
    w_out: np.ndarray                # [D, F]
    attn_norm_b: np.ndarray | None = None   # gpt2 LayerNorm biases and projection biases; None for llama
    ffn_norm_b: np.ndarray | None = None
    bqkv: np.ndarray | None = None
    bo: np.ndarray | None = None
    b_in: np.ndarray | None = None
    b_out: np.ndarray | None = None
    q_norm: np.ndarray | None = None        # [Dh] or [H*Dh]: RMSNorm of q (and k) before RoPE (config.qk_norm)
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None   # [D]: olmo2's norms of attention's and the MLP's outputs
    ffn_post_norm: np.ndarray | None = None


class Transformer:
    """A loaded model: config, weights, tokenizer, and the forward pass. Build it with `tinyllm.load`.

    backend="numba" (default) runs the matrix products, attention and the small ops in the Numba kernels of
    kernels/; backend="numpy" runs everything in the plain numpy of ops.py, to read or step through. The two
    offer the same functions (`self.compute`, backend.py) and give the same tokens (tests/test_kernels.py),
    bit for bit with float32 activations; with activations="int8" rounding can amplify their last-bit
    differences (quant.py). activations is a setting of this model's forward pass, not of its weights: two
    models may share weights (an early-exit draft shares its target's) and round differently.
    """

    def __init__(self, config: ModelConfig, weights: dict, tokenizer=None, backend: str = "numba",
                 quant: str | None = None, quant_report: list | None = None, activations: str = "float32"):
        self.config = config
        self.tokenizer = tokenizer
        self.quant = quant or "fp32"
        self.quant_report = quant_report or []
        self.jit_s = 0.0                    # seconds spent compiling / loading kernels (numba backend)
        self.fused_decode = True            # a step of a few tokens runs each block as one call (if the backend can)
        c = config
        self.tok_embed = weights["tok_embed"]                      # [V, D]
        self.lm_head = weights.get("lm_head", self.tok_embed)      # [V, D]; the same array when tied
        self.final_norm = weights["final_norm"]                    # [D]
        self.final_norm_b = weights.get("final_norm_b")
        self.pos_embed = weights.get("pos_embed")                  # [context, D] (gpt2 only)
        self.alibi_slopes = weights.get("alibi_slopes")            # [H] (arch "alibi" only)
        # q/k/v and gate/up as one matrix each: the loaders hand them over fused already; other dicts are fused here
        weights = fuse_layer_matrices(dict(weights), c.n_layers)
        self.layers = []
        for i in range(c.n_layers):
            w = lambda name: weights.get(f"layers.{i}.{name}")     # noqa: E731
            self.layers.append(LayerWeights(
                attn_norm=w("attn_norm"), attn_norm_b=w("attn_norm_b"),
                wqkv=w("wqkv"), bqkv=w("bqkv"),
                wo=w("wo"), bo=w("bo"),
                ffn_norm=w("ffn_norm"), ffn_norm_b=w("ffn_norm_b"),
                w_in=w("w_in") if c.mlp == "swiglu" else w("w_fc"), b_in=w("b_fc"),
                w_out=w("w_down") if c.mlp == "swiglu" else w("w_proj"), b_out=w("b_proj"),
                q_norm=w("q_norm"), k_norm=w("k_norm"), attn_post_norm=w("attn_post_norm"),
                ffn_post_norm=w("ffn_post_norm"),
            ))
        if c.arch == "llama":  # one table of rotation angles for every position the model supports
            self.rope_cos, self.rope_sin = rope_tables(c.rope_dim, c.context_length, c.rope_theta,
                                                       weights.get("rope_freqs"))   # (Llama 3.x's scaling)
        self.activations = activations      # validated by its property setter, like backend
        self.backend = backend              # validated (and kernels warmed up) by the property setter below

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self.compute = make_backend(name)   # what runs each pass: ops.py's numpy, or kernels/ (backend.py)
        self._backend = name
        self._warm_up()

    def _warm_up(self, kv_dtype: str = "float32") -> None:
        """Compile (or load from numba's on-disk cache) the kernels this model's formats, activations setting and a
        KV cache of kv_dtype need, so that no step pays for it (a no-op for what is warm already)."""
        self.jit_s += self.compute.warm_up(self, kv_dtype)

    def warm_up_pool(self, pool) -> None:
        """Compile what batched steps over a paged pool (paged.py) need, now rather than in the first step."""
        self.jit_s += self.compute.warm_up_paged(self, pool.kv_dtype)

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, name: str) -> None:
        """"float32": quantized matrices multiply the float32 activations (weight-only quantization). "int8": they
        multiply the activations rounded to int8 blocks, in integer arithmetic (quant.py; faster, less exact)."""
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown activations {name!r}; choose one of: {', '.join(ACTIVATIONS)}")
        if name == "int8" and not any(isinstance(w, QuantizedWeight) for w in self._matrices()):
            raise ValueError("activations='int8' needs quantized weights: load with quant='int8', 'int8-block', "
                             "'q4_1' or 'native'")
        self._activations = name
        self.int8_inputs = name == "int8"   # what every linear of the forward pass is told
        if hasattr(self, "_backend"):       # (set after this in __init__)
            self._warm_up()

    # --- the three public ways in ----------------------------------------------------------------------------
    def logits(self, ids, trace=None, ablate=(), patch=()) -> np.ndarray:
        """No-cache reference forward over the whole sequence. -> [T, V] float32 (trace: a trace.Trace to fill;
        ablate: (layer, head) pairs whose output is zeroed; patch: interventions.Patch values put in place)"""
        edit = make_interventions(self.config, ablate, patch)
        if edit is not None:
            edit.check_positions(len(self._check_ids(ids)))
        return self.forward(ids, cache=None, trace=trace, edit=edit)

    def prefill(self, ids, cache: ContiguousKVCache, trace=None, edit=None) -> np.ndarray:
        """Run the prompt through, filling `cache`. -> [V] logits of the last prompt position.

        A long prompt goes through in chunks of the backend's prefill_chunk tokens (the kernels': each chunk's
        linears and attention run in the Numba kernels, its activations stay cache-sized, and no [T, S] score
        matrix is ever made; the numpy backend takes the prompt in one pass). Only the last position's logits are
        computed: the output head is V x D per row, and a prompt's other rows would be thrown away.
        """
        ids = self._check_ids(ids)
        self._check_room(len(ids), cache)                           # all or nothing: no chunk is cached if it fails
        start = 0
        while start < len(ids):
            chunk = self.compute.prefill_chunk(len(ids) - start)
            logits = self.forward(ids[start:start + chunk], cache=cache, last_only=True, trace=trace, edit=edit)[0]
            start += chunk
        return logits

    def decode_step(self, token_id: int, cache: ContiguousKVCache, trace=None, edit=None) -> np.ndarray:
        """One new token at position cache.length, attending to everything cached. -> [V] logits
        (edit: an interventions.Interventions applied to this pass, as generate(ablate=..., patch=...) passes)"""
        return self.forward([token_id], cache=cache, trace=trace, edit=edit)[0]

    def new_cache(self, max_seq_len: int | None = None, kv_dtype: str = "float32") -> ContiguousKVCache:
        """A contiguous KV cache for up to `max_seq_len` positions (default: the model's context length), storing
        K and V as kv_dtype: "float32", "float16" or "int8" (kv_cache.py)."""
        n = self.config.context_length if max_seq_len is None else max_seq_len
        if n > self.config.context_length:
            raise ValueError(f"max_seq_len {n} exceeds the model's context length {self.config.context_length}")
        cache = ContiguousKVCache(self.config, n, kv_dtype)
        self._warm_up(cache.kv_dtype)       # the kernels of this cache format, compiled now rather than mid-request
        return cache

    def decode_batch(self, token_ids, caches: list) -> np.ndarray:
        """One new token for each of B sequences, each at its own position in its own cache. -> [B, V]

        The B rows go through every weight matrix together, so one read of the weights serves all of them:
        the reason batching raises throughput when decode is memory-bound.
        """
        return np.concatenate(self.forward_batch([[t] for t in token_ids], caches))

    # --- the forward pass -------------------------------------------------------------------------------------
    def forward(self, ids, cache: ContiguousKVCache | None = None, last_only: bool = False,
                trace=None, edit=None) -> np.ndarray:
        """Tokens `ids` at positions cache.length .. (or 0 .. without a cache). -> [T, V] (or [1, V] if last_only)"""
        return self.forward_batch([ids], [cache], last_only=last_only, trace=trace, edit=edit)[0]

    def forward_batch(self, seqs: list, caches: list, last_only: bool = False, trace=None,
                      edit=None) -> list[np.ndarray]:
        """Several sequences in one pass: their token rows are stacked into one [N, D] activation, so every
        matrix multiply runs once for all of them; only attention is done per sequence, against its own cache.
        -> per sequence, [T_j, V] logits (or [1, V] with last_only). trace (trace.Trace, one sequence only):
        records what each layer computes; edit (interventions.Interventions, one sequence only): ablations and
        patches. Either makes the pass run op by op."""
        if len(seqs) != len(caches) or not seqs:
            raise ValueError(f"need one cache (or None) per sequence, got {len(seqs)} sequences, {len(caches)} caches")
        ids = [self._check_ids(s) for s in seqs]
        segments, row = [], 0
        for seq_ids, cache in zip(ids, caches):
            T, start = len(seq_ids), (0 if cache is None else cache.length)
            self._check_room(T, cache)
            segments.append(Segment(slice(row, row + T), cache, start))
            row += T
        positions = np.concatenate([np.arange(s.start, s.start + s.n_tokens) for s in segments])   # [N]
        ops = self.compute.ops_for(row)                             # the functions a pass of this many rows runs
        if self.alibi_slopes is not None:                           # ALiBi: attention with its bias, in numpy
            ops = AlibiOps(ops, self.alibi_slopes)
        if trace is not None:
            if len(segments) != 1:
                raise ValueError("a trace follows one sequence: trace a forward pass of a single sequence")
            trace.begin_pass(self, ids[0], segments[0].start)
        if edit is not None and len(segments) != 1:
            raise ValueError("interventions follow one sequence: ablate or patch a forward pass of a single sequence")
        watched = trace is not None or edit is not None             # op by op, over its one sequence

        x = self._embed(np.concatenate(ids))                        # [N, D]
        if self.config.embed_scale != 1.0:                          # granite
            x = x * np.float32(self.config.embed_scale)
        rope = None                                                 # (ALiBi's positions enter in attention)
        if self.pos_embed is not None:                              # gpt2: learned absolute positions
            x = x + self.pos_embed[positions]
        elif self.config.arch == "llama":                           # RoPE: each row's rotation angles
            rope = self.rope_cos[positions], self.rope_sin[positions]   # 2 x [N, Dh/2]
        if not watched and self.compute.fuses(row) and self._fusable(segments):
            self.compute.decode_blocks(self, x, segments[0].start, segments[0].cache)   # x [T, D], in place
        else:
            # who attends with whom, the same in every layer (a traced pass: its one sequence, read as a Segment)
            groups = attention_groups(segments) if not watched else segments
            for pool in {id(g.pool): g.pool for g in groups if hasattr(g, "pool")}.values():
                self.compute.warm_up_paged(self, pool.kv_dtype)   # (a no-op once warm: see warm_up_pool)
            # its thread count follows the machine (threads.py): a decode step's by a governor per number of
            # sequences and power of two of rows (steps of one shape take about the same time), a prompt's pass by
            # the cores free when it starts
            shape = ("ops", len(segments), 1 << (row - 1).bit_length())
            with self.compute.governed(shape, probe=row <= PROBED_ROWS) if not watched else nullcontext():
                for i, layer in enumerate(self.layers):
                    x = self._block(ops, x, layer, i, rope, groups, trace, edit)   # [N, D]
        for s in segments:
            if s.cache is not None:
                s.cache.length = s.start + s.n_tokens
        if last_only:
            x = x[[s.rows.stop - 1 for s in segments]]              # [B, D]: each sequence's last row
        x = self._norm(ops, x, self.final_norm, self.final_norm_b)
        logits = ops.linear(x, self.lm_head, int8_inputs=self.int8_inputs)   # [N, V] or [B, V]
        if self.config.logit_scale != 1.0:                          # granite
            logits = logits / np.float32(self.config.logit_scale)
        if last_only:
            return [logits[j:j + 1] for j in range(len(segments))]
        return [logits[s.rows] for s in segments]

    def _block(self, ops, x, layer: LayerWeights, i: int, rope, groups: list, trace=None, edit=None) -> np.ndarray:
        """One transformer block: x + attention(norm(x)), then x + mlp(norm(x)). x [N, D] -> [N, D]
        ops: the functions this pass runs on (the backend's `ops_for` its row count)."""
        x_in = x
        c, int8_inputs = self.config, self.int8_inputs
        T, H, KVH, Dh = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim

        # attention
        h = x if c.post_norm else self._norm(ops, x, layer.attn_norm, layer.attn_norm_b)   # [T, D]
        qkv = ops.linear(h, layer.wqkv, layer.bqkv, int8_inputs=int8_inputs)   # [T, (H + 2*KVH) * Dh]
        if c.clip_qkv:                                              # MPT: q, k, v clamped
            qkv = np.clip(qkv, np.float32(-c.clip_qkv), np.float32(c.clip_qkv))
        q = qkv[:, :H * Dh].reshape(T, H, Dh)                       # [T, H, Dh]
        k = qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh)      # [T, KVH, Dh]
        v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)            # [T, KVH, Dh]
        if c.qk_norm:                                               # RMSNorm of each head's q and k (qwen3), or of
            rows = (T * H, T * KVH) if c.qk_norm == "head" else (T, T)    # all heads' values together (olmo2)
            q = ops.rmsnorm(q.reshape(rows[0], -1), layer.q_norm, c.norm_eps).reshape(T, H, Dh)
            k = ops.rmsnorm(k.reshape(rows[1], -1), layer.k_norm, c.norm_eps).reshape(T, KVH, Dh)
        if rope is not None:                                        # rotate q and k by their positions
            q, k = self._rope(ops, q, rope), self._rope(ops, k, rope)
        if len(groups) == 1:                                        # one sequence (or one batch): all the rows
            att = groups[0].attend(i, q, k, v, ops)                 # [T, H*Dh]
        else:                                                       # several: each against its own cache
            att = np.empty((T, H * Dh), dtype=np.float32)
            for g in groups:
                att[g.rows] = g.attend(i, q[g.rows], k[g.rows], v[g.rows], ops)
        if edit is not None:                                        # heads ablated or patched (one sequence)
            att = edit.heads(i, att, groups[0].start)               # [T, H*Dh]
        out = ops.linear(att, layer.wo, layer.bo, int8_inputs=int8_inputs)   # [T, D]
        x = x + (self._norm(ops, out, layer.attn_post_norm, None) if c.post_norm else out)   # (olmo2: normed)
        x_mid = x

        # feed-forward (gpt-neox: on the block's input, beside attention, not after it)
        h = x if c.post_norm else self._norm(ops, x_in if c.parallel_residual else x, layer.ffn_norm,
                                             layer.ffn_norm_b)             # [T, D]
        if c.mlp == "swiglu":
            h = ops.swiglu(ops.linear(h, layer.w_in, int8_inputs=int8_inputs))   # [T, 2F] -> [T, F]: silu(gate) * up
        else:
            gelu = ops.gelu_tanh if c.mlp == "gelu_tanh" else ops.gelu
            h = gelu(ops.linear(h, layer.w_in, layer.b_in, int8_inputs=int8_inputs))   # [T, F]
        out = ops.linear(h, layer.w_out, layer.b_out, int8_inputs=int8_inputs)             # [T, D]
        x = x + (self._norm(ops, out, layer.ffn_post_norm, None) if c.post_norm else out)
        if edit is not None:                                        # the residual stream patched
            x = edit.residual(i, x, groups[0].start)                # [T, D]
        if trace is not None and trace.records_layer(i):
            cache, start = groups[0].cache, groups[0].start             # a traced pass has one sequence
            if cache is not None:                                   # what attention read: the stored, rounded K/V
                k, v = cache.stored(i, start, start + T)            # (and q as it used it)
                q = query_for(cache.kv_dtype, q)
            trace.record_layer(i, q, k, v, x_in, x_mid, x)
        return x

    def _check_room(self, n_new: int, cache) -> None:
        """A clear error if n_new more tokens would pass the model's context length or the cache's capacity."""
        start = 0 if cache is None else cache.length
        if start + n_new > self.config.context_length:
            raise ValueError(f"sequence of {start + n_new} tokens exceeds the model's context length "
                             f"{self.config.context_length}; shorten the prompt or generate fewer tokens")
        if cache is not None:
            cache.check_room(n_new)

    def _fusable(self, segments: list[Segment]) -> bool:
        """Can this pass run each block as one call: one sequence whose K and V are one run of positions (a
        contiguous cache, or a paged sequence on consecutive blocks), through Llama blocks without attention biases
        (the row count is the backend's to judge: `fuses`)?"""
        return (self.fused_decode and len(segments) == 1 and segments[0].cache is not None
                and self.has_fusable_blocks and segments[0].cache.contiguous() is not None)

    @property
    def has_fusable_blocks(self) -> bool:
        """Llama blocks without attention biases or q/k norms: what the kernels' one-call block computes
        (kernels/block.py)."""
        c = self.config
        return (c.arch == "llama" and c.norm == "rms" and c.mlp == "swiglu" and c.rope_dim == c.head_dim
                and not (c.attn_bias or c.qkv_bias or c.qk_norm or c.parallel_residual or c.post_norm))

    def _matrices(self) -> list:
        """Every weight that goes through `linear`."""
        mats = [self.lm_head]
        for layer in self.layers:
            mats += [layer.wqkv, layer.wo, layer.w_in, layer.w_out]
        return mats

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the embedding table for `ids` (dequantized row by row if the table is quantized). -> [T, D]"""
        if isinstance(self.tok_embed, QuantizedWeight):
            return self.tok_embed.dequantize(ids)
        return self.tok_embed[ids]

    def _rope(self, ops, x, rope):
        """RoPE on each head's first rope_dim dims (all of them, but in gpt-neox). x [T, nh, Dh] -> [T, nh, Dh]"""
        r = self.config.rope_dim
        if r == x.shape[-1]:
            return ops.apply_rope(x, *rope)
        return np.concatenate([ops.apply_rope(np.ascontiguousarray(x[..., :r]), *rope), x[..., r:]], axis=-1)

    def _norm(self, ops, x, weight, bias):
        if self.config.norm == "rms":
            return ops.rmsnorm(x, weight, self.config.norm_eps)
        return ops.layernorm(x, weight, bias, self.config.norm_eps)

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0 .. {self.config.vocab_size - 1})")
        return ids.astype(np.int64)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weight arrays (the tied output head counted once)."""
        seen, total = set(), 0
        arrays = [self.tok_embed, self.lm_head, self.final_norm, self.final_norm_b, self.pos_embed]
        for layer in self.layers:
            arrays.extend(getattr(layer, f.name) for f in dataclasses.fields(layer))
        for a in arrays:
            if a is not None and id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes
        return total

    @property
    def tied_head(self) -> bool:
        return self.lm_head is self.tok_embed

    def __repr__(self) -> str:
        c = self.config
        return (f"Transformer({c.name or c.arch}: {c.n_layers} layers, D={c.dim}, H={c.n_heads}, "
                f"KVH={c.n_kv_heads}, V={c.vocab_size}, {c.n_params / 1e6:.1f}M params, {self.quant} weights "
                f"{self.weight_bytes / 2**20:.0f} MiB, {self.activations} activations, backend={self.backend})")


class AlibiOps:
    """A backend's ops with ALiBi's bias added in attention (ops.attention's slopes). The Numba attention kernels
    take no bias, so an ALiBi model's attention runs in numpy on either backend (its linears stay the backend's)."""

    def __init__(self, base, slopes: np.ndarray):
        self.base, self.slopes = base, slopes               # slopes [H]

    def __getattr__(self, name):                            # linear, layernorm, gelu...: the backend's own
        return getattr(self.base, name)

    def attention(self, q, k, v, start: int) -> np.ndarray:
        """q [T, H, Dh], k, v [S, KVH, Dh] in any stored format -> [T, H*Dh]"""
        return attention(*attention_inputs(q, k, v), start, self.slopes)

    def paged_attention(self, q, k_blocks, v_blocks, block_tables, context_lens) -> np.ndarray:
        """q [B, H, Dh] against each sequence's blocks -> [B, H*Dh]"""
        return paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, attend=self.attention)
