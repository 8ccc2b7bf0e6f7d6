"""The whole idea of LLM inference in plain numpy: read this file first.

    config, weights = reference.load()                   # the default model as float32 arrays
    ids = generate(config, weights, prompt_ids, max_new_tokens=20)

A prompt becomes token ids; `prefill` runs them all through the model at once and keeps every layer's keys and
values in a cache; `decode_step` then runs one new token at a time, attending to the cache instead of redoing
the past; `sample` turns each step's logits into the next id. One block for every family: Llama (RMSNorm, RoPE,
grouped-query attention, SwiGLU; with the flags of its kin: Qwen's q/k/v biases or q/k norms, Llama 3's RoPE
scaling, Granite's scales, Falcon's parallel MLP), GPT-2 (LayerNorm, learned positions, GELU, biases) and the ALiBi
families (MPT, Falcon-RW: positions as a per-head bias on the attention scores).
Left out, on purpose: quantized weights, the Numba kernels, paged caches, batching, tracing. The engine
(model.py, kernels/) does all of that and is tested to give the same logits as this file.
Shapes: T tokens in this pass, S cached positions, D width, H query heads, KVH key/value heads, Dh head dim,
G = H / KVH query heads per KV head, F feed-forward width, V vocabulary, L layers (config.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig


# --- loading: a checkpoint as plain float32 arrays ------------------------------------------------------------
def load(path=None) -> tuple[ModelConfig, dict]:
    """(config, weights) of a .gguf file or Hugging Face directory (the default model when path is None)."""
    from . import hub
    from .weights import load_checkpoint

    config, flat, _tokenizer, _ = load_checkpoint(hub.ensure_default_model() if path is None else path)
    return config, plain_weights(config, flat)


def plain_weights(config: ModelConfig, flat: dict) -> dict:
    """The loaders' canonical names ("layers.3.wqkv", ...) as {"layers": [one dict per layer], ...}, float32."""
    from .weights import fuse_layer_matrices

    def f32(w):
        if w is None:
            return None
        return np.asarray(w.dequantize() if hasattr(w, "dequantize") else w, dtype=np.float32)

    flat = fuse_layer_matrices(dict(flat), config.n_layers)   # q|k|v stacked into wqkv, gate|up into w_in
    weights = {name: f32(flat.get(name)) for name in ("tok_embed", "final_norm", "final_norm_b", "pos_embed",
                                                       "rope_freqs", "alibi_slopes")}
    weights["lm_head"] = f32(flat["lm_head"]) if "lm_head" in flat else weights["tok_embed"]   # tied: the same
    names = {"w_fc": "w_in", "b_fc": "b_in", "w_down": "w_out", "w_proj": "w_out", "b_proj": "b_out"}
    weights["layers"] = []
    for i in range(config.n_layers):
        prefix = f"layers.{i}."
        layer = {names.get(k[len(prefix):], k[len(prefix):]): f32(w) for k, w in flat.items() if k.startswith(prefix)}
        weights["layers"].append(layer)
    return weights


# --- the pieces of a block -------------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    """Llama's norm: divide each row by its root mean square, then scale per channel."""
    ms = np.mean(x * x, axis=-1, keepdims=True)                    # [T, 1]
    return x * (1.0 / np.sqrt(ms + eps)) * weight                  # [T, D]


def layer_norm(x, weight, bias, eps):
    """GPT-2's norm: subtract each row's mean, divide by its standard deviation, scale and shift (MPT: no shift)."""
    mu = np.mean(x, axis=-1, keepdims=True)                        # [T, 1]
    xc = x - mu                                                    # [T, D]
    var = np.mean(xc * xc, axis=-1, keepdims=True)                 # [T, 1]
    y = xc / np.sqrt(var + eps) * weight                           # [T, D]
    return y if bias is None else y + bias


def norm(config: ModelConfig, x, weight, bias):
    """The family's norm: RMSNorm for Llama, LayerNorm (with its bias, but in MPT) for GPT-2 and the others."""
    if config.norm == "rms":
        return rms_norm(x, weight, config.norm_eps)
    return layer_norm(x, weight, bias, config.norm_eps)


def linear(x, w, b=None):
    """y = x W^T + b, with W stored [out, in] as PyTorch and GGUF store it."""
    y = x @ w.T                                                    # [T, in] @ [in, out] -> [T, out]
    return y if b is None else y + b


def rope(x, positions, theta, freq_factors=None):
    """Rotary position embedding (Su et al. 2021): rotate pair (i, i + Dh/2) of every head by position * freq_i.

    Dot products of rotated q and k then depend only on the distance between their positions. (GGUF files store
    q/k rows permuted for adjacent pairs; weights.py undoes that, so this half-split pairing holds everywhere.)
    freq_factors [Dh/2]: Llama 3.x slows its low frequencies down by these (ops.llama3_rope_factors).
    """
    Dh = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)          # [Dh/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors                                      # [Dh/2]
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)       # [T, Dh/2]
    cos = np.cos(angles).astype(np.float32)[:, None, :]                         # [T, 1, Dh/2]: same for all heads
    sin = np.sin(angles).astype(np.float32)[:, None, :]                         # [T, 1, Dh/2]
    x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]                                 # [T, heads, Dh/2] each
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [T, heads, Dh]


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))            # shifted by the max: exp never overflows
    return e / np.sum(e, axis=axis, keepdims=True)


def attention(q, k, v, start, alibi_slopes=None):
    """Causal attention with grouped-query heads: query head h reads KV head h // G, so G query heads share one K, V.

    q [T, H, Dh] at positions start .. start+T-1; k, v [S, KVH, Dh] at positions 0 .. S-1. -> [T, H*Dh]
    alibi_slopes [H] (ALiBi, Press et al. 2022): head h's scores drop by slope_h per position of distance.
    """
    T, H, Dh = q.shape
    S, KVH, _ = k.shape
    distance = np.arange(S)[None, :] - (start + np.arange(T)[:, None])   # [T, S]: key position - query position
    visible = distance <= 0                                            # [T, S]: no token sees its future
    out = np.empty((T, H, Dh), dtype=np.float32)
    for h in range(H):
        kv = h // (H // KVH)                                           # the KV head this query head reads
        scores = q[:, h] @ k[:, kv].T * np.float32(1.0 / np.sqrt(Dh))  # [T, S]: how well each query fits each key
        if alibi_slopes is not None:
            scores = scores + alibi_slopes[h] * distance.astype(np.float32)   # farther keys score lower
        probs = softmax(np.where(visible, scores, -np.inf))            # [T, S]: each row sums to 1
        out[:, h] = probs @ v[:, kv]                                   # [T, Dh]: a mix of the values
    return out.reshape(T, H * Dh)                                      # [T, H*Dh]


def swiglu(x, w_in):
    """Llama's MLP input: silu(x W_gate^T) * (x W_up^T), gate and up rows stacked in w_in [2F, D]. -> [T, F]"""
    gate_up = x @ w_in.T                                           # [T, 2F]
    gate, up = np.split(gate_up, 2, axis=-1)                       # [T, F] each
    return gate / (1.0 + np.exp(-gate)) * up                       # silu(gate) * up


def gelu(x, exact=False):
    """GELU: x * Phi(x), the tanh approximation GPT-2 uses, or exactly (GPT-NeoX) with erf."""
    if exact:
        return (0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)))).astype(np.float32)
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


# --- the KV cache: what decode reads instead of recomputing the past -------------------------------------------
@dataclass
class KVCache:
    k: np.ndarray          # [L, S_max, KVH, Dh]: every layer's keys, one row per position
    v: np.ndarray          # [L, S_max, KVH, Dh]
    length: int = 0        # positions filled so far


def new_cache(config: ModelConfig, max_len: int | None = None) -> KVCache:
    shape = (config.n_layers, max_len or config.context_length, config.n_kv_heads, config.head_dim)
    return KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32))   # 2 x [L, S_max, KVH, Dh]


# --- the forward pass ---------------------------------------------------------------------------------------------
def block(config: ModelConfig, layer: dict, i: int, x, positions, cache: KVCache | None, rope_freqs=None,
          alibi_slopes=None):
    """One transformer block: x + attention(norm(x)), then x + mlp(norm(x)). x [T, D] -> [T, D]"""
    c, T, x_in = config, x.shape[0], x
    H, KVH, Dh, r = c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim

    h = x if c.post_norm else norm(c, x, layer["attn_norm"], layer.get("attn_norm_b"))   # [T, D] (olmo2: after)
    qkv = linear(h, layer["wqkv"], layer.get("bqkv"))              # [T, (H + 2*KVH) * Dh]: q, k, v side by side
    if c.clip_qkv:                                                 # MPT: every value clamped
        qkv = np.clip(qkv, np.float32(-c.clip_qkv), np.float32(c.clip_qkv))
    q = qkv[:, :H * Dh].reshape(T, H, Dh)                          # [T, H, Dh]
    k = qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh)         # [T, KVH, Dh]
    v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)               # [T, KVH, Dh]
    if c.qk_norm == "head":                                        # qwen3: RMSNorm of each head's q and k
        q, k = rms_norm(q, layer["q_norm"], c.norm_eps), rms_norm(k, layer["k_norm"], c.norm_eps)
    elif c.qk_norm == "all":                                       # olmo2: of all heads' q (k) values together
        q = rms_norm(q.reshape(T, -1), layer["q_norm"], c.norm_eps).reshape(T, H, Dh)
        k = rms_norm(k.reshape(T, -1), layer["k_norm"], c.norm_eps).reshape(T, KVH, Dh)
    if c.arch == "llama":                                          # RoPE on each head's first r dims (all, mostly)
        q, k = [np.concatenate([rope(t[..., :r], positions, c.rope_theta, rope_freqs), t[..., r:]], axis=-1)
                for t in (q, k)]
    start = int(positions[0])
    if cache is not None:                                          # keep this pass's K, V; attend to all so far
        cache.k[i, start:start + T], cache.v[i, start:start + T] = k, v
        k, v = cache.k[i, :start + T], cache.v[i, :start + T]      # [S, KVH, Dh] each
    out = linear(attention(q, k, v, start, alibi_slopes), layer["wo"], layer.get("bo"))   # [T, D]
    x = x + (rms_norm(out, layer["attn_post_norm"], c.norm_eps) if c.post_norm else out)

    h = x if c.post_norm else norm(c, x_in if c.parallel_residual else x, layer["ffn_norm"], layer.get("ffn_norm_b"))
    if c.mlp == "swiglu":
        h = swiglu(h, layer["w_in"])                               # [T, F]
    else:
        h = gelu(linear(h, layer["w_in"], layer.get("b_in")), exact=c.mlp == "gelu")   # [T, F]
    out = linear(h, layer["w_out"], layer.get("b_out"))            # [T, D]
    return x + (rms_norm(out, layer["ffn_post_norm"], c.norm_eps) if c.post_norm else out)


def forward(config: ModelConfig, weights: dict, ids, cache: KVCache | None = None):
    """Tokens `ids` at positions cache.length .. (0 .. without a cache) through every layer. -> logits [T, V]"""
    ids = np.asarray(ids)
    start = 0 if cache is None else cache.length
    if start + len(ids) > (config.context_length if cache is None else cache.k.shape[1]):
        raise ValueError(f"{start + len(ids)} positions do not fit the context of {config.context_length}")
    positions = np.arange(start, start + len(ids))                 # [T]
    x = weights["tok_embed"][ids] * np.float32(config.embed_scale)   # [T, D]: one row of the table per token
    if config.arch == "gpt2":
        x = x + weights["pos_embed"][positions]                    # [T, D]: learned absolute positions
    for i, layer in enumerate(weights["layers"]):
        x = block(config, layer, i, x, positions, cache, weights["rope_freqs"], weights["alibi_slopes"])   # [T, D]
    if cache is not None:
        cache.length = start + len(ids)
    x = norm(config, x, weights["final_norm"], weights["final_norm_b"])   # [T, D]
    return x @ weights["lm_head"].T / np.float32(config.logit_scale)   # [T, V]: a score for each token of the vocab


def logits(config: ModelConfig, weights: dict, ids):
    """The whole sequence at once, no cache: what every cached path must reproduce. -> [T, V]"""
    return forward(config, weights, ids)


def prefill(config: ModelConfig, weights: dict, ids, cache: KVCache):
    """The prompt in one pass (big matmuls: compute-bound), filling the cache. -> logits of its last token [V]"""
    return forward(config, weights, ids, cache)[-1]


def decode_step(config: ModelConfig, weights: dict, token: int, cache: KVCache):
    """One new token at position cache.length: reads every weight for one row (memory-bound). -> [V]"""
    return forward(config, weights, [token], cache)[0]


# --- choosing the next token ------------------------------------------------------------------------------------
def sample(logits, temperature=0.0, top_k=0, top_p=1.0, rng=None) -> int:
    """Greedy at temperature 0; else softmax(logits / temperature) cut to the top k / top p, then one draw."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = softmax(logits.astype(np.float64) / temperature)          # [V]
    order = np.argsort(-p, kind="stable")                          # [V]: most likely first
    keep = len(p) if top_k <= 0 else top_k
    keep = min(keep, int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1)   # smallest set reaching top_p
    kept = order[:keep]
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(kept, p=p[kept] / p[kept].sum()))


def generate(config: ModelConfig, weights: dict, prompt_ids, max_new_tokens=32, temperature=0.0, top_k=0,
             top_p=1.0, seed=None, stop_ids=()) -> list[int]:
    """Prefill the prompt, then decode one token at a time until max_new_tokens, a stop id, or the context is full.
    -> the new ids"""
    max_new_tokens = min(max_new_tokens, config.context_length - len(prompt_ids))   # every token needs a position
    cache = new_cache(config, len(prompt_ids) + max_new_tokens)
    rng = np.random.default_rng(seed)
    out = []
    next_logits = prefill(config, weights, prompt_ids, cache)      # [V]
    while len(out) < max_new_tokens:
        token = sample(next_logits, temperature, top_k, top_p, rng)
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        next_logits = decode_step(config, weights, token, cache)   # [V]
    return out


if __name__ == "__main__":              # python -m tinyllm.reference "The capital of France is"
    import sys

    from . import hub
    from .weights import load_checkpoint

    config, flat, tokenizer, _ = load_checkpoint(hub.ensure_default_model())
    weights = plain_weights(config, flat)
    prompt = tokenizer.encode(sys.argv[1] if len(sys.argv) > 1 else "The capital of France is")
    new_ids = generate(config, weights, prompt, max_new_tokens=8)
    print(repr(tokenizer.decode(prompt)), "->", repr(tokenizer.decode(new_ids)))
