"""What every checkpoint loader shares: the one naming scheme weights are mapped to, the shapes a config implies,
and errors that name the file.

    tok_embed [V, D]   lm_head [V, D] (absent when tied)   final_norm [D] (+ final_norm_b)   pos_embed [P, D]
    layers.{i}.attn_norm [D]  wq [H*Dh, D]  wk, wv [KVH*Dh, D]  wo [D, H*Dh]  ffn_norm [D]
    llama: layers.{i}.w_gate, w_up [F, D]  w_down [D, F]  (qwen2: + bq bk bv; qwen3: + q_norm k_norm [Dh];
           olmo2: q_norm [H*Dh] k_norm [KVH*Dh], attn_post_norm ffn_post_norm [D] instead of attn_norm ffn_norm)
           rope_freqs [Dh/2] (Llama 3.x, linear scaling: RoPE frequency divisors)
    gpt2:  layers.{i}.w_fc [F, D]  w_proj [D, F]  and biases bq bk bv bo b_fc b_proj attn_norm_b ffn_norm_b
           (starcoder2, gpt-neox, falcon: w_fc / w_proj and, where the config says, the same biases, with RoPE)
    alibi: as gpt2 without pos_embed (MPT: no biases at all), and alibi_slopes [H]: each head's ALiBi slope
Left out: reading the files (gguf_weights.py, hf_weights.py) and what a load does after (weights.py).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from .config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or describes a model tinyllm does not run."""


MAX_CONTEXT = 1 << 20   # positions; a larger context_length would make the RoPE tables alone gigabytes


def config_number(value, key: str, source: str, kind: type):
    """A config value as a positive int (kind=int) or a finite positive float; CheckpointError naming the key."""
    ok = (type(value) is int and value > 0 if kind is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0)
    if not ok:
        what = "a positive integer" if kind is int else "a finite positive number"
        raise CheckpointError(f"{source}: {key} is {value!r}, expected {what}; the file is corrupt or not a "
                              f"model config")
    return kind(value)


QUANT_TAG = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.I)     # ".Q4_1", "-q8_0", ".IQ4_XS", ".f16"


def name_from_file(path) -> str:
    """The model's name as its file says it: SmolLM2-135M-Instruct.Q4_1.gguf -> "SmolLM2-135M-Instruct". (A GGUF's
    general.name is often a converter's title-cased guess: "Smollm2 135M 8k Lc100K Mix1 Ep2".)"""
    stem = Path(path).name.removesuffix(".gguf")
    return QUANT_TAG.sub("", stem) or stem


def model_config(source: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), with its validation errors naming the file and the context bounded."""
    if fields["context_length"] > MAX_CONTEXT:
        raise CheckpointError(f"{source}: context length {fields['context_length']:,} is more than tinyllm supports "
                              f"({MAX_CONTEXT:,}); the file is corrupt or the model too large for this engine")
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, V = c.dim, c.ffn_dim, c.vocab_size
    shapes = {"tok_embed": (V, D), "final_norm": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (V, D)
    if c.arch == "gpt2":
        shapes["pos_embed"] = (c.context_length, D)
    if c.arch == "alibi":
        shapes["alibi_slopes"] = (c.n_heads,)
    if c.norm == "layer":
        shapes["final_norm_b"] = (D,)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (D,), p + "wq": (c.q_dim, D), p + "wk": (c.kv_dim, D),
                       p + "wv": (c.kv_dim, D), p + "wo": (D, c.q_dim), p + "ffn_norm": (D,)})
        if c.attn_bias or c.qkv_bias:
            shapes.update({p + "bq": (c.q_dim,), p + "bk": (c.kv_dim,), p + "bv": (c.kv_dim,)})
        if c.attn_bias:
            shapes[p + "bo"] = (D,)
        if c.qk_norm:
            each = c.qk_norm == "head"
            shapes.update({p + "q_norm": (c.head_dim if each else c.q_dim,), p + "k_norm": (c.head_dim if each else c.kv_dim,)})
        if c.post_norm:                                     # olmo2: the norms after attention and the MLP, no others
            del shapes[p + "attn_norm"], shapes[p + "ffn_norm"]
            shapes.update({p + "attn_post_norm": (D,), p + "ffn_post_norm": (D,)})
        if c.mlp == "swiglu":
            shapes.update({p + "w_gate": (F, D), p + "w_up": (F, D), p + "w_down": (D, F)})
        else:
            shapes.update({p + "w_fc": (F, D), p + "w_proj": (D, F)})
            if c.mlp_bias:
                shapes.update({p + "b_fc": (F,), p + "b_proj": (D,)})
        if c.norm == "layer":
            shapes.update({p + "attn_norm_b": (D,), p + "ffn_norm_b": (D,)})
    return shapes


def check_shapes(config: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    shapes = expected_shapes(config)
    if "rope_freqs" in weights:
        shapes["rope_freqs"] = (config.rope_dim // 2,)
    for name, shape in shapes.items():
        if name not in weights:
            raise CheckpointError(f"{source}: weight {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, but the "
                                  f"config says {shape}; the weights and config.json/metadata disagree")


def fold_scales(weights: dict, config: ModelConfig, attention_scale: float, residual_scale: float) -> None:
    """Granite's multipliers, folded into the weights (in place) so the forward pass needs no extra step:
    attention uses q.k * attention_scale instead of q.k / sqrt(Dh), so q's rows are scaled by attention_scale *
    sqrt(Dh) (RoPE is linear: it commutes); each block adds residual_scale * its attention and MLP outputs, so wo
    and w_down (and bo) are scaled by residual_scale."""
    q_factor = np.float32(attention_scale * math.sqrt(config.head_dim))
    for i in range(config.n_layers):
        p = f"layers.{i}."
        for name, factor in (("wq", q_factor), ("bq", q_factor), ("wo", residual_scale), ("bo", residual_scale),
                             ("w_down", residual_scale)):
            if p + name in weights:       # (a matrix kept quantized is widened first: the scale is not exact in it)
                w = weights[p + name]
                w = w if isinstance(w, np.ndarray) else w.dequantize()
                weights[p + name] = (w * np.float32(factor)).astype(np.float32)
