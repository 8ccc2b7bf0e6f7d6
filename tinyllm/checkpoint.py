"""What every checkpoint loader shares: the one naming scheme weights are mapped to, the shapes a config implies,
and errors that name the file.

    tok_embed [V, D]   lm_head [V, D] (absent when tied)   final_norm [D] (+ final_norm_b)   pos_embed [P, D]
    layers.{i}.attn_norm [D]  wq [H*Dh, D]  wk, wv [KVH*Dh, D]  wo [D, H*Dh]  ffn_norm [D]
    llama: layers.{i}.w_gate, w_up [F, D]  w_down [D, F]
    gpt2:  layers.{i}.w_fc [F, D]  w_proj [D, F]  and biases bq bk bv bo b_fc b_proj attn_norm_b ffn_norm_b
Left out: reading the files (gguf_weights.py, hf_weights.py) and what a load does after (weights.py).
"""
from __future__ import annotations

import math

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
        shapes.update(pos_embed=(c.context_length, D), final_norm_b=(D,))
    for i in range(c.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (D,), p + "wq": (c.q_dim, D), p + "wk": (c.kv_dim, D),
                       p + "wv": (c.kv_dim, D), p + "wo": (D, c.q_dim), p + "ffn_norm": (D,)})
        if c.attn_bias:
            shapes.update({p + "bq": (c.q_dim,), p + "bk": (c.kv_dim,), p + "bv": (c.kv_dim,), p + "bo": (D,)})
        if c.arch == "llama":
            shapes.update({p + "w_gate": (F, D), p + "w_up": (F, D), p + "w_down": (D, F)})
        else:
            shapes.update({p + "w_fc": (F, D), p + "b_fc": (F,), p + "w_proj": (D, F), p + "b_proj": (D,),
                           p + "attn_norm_b": (D,), p + "ffn_norm_b": (D,)})
    return shapes


def check_shapes(config: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise CheckpointError(f"{source}: weight {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, but the "
                                  f"config says {shape}; the weights and config.json/metadata disagree")
