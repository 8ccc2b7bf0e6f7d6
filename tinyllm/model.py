"""The transformer: one forward pass, used three ways.

    logits(ids)              no cache: the whole sequence at once (the reference every other path must match)
    prefill(ids, cache)      the prompt in one pass: big matmuls (compute-bound), fills the cache
    decode_step(id, cache)   one new token: reads every weight and the whole cache (memory-bound)

All three run the same `forward`; the only difference is where K and V come from. Two families share the
code: Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases) and GPT-2 (LayerNorm, learned
positions, GELU, biases). Weights arrive as canonical named arrays from weights.py.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from . import kernels, ops, paged
from .config import ModelConfig
from .kv_cache import ContiguousKVCache
from .quant import QuantizedWeight

BACKENDS = ("numba", "numpy")
ACTIVATIONS = ("float32", "int8")


def fuse_rows(parts):
    """Stack [O_i, I] matrices into one [sum O_i, I] (float arrays or quantized weights of one type)."""
    if parts[0] is None:
        return None
    if isinstance(parts[0], QuantizedWeight):
        if len({type(p) for p in parts}) > 1:
            raise ValueError(f"cannot fuse weights of mixed formats {[type(p).__name__ for p in parts]}")
        return type(parts[0]).concat_rows(parts)
    return np.concatenate(parts)


@dataclass
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

    @functools.cached_property
    def matrix_arrays(self) -> tuple:
        """(wqkv, wo, w_in, w_out), each as the tuple of its arrays: what kernels.decode_block takes."""
        return tuple(kernels.weight_arrays(w) for w in (self.wqkv, self.wo, self.w_in, self.w_out))


class Transformer:
    """A loaded model: config, weights, tokenizer, and the forward pass. Build it with `tinyllm.load`.

    backend="numba" (default) runs the matrix-vector products and decode attention in the Numba kernels of
    kernels.py; backend="numpy" runs everything in the plain numpy of ops.py, to read or step through.
    Both give the same tokens (tests/test_kernels.py), bit for bit with float32 activations; with
    activations="int8" rounding can amplify their last-bit differences (quant.py).
    """

    def __init__(self, config: ModelConfig, weights: dict, tokenizer=None, backend: str = "numba",
                 quant: str | None = None, quant_report: list | None = None, activations: str = "float32"):
        self.config = config
        self.tokenizer = tokenizer
        self.quant = quant or "fp32"
        self.quant_report = quant_report or []
        self.jit_s = 0.0                    # seconds spent compiling / loading kernels (numba backend)
        self.fused_decode = True            # numba backend: a step of a few tokens runs each block as one call
        c = config
        self.tok_embed = weights["tok_embed"]                      # [V, D]
        self.lm_head = weights.get("lm_head", self.tok_embed)      # [V, D]; the same array when tied
        self.final_norm = weights["final_norm"]                    # [D]
        self.final_norm_b = weights.get("final_norm_b")
        self.pos_embed = weights.get("pos_embed")                  # [context, D] (gpt2 only)
        self.layers = []
        for i in range(c.n_layers):
            w = lambda name: weights.get(f"layers.{i}.{name}")     # noqa: E731
            fuse = lambda *names: fuse_rows([w(n) for n in names])  # noqa: E731
            self.layers.append(LayerWeights(
                attn_norm=w("attn_norm"), attn_norm_b=w("attn_norm_b"),
                wqkv=fuse("wq", "wk", "wv"), bqkv=fuse("bq", "bk", "bv"),
                wo=w("wo"), bo=w("bo"),
                ffn_norm=w("ffn_norm"), ffn_norm_b=w("ffn_norm_b"),
                w_in=fuse("w_gate", "w_up") if c.arch == "llama" else w("w_fc"), b_in=w("b_fc"),
                w_out=w("w_down") if c.arch == "llama" else w("w_proj"), b_out=w("b_proj"),
            ))
        if c.arch == "llama":  # one table of rotation angles for every position the model supports
            self.rope_cos, self.rope_sin = ops.rope_tables(c.head_dim, c.context_length, c.rope_theta)
        self.activations = activations      # validated by its property setter, like backend
        self.backend = backend              # validated (and kernels warmed up) by the property setter below

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
        if name == "numba":
            from . import kernels
            # compile (or load from numba's on-disk cache) what this model needs: not part of any step
            self.jit_s = kernels.warmup({type(w) for w in self._matrices()})
            self.ops = kernels              # the same function names as ops.py, hot ones as Numba kernels
        else:
            self.ops = ops
        self._backend = name

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, name: str) -> None:
        """"float32": quantized matrices multiply the float32 activations (weight-only quantization). "int8": they
        multiply the activations rounded to int8 blocks, in integer arithmetic (quant.py; faster, less exact)."""
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown activations {name!r}; choose one of: {', '.join(ACTIVATIONS)}")
        quantized = [w for w in self._matrices() if isinstance(w, QuantizedWeight)]
        if name == "int8" and not quantized:
            raise ValueError("activations='int8' needs quantized weights: load with quant='int8', 'int8-block', "
                             "'q4_1' or 'native'")
        for w in quantized:
            w.int8_inputs = name == "int8"
        self._activations = name

    # --- the three public ways in ----------------------------------------------------------------------------
    def logits(self, ids) -> np.ndarray:
        """No-cache reference forward over the whole sequence. -> [T, V] float32"""
        return self.forward(ids, cache=None)

    def prefill(self, ids, cache: ContiguousKVCache) -> np.ndarray:
        """Run the prompt through in one pass, filling `cache`. -> [V] logits of the last prompt position.

        Only the last position's logits are computed: the output head is V x D per row, and a prompt's other
        rows would be thrown away.
        """
        return self.forward(ids, cache=cache, last_only=True)[0]

    def decode_step(self, token_id: int, cache: ContiguousKVCache) -> np.ndarray:
        """One new token at position cache.length, attending to everything cached. -> [V] logits"""
        return self.forward([token_id], cache=cache)[0]

    def new_cache(self, max_seq_len: int | None = None) -> ContiguousKVCache:
        """A contiguous KV cache for up to `max_seq_len` positions (default: the model's context length)."""
        n = self.config.context_length if max_seq_len is None else max_seq_len
        if n > self.config.context_length:
            raise ValueError(f"max_seq_len {n} exceeds the model's context length {self.config.context_length}")
        return ContiguousKVCache(self.config, n)

    def decode_batch(self, token_ids, caches: list) -> np.ndarray:
        """One new token for each of B sequences, each at its own position in its own cache. -> [B, V]

        The B rows go through every weight matrix together, so one read of the weights serves all of them:
        the reason batching raises throughput when decode is memory-bound.
        """
        return np.concatenate(self.forward_batch([[t] for t in token_ids], caches))

    # --- the forward pass -------------------------------------------------------------------------------------
    def forward(self, ids, cache: ContiguousKVCache | None = None, last_only: bool = False) -> np.ndarray:
        """Tokens `ids` at positions cache.length .. (or 0 .. without a cache). -> [T, V] (or [1, V] if last_only)"""
        return self.forward_batch([ids], [cache], last_only=last_only)[0]

    def forward_batch(self, seqs: list, caches: list, last_only: bool = False) -> list[np.ndarray]:
        """Several sequences in one pass: their token rows are stacked into one [N, D] activation, so every
        matrix multiply runs once for all of them; only attention is done per sequence, against its own cache.
        -> per sequence, [T_j, V] logits (or [1, V] with last_only)."""
        if len(seqs) != len(caches) or not seqs:
            raise ValueError(f"need one cache (or None) per sequence, got {len(seqs)} sequences, {len(caches)} caches")
        ids = [self._check_ids(s) for s in seqs]
        segments, positions, row = [], [], 0      # segment: (rows of this sequence, its cache, its start position)
        for seq_ids, cache in zip(ids, caches):
            T, start = len(seq_ids), (0 if cache is None else cache.length)
            if start + T > self.config.context_length:
                raise ValueError(f"sequence of {start + T} tokens exceeds the model's context length "
                                 f"{self.config.context_length}; shorten the prompt or generate fewer tokens")
            if cache is not None:
                cache.check_room(T)
            segments.append((slice(row, row + T), cache, start))
            positions.append(np.arange(start, start + T))
            row += T
        positions = np.concatenate(positions)                       # [N] each row's position in its sequence

        x = self._embed(np.concatenate(ids))                        # [N, D]
        if self.pos_embed is not None:                              # gpt2: learned absolute positions
            x = x + self.pos_embed[positions]
            rope = None
        else:                                                       # llama: each row's rotation angles
            rope = self.rope_cos[positions], self.rope_sin[positions]   # 2 x [N, Dh/2]
        # which rows attend how is the same in every layer, so it is worked out once: PagedAttention (Kwon et al.
        # 2023) for the one-token rows of sequences in one paged pool (a single call that reads each sequence's
        # blocks through its block table, paged.py), a loop over the other sequences
        batch, loose = paged.DecodeBatch.split(segments)
        if self._fusable(x, batch, loose):
            self._fused_decode_blocks(x, *loose[0][1:])             # x [T, D], updated in place
        else:
            for i, layer in enumerate(self.layers):
                x = self._block(x, layer, i, rope, batch, loose)    # [N, D]
        for rows, cache, start in segments:
            if cache is not None:
                cache.length = start + (rows.stop - rows.start)
        if last_only:
            x = x[[rows.stop - 1 for rows, _, _ in segments]]       # [B, D]: each sequence's last row
        x = self._norm(x, self.final_norm, self.final_norm_b)
        logits = self.ops.linear(x, self.lm_head)                   # [N, V] or [B, V]
        if last_only:
            return [logits[j:j + 1] for j in range(len(segments))]
        return [logits[rows] for rows, _, _ in segments]

    def _block(self, x, layer: LayerWeights, i: int, rope, batch, loose: list) -> np.ndarray:
        """One transformer block: x + attention(norm(x)), then x + mlp(norm(x)). x: [N, D] -> [N, D]"""
        c, o = self.config, self.ops
        T, H, KVH, Dh = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim

        # attention
        h = self._norm(x, layer.attn_norm, layer.attn_norm_b)      # [T, D]
        qkv = o.linear(h, layer.wqkv, layer.bqkv)                   # [T, (H + 2*KVH) * Dh]
        q = qkv[:, :H * Dh].reshape(T, H, Dh)                       # [T, H, Dh]
        k = qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh)      # [T, KVH, Dh]
        v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)            # [T, KVH, Dh]
        if rope is not None:                                        # rotate q and k by their positions
            q, k = o.apply_rope(q, *rope), o.apply_rope(k, *rope)
        # past SMALL_M rows the numba backend's linears run on BLAS; attention then runs in numpy too, so that
        # BLAS's and Numba's threads never take turns on the same cores within one pass (kernels.py, "dispatch")
        blas_pass = self.backend == "numba" and T > kernels.SMALL_M
        o_att, att_backend = (ops, "numpy") if blas_pass else (o, self.backend)
        if batch is None and len(loose) == 1:                       # one sequence: attend over its whole history
            _, cache, start = loose[0]
            if cache is not None:                                   # store this step's K/V, read back all of it
                k, v = cache.update(i, start, k, v)                 # [S, KVH, Dh], S = start + T
            att = o_att.attention(q, k, v, start)                   # [T, H*Dh]
        else:                                                       # several: each against its own cache
            att = np.empty((T, H * Dh), dtype=np.float32)
            if batch is not None:                                   # paged one-token rows: one call
                att[batch.rows] = batch.attend(i, q[batch.rows], k[batch.rows], v[batch.rows], att_backend)
            for rows, cache, start in loose:
                k_s, v_s = k[rows], v[rows]
                if cache is not None:
                    k_s, v_s = cache.update(i, start, k_s, v_s)
                att[rows] = o_att.attention(q[rows], k_s, v_s, start)
        x = x + o.linear(att, layer.wo, layer.bo)                   # [T, D]

        # feed-forward
        h = self._norm(x, layer.ffn_norm, layer.ffn_norm_b)        # [T, D]
        if c.arch == "llama":
            h = o.swiglu(o.linear(h, layer.w_in))                   # [T, 2F] -> [T, F]: silu(gate) * up
        else:
            h = o.gelu_tanh(o.linear(h, layer.w_in, layer.b_in))    # [T, F]
        return x + o.linear(h, layer.w_out, layer.b_out)            # [T, D]

    def _fusable(self, x, batch, loose: list) -> bool:
        """Can this pass take the fused path: a few tokens (a decode step, a verification) of one sequence on a
        contiguous cache, through Llama blocks (no attention biases), on the numba backend?"""
        return (self.fused_decode and self.backend == "numba" and self.ops.FUSED_DECODE and batch is None
                and len(loose) == 1 and x.shape[0] <= self.ops.FEW_TOKENS and type(loose[0][1]) is ContiguousKVCache
                and self.config.arch == "llama" and not self.config.attn_bias)

    def _fused_decode_blocks(self, x, cache: ContiguousKVCache, start: int) -> None:
        """The fast twin of the `_block` loop for a few new tokens: each layer is one call of kernels.decode_block,
        which runs the same kernels with no Python between them (tests/test_model.py checks the two agree)."""
        c, T = self.config, x.shape[0]
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]   # [T, Dh/2] each
        for i, layer in enumerate(self.layers):
            int8_inputs = tuple(getattr(w, "int8_inputs", False) for w in (layer.wqkv, layer.wo, layer.w_in,
                                                                            layer.w_out))
            self.ops.decode_block(x, layer.attn_norm, layer.ffn_norm, *layer.matrix_arrays, int8_inputs,
                                  cache.k[i], cache.v[i], start, cos, sin, c.n_heads, c.norm_eps)

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

    def _norm(self, x, weight, bias):
        if self.config.arch == "llama":
            return self.ops.rmsnorm(x, weight, self.config.norm_eps)
        return self.ops.layernorm(x, weight, bias, self.config.norm_eps)

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
        return (f"Transformer({c.name or c.arch}: {c.n_layers} layers, D={c.dim}, H={c.n_heads}, KVH={c.n_kv_heads}, "
                f"V={c.vocab_size}, {c.n_params / 1e6:.1f}M params, {self.quant} weights {self.weight_bytes / 2**20:.0f} "
                f"MiB, {self.activations} activations, backend={self.backend})")
