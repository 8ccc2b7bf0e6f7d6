"""A GGUF file (llama.cpp's format; the default model) as (ModelConfig, canonical named arrays, Tokenizer).

The file is read by gguf.py; here its metadata becomes the config, its tensor names the canonical ones
(checkpoint.py), and the converter's permutation of the q and k rows is undone where it made one. Architectures:
those of GGUF_ARCHITECTURES (RoPE blocks; MPT's ALiBi; GPT-2's learned positions). Left out: the others (refused
with a message naming these).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, check_shapes, config_number, fold_scales, model_config, name_from_file
from .config import ModelConfig
from .gguf import GGUFError, GGUFFile
from .ops import alibi_slopes
from .quant import NATIVE_TYPES, QuantizedWeight, from_gguf_block
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
    "rope_freqs.weight": "rope_freqs", "blk.{i}.attn_qkv.bias": "layers.{i}.bqkv",
    "blk.{i}.attn_norm_2.weight": "layers.{i}.attn_norm_2", "blk.{i}.attn_norm_2.bias": "layers.{i}.attn_norm_2_b",
}
# GGUF architecture -> does llama.cpp's converter permute its q/k rows for adjacent-pair RoPE? (llama and granite
# rotate adjacent pairs, "normal" RoPE; qwen2 and qwen3 rotate half-split pairs, "neox" RoPE, as HF does)
GGUF_ARCHITECTURES = {"llama": True, "granite": True, "qwen2": False, "qwen3": False, "starcoder2": False,
                      "gptneox": False, "olmo2": False, "falcon": False, "mpt": False, "gpt2": False}
FAMILY_NAMES = {"gptneox": "gpt_neox"}      # where llama.cpp's name of an architecture is not Hugging Face's
# LayerNorm (MPT's without biases), an MLP of one matrix in and one out: exact GELU, or (the others) tanh's
LAYER_NORM_ARCHITECTURES = ("starcoder2", "gptneox", "falcon", "mpt", "gpt2")
EXACT_GELU_ARCHITECTURES = ("gptneox", "falcon", "mpt")    # (llama.cpp runs its tanh approximation for all)
POSITIONS = {"gpt2": "gpt2", "mpt": "alibi"}                # how positions enter where it is not RoPE (config.arch)
FUSED_QKV = ("gpt_neox", "falcon", "mpt", "gpt2")           # families whose q, k, v rows are one tensor, [q | k | v]


def tensor_names(config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> canonical name, for this config's layout (llama's, with what its family changes)."""
    names = dict(_GGUF_NAMES)
    if config.mlp != "swiglu":                  # one matrix in (ffn_up) and one out (ffn_down), with biases
        del names["blk.{i}.ffn_gate.weight"]
        names |= {"blk.{i}.ffn_up.weight": "layers.{i}.w_fc", "blk.{i}.ffn_down.weight": "layers.{i}.w_proj"}
        if config.mlp_bias:
            names |= {"blk.{i}.ffn_up.bias": "layers.{i}.b_fc", "blk.{i}.ffn_down.bias": "layers.{i}.b_proj"}
    if config.norm == "layer":
        names |= {"blk.{i}.attn_norm.bias": "layers.{i}.attn_norm_b", "blk.{i}.ffn_norm.bias": "layers.{i}.ffn_norm_b",
                  "output_norm.bias": "final_norm_b"}
    if config.post_norm:                        # olmo2: a norm after attention and after the MLP, none before
        del names["blk.{i}.attn_norm.weight"], names["blk.{i}.ffn_norm.weight"]
        names |= {"blk.{i}.post_attention_norm.weight": "layers.{i}.attn_post_norm",
                  "blk.{i}.post_ffw_norm.weight": "layers.{i}.ffn_post_norm"}
    if config.family in FUSED_QKV:              # q, k and v in one tensor, rows [q | k | v]: split after reading
        for part in "qkv":
            del names[f"blk.{{i}}.attn_{part}.weight"]
        names["blk.{i}.attn_qkv.weight"] = "layers.{i}.wqkv"
    if config.family == "falcon":               # the MLP's norm is attn_norm (load_gguf)
        del names["blk.{i}.ffn_norm.weight"]
        names.pop("blk.{i}.ffn_norm.bias")
    if config.arch == "gpt2":
        names["position_embd.weight"] = "pos_embed"
    return names

# The file's matrix types repacked without loss (quant.from_gguf_block) instead of dequantized, per quant setting
KEPT_AS_STORED = {"native": NATIVE_TYPES, "q4_1": ("Q4_1",), "q4_k": ("Q4_K",)}


def gguf_config(gg: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...)."""
    md = gg.metadata
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{gg.path}: GGUF architecture {arch!r} is not supported (tinyllm reads "
                              f"{', '.join(GGUF_ARCHITECTURES)} GGUF files)")
    if arch == "mpt" and not md.get("mpt.attention.max_alibi_bias"):
        raise CheckpointError(f"{gg.path}: MPT with learned positions (max_alibi_bias 0) is not supported; ALiBi "
                              f"MPT is")

    def get(key, kind=int, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gg.path}: metadata key {arch}.{key} is missing; the file is incomplete")
        return config_number(value, f"metadata key {arch}.{key}", gg.path, kind)

    n_heads = get("attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", default=len(tokens) if isinstance(tokens, list) and tokens else None)
    head_dim = get("attention.key_length") if f"{arch}.attention.key_length" in md else None
    granite, layer_norm, tensors = arch == "granite", arch in LAYER_NORM_ARCHITECTURES, gg.tensors
    rope_dims = get("rope.dimension_count") if f"{arch}.rope.dimension_count" in md else None
    q_norm = gg.tensors.get("blk.0.attn_q_norm.weight")       # [Dh]: each head's (qwen3); [H*Dh]: all (olmo2)
    qk_norm = "" if q_norm is None else "head" if q_norm.shape[0] == (head_dim or get("embedding_length") // n_heads) \
        else "all"
    clip = md.get(f"{arch}.attention.clamp_kqv")
    return model_config(
        gg.path, arch=POSITIONS.get(arch, "llama"), vocab_size=vocab, dim=get("embedding_length"),
        n_layers=get("block_count"),
        n_heads=n_heads, n_kv_heads=get("attention.head_count_kv", default=n_heads),
        ffn_dim=get("feed_forward_length"), context_length=get("context_length"),
        norm_eps=get("attention.layer_norm_epsilon" if layer_norm else "attention.layer_norm_rms_epsilon", float),
        rope_theta=get("rope.freq_base", float, 10000.0),
        tie_embeddings="output.weight" not in tensors, attn_bias="blk.0.attn_output.bias" in tensors,
        qkv_bias=("blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors)
        and "blk.0.attn_output.bias" not in tensors, qk_norm=qk_norm,
        post_norm="blk.0.post_ffw_norm.weight" in tensors,
        explicit_head_dim=head_dim, embed_scale=get("embedding_scale", float, 1.0) if granite else 1.0,
        logit_scale=get("logit_scale", float, 1.0) if granite else 1.0,
        norm="rms" if not layer_norm else "layer" if "output_norm.bias" in tensors else "layer_nobias",
        mlp="gelu" if arch in EXACT_GELU_ARCHITECTURES else "gelu_tanh" if layer_norm else "swiglu",
        mlp_bias="blk.0.ffn_up.bias" in tensors, clip_qkv=0.0 if clip is None else config_number(
            clip, f"metadata key {arch}.attention.clamp_kqv", gg.path, float),
        rotary_dim=rope_dims if rope_dims and rope_dims < (head_dim or n_heads and get("embedding_length") // n_heads)
        else None, parallel_residual=arch == "falcon" or bool(md.get(f"{arch}.use_parallel_residual", False)),
        family=FAMILY_NAMES.get(arch, arch),
        name=name_from_file(gg.path),
    )


def position_weights(gg: GGUFFile, config: ModelConfig) -> dict:
    """What the metadata says of positions, as the arrays the forward pass reads: linear RoPE scaling (DeepSeek-Coder)
    as frequency divisors, rope_freqs [Dh/2]; MPT's ALiBi bias as alibi_slopes [H]. Other RoPE scalings are refused."""
    arch = gg.metadata["general.architecture"]
    scaling = gg.metadata.get(f"{arch}.rope.scaling.type", "none")
    if config.arch == "alibi":
        max_bias = config_number(gg.metadata[f"{arch}.attention.max_alibi_bias"], "max_alibi_bias", gg.path, float)
        return {"alibi_slopes": alibi_slopes(config.n_heads, max_bias)}
    if scaling == "linear":
        factor = config_number(gg.metadata.get(f"{arch}.rope.scaling.factor"), f"{arch}.rope.scaling.factor",
                               gg.path, float)
        return {"rope_freqs": np.full(config.rope_dim // 2, factor, dtype=np.float32)}
    if scaling != "none":
        raise CheckpointError(f"{gg.path}: RoPE scaling {scaling!r} is not supported (plain RoPE, 'linear' and "
                              f"Llama 3's rope_freqs)")
    return {}


def split_qkv(weights: dict, config: ModelConfig, i: int) -> None:
    """Layer i's fused [q | k | v] rows (and biases) as wq, wk, wv (bq, bk, bv), in place."""
    bounds = np.cumsum([0, config.q_dim, config.kv_dim, config.kv_dim])
    for key in ("w", "b"):
        fused = weights.pop(f"layers.{i}.{key}qkv", None)
        if fused is None:
            continue
        if fused.shape[0] != bounds[-1]:
            raise CheckpointError(f"layer {i}'s attn_qkv has {fused.shape[0]} rows, the config says {bounds[-1]}")
        for part, lo, hi in zip("qkv", bounds[:-1], bounds[1:]):
            rows = np.arange(lo, hi)
            weights[f"layers.{i}.{key}{part}"] = fused.take_rows(rows) if isinstance(fused, QuantizedWeight) else \
                fused[lo:hi]


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
    """Read a GGUF file of a supported architecture. Matrices are dequantized to float32, except those KEPT_AS_STORED[quant], which are
    repacked as they are, without loss."""
    try:
        gg = GGUFFile(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    config = gguf_config(gg)
    weights = {}
    names = tensor_names(config)
    for gguf_name, canonical in (names | _OPTIONAL_NAMES).items():
        for i in range(config.n_layers) if "{i}" in gguf_name else [None]:
            name = gguf_name.format(i=i)
            if name not in gg.tensors:
                if name == "output.weight" or gguf_name in _OPTIONAL_NAMES:
                    continue  # a tied output head; what this family does not have (check_shapes: what it needs)
                raise CheckpointError(f"{gg.path}: tensor {name!r} is missing; the file is not a complete "
                                      f"{config.n_layers}-layer {config.family} model")
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
    for i in range(config.n_layers) if "blk.{i}.attn_qkv.weight" in names else ():
        split_qkv(weights, config, i)
    for i in range(config.n_layers) if config.family == "falcon" else ():
        # llama.cpp's falcon: attn_norm feeds the MLP, and attention too unless there is an attn_norm_2 (falcon-40b)
        for p in (f"layers.{i}.attn_norm", f"layers.{i}.attn_norm_b"):
            weights[p.replace("attn_norm", "ffn_norm")] = weights[p]
            weights[p] = weights.pop(p.replace("attn_norm", "attn_norm_2"), weights[p])
    weights |= position_weights(gg, config)
    check_shapes(config, weights, str(gg.path))      # first: the un-permutation needs the shapes it expects
    for i in range(config.n_layers) if GGUF_ARCHITECTURES[gg.metadata["general.architecture"]] else ():
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
