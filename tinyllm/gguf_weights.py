"""A GGUF file (llama.cpp's format; the default model) as (ModelConfig, canonical named arrays, Tokenizer).

The file is read by gguf.py; here its metadata becomes the config, its tensor names the canonical ones
(checkpoint.py), and the converter's permutation of the q and k rows is undone where it made one. Architectures:
the llama-block families of GGUF_ARCHITECTURES. Left out: the others (refused with a message; GPT-2 loads from a
Hugging Face directory).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, check_shapes, config_number, fold_scales, model_config
from .config import ModelConfig
from .gguf import GGUFError, GGUFFile
from .quant import QuantizedWeight, from_gguf_block
from .tokenizer import Tokenizer

_GGUF_NAMES = {  # GGUF tensor name -> canonical name ({i} = layer)
    "token_embd.weight": "tok_embed", "output.weight": "lm_head", "output_norm.weight": "final_norm",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm", "blk.{i}.attn_q.weight": "layers.{i}.wq",
    "blk.{i}.attn_k.weight": "layers.{i}.wk", "blk.{i}.attn_v.weight": "layers.{i}.wv",
    "blk.{i}.attn_output.weight": "layers.{i}.wo", "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.w_gate", "blk.{i}.ffn_up.weight": "layers.{i}.w_up",
    "blk.{i}.ffn_down.weight": "layers.{i}.w_down",
}
_OPTIONAL_NAMES = {  # present only in some families (the config says which: checkpoint.expected_shapes)
    "blk.{i}.attn_q.bias": "layers.{i}.bq", "blk.{i}.attn_k.bias": "layers.{i}.bk",
    "blk.{i}.attn_v.bias": "layers.{i}.bv", "blk.{i}.attn_output.bias": "layers.{i}.bo",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.q_norm", "blk.{i}.attn_k_norm.weight": "layers.{i}.k_norm",
    "rope_freqs.weight": "rope_freqs",
}
# GGUF architecture -> does llama.cpp's converter permute its q/k rows for adjacent-pair RoPE? (llama and granite
# rotate adjacent pairs, "normal" RoPE; qwen2 and qwen3 rotate half-split pairs, "neox" RoPE, as HF does)
GGUF_ARCHITECTURES = {"llama": True, "granite": True, "qwen2": False, "qwen3": False}

# The file's matrix types repacked without loss (quant.from_gguf_block) instead of dequantized, per quant setting
KEPT_AS_STORED = {"native": ("Q4_1", "Q8_0", "Q4_K"), "q4_1": ("Q4_1",), "q4_k": ("Q4_K",)}


def gguf_config(gg: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...)."""
    md = gg.metadata
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{gg.path}: GGUF architecture {arch!r} is not supported (tinyllm reads "
                              f"{', '.join(GGUF_ARCHITECTURES)} GGUF files; GPT-2 loads from a Hugging Face directory)")

    def get(key, kind=int, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gg.path}: metadata key {arch}.{key} is missing; the file is incomplete")
        return config_number(value, f"metadata key {arch}.{key}", gg.path, kind)

    n_heads = get("attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", default=len(tokens) if isinstance(tokens, list) and tokens else None)
    head_dim = get("attention.key_length") if f"{arch}.attention.key_length" in md else None
    granite = arch == "granite"
    return model_config(
        gg.path, arch="llama", vocab_size=vocab, dim=get("embedding_length"), n_layers=get("block_count"),
        n_heads=n_heads, n_kv_heads=get("attention.head_count_kv", default=n_heads),
        ffn_dim=get("feed_forward_length"), context_length=get("context_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", float), rope_theta=get("rope.freq_base", float, 10000.0),
        tie_embeddings="output.weight" not in gg.tensors, qkv_bias="blk.0.attn_q.bias" in gg.tensors,
        attn_bias="blk.0.attn_output.bias" in gg.tensors, qk_norm="blk.0.attn_q_norm.weight" in gg.tensors,
        explicit_head_dim=head_dim, embed_scale=get("embedding_scale", float, 1.0) if granite else 1.0,
        logit_scale=get("logit_scale", float, 1.0) if granite else 1.0, family=arch,
        name=str(md.get("general.name", "")),
    )


def unpermute_rope_rows(w, n_heads: int):
    """Undo the GGUF converter's q/k row permutation (the "RoPE trap").

    llama.cpp rotates adjacent pairs (2i, 2i+1), Hugging Face rotates (i, i + Dh/2). The converter reorders
    each head's rows so that llama.cpp's pairing gives HF's result: HF row order [first half | second half]
    became interleaved [h0, s0, h1, s1, ...]. We put the rows back, so tinyllm uses the half-split pairing
    for every checkpoint. w: [n_heads * Dh, D] (a float array or a QuantizedWeight) -> same shape.
    """
    rows = w.shape[0]
    dh = rows // n_heads
    # new row (head, half, i) comes from stored row (head, i, half)
    order = np.arange(rows).reshape(n_heads, dh // 2, 2).swapaxes(1, 2).reshape(rows)
    return w.take_rows(order) if isinstance(w, QuantizedWeight) else w[order]


def load_gguf(path: str | Path, quant: str | None = None) -> tuple[ModelConfig, dict, Tokenizer]:
    """Read a llama GGUF. Matrices are dequantized to float32, except those KEPT_AS_STORED[quant], which are
    repacked as they are, without loss."""
    try:
        gg = GGUFFile(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    config = gguf_config(gg)
    weights = {}
    for gguf_name, canonical in (_GGUF_NAMES | _OPTIONAL_NAMES).items():
        for i in range(config.n_layers) if "{i}" in gguf_name else [None]:
            name = gguf_name.format(i=i)
            if name not in gg.tensors:
                if name == "output.weight" or gguf_name in _OPTIONAL_NAMES:
                    continue  # a tied output head; what this family does not have (check_shapes: what it needs)
                raise CheckpointError(f"{gg.path}: tensor {name!r} is missing; the file is not a complete "
                                      f"{config.n_layers}-layer llama model")
            info = gg.tensors[name]
            keep = info.type_name in KEPT_AS_STORED.get(quant, ())
            try:
                if keep and len(info.shape) == 2:
                    weights[canonical.format(i=i)] = from_gguf_block(gg.raw(name), info.type_name, info.shape)
                else:
                    weights[canonical.format(i=i)] = gg.tensor(name)
                gg.release(name)                            # its bytes are copied out: free the file's pages
            except GGUFError as e:
                raise CheckpointError(f"{gg.path}: tensor {name!r}: {e}") from None
    check_shapes(config, weights, str(gg.path))      # first: the un-permutation needs the shapes it expects
    for i in range(config.n_layers) if GGUF_ARCHITECTURES[config.family] else ():
        weights[f"layers.{i}.wq"] = unpermute_rope_rows(weights[f"layers.{i}.wq"], config.n_heads)
        weights[f"layers.{i}.wk"] = unpermute_rope_rows(weights[f"layers.{i}.wk"], config.n_kv_heads)
    if config.family == "granite":
        scale = lambda key: config_number(gg.metadata.get(f"granite.{key}", 1.0), key, str(gg.path), float)  # noqa: E731
        fold_scales(weights, config, scale("attention.scale"), scale("residual_scale"))
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gg.metadata)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{gg.path}: cannot build the tokenizer from the file's metadata: {e}") from None
    return config, weights, tokenizer
