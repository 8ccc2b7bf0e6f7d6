"""Load a checkpoint into (ModelConfig, canonical named float32 arrays, tokenizer).

Two sources:
  * a GGUF file (llama.cpp's format; the default model), read by gguf.py;
  * a Hugging Face directory: config.json + model.safetensors (or sharded *.safetensors with an index)
    + tokenizer.json, for Llama-family (incl. GQA) and GPT-2 checkpoints.

Every source is mapped to one naming scheme (below) and every shape is checked against the config, so a
wrong or partial file fails here with a message naming the tensor, not later inside a matmul.

    tok_embed [V, D]   lm_head [V, D] (absent when tied)   final_norm [D] (+ final_norm_b)   pos_embed [P, D]
    layers.{i}.attn_norm [D]  wq [H*Dh, D]  wk, wv [KVH*Dh, D]  wo [D, H*Dh]  ffn_norm [D]
    llama: layers.{i}.w_gate, w_up [F, D]  w_down [D, F]
    gpt2:  layers.{i}.w_fc [F, D]  w_proj [D, F]  and biases bq bk bv bo b_fc b_proj attn_norm_b ffn_norm_b
No pickle is ever read: .bin / .pt checkpoints are refused.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from . import converted
from .config import ModelConfig
from .gguf import GGUFError, GGUFFile
from .quant import FORMATS, QuantizedWeight, from_gguf_block, quantization_error, quantize
from .tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or describes a model tinyllm does not run."""


QUANT_CHOICES = (None, "fp32", "native") + FORMATS
# the matrices quantization applies to (norms, biases and learned positions stay float32)
MATRIX_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_fc", "w_proj", "tok_embed", "lm_head")


# The output head's format (and the tied embedding's) when quantizing, by the matrices' format. A 4-bit head costs
# far more quality than 4-bit matrices do (benchmarks/RESULTS.md, quality), so 4-bit formats keep it at 8 bits, as
# llama.cpp's 4-bit mixes and the default model's own file do. `head_quant=` overrides it.
DEFAULT_HEAD_FORMAT = {"int8": "int8", "int8-block": "int8-block", "q4_1": "int8-block"}
HEAD_NAMES = ("tok_embed", "lm_head")


def load_checkpoint(path: str | Path, quant: str | None = None, head_quant: str | None = None):
    """-> (config, weights, tokenizer, quant_report). quant: None/"fp32", "int8", "int8-block", "q4_1", or
    "native" (keep each GGUF tensor in the format the file stores it, where tinyllm has that format).
    head_quant: the format of the output head and embedding when quantizing (default DEFAULT_HEAD_FORMAT[quant])."""
    if quant not in QUANT_CHOICES:
        raise ValueError(f"unknown quant {quant!r}; choose one of: fp32, native, {', '.join(FORMATS)}")
    check_head_quant(quant, head_quant)
    path = Path(path)
    if path.is_dir():
        if quant == "native":
            raise CheckpointError(f"{path}: quant='native' needs a GGUF file (safetensors hold float weights)")
        config, weights, tokenizer = load_hf_dir(path)
    elif not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    elif path.suffix == ".gguf" or _magic(path) == b"GGUF":
        if (kept := converted.load(path, quant, head_quant)) is not None:
            return kept                                 # converted by an earlier load: mapped, nothing to do
        config, weights, tokenizer = load_gguf(path, quant)
    else:
        raise CheckpointError(f"{path}: not a .gguf file or a Hugging Face model directory")
    check_finite(weights, str(path))
    weights, report = quantize_weights(weights, quant, head_quant)
    weights = fuse_layer_matrices(weights, config.n_layers)
    if not path.is_dir():
        converted.save_in_background(path, quant, head_quant, config, weights, tokenizer, report)
    return config, weights, tokenizer, report


FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_in": ("w_gate", "w_up")}


def fuse_layer_matrices(weights: dict, n_layers: int) -> dict:
    """Replace each layer's q, k, v (and gate, up) matrices by their rows stacked into one (one matmul each), in
    place, a layer at a time: the parts are dropped as each fused copy is made, so a load holds one copy."""
    for i in range(n_layers):
        for fused, parts in FUSED.items():
            names = [f"layers.{i}.{part}" for part in parts]
            if all(name in weights for name in names):
                weights[f"layers.{i}.{fused}"] = fuse_rows([weights.pop(name) for name in names])
    return weights


def fuse_rows(parts: list):
    """Stack [O_i, I] matrices into one [sum O_i, I] (float arrays or quantized weights of one type)."""
    if isinstance(parts[0], QuantizedWeight):
        if len({type(p) for p in parts}) > 1:
            raise ValueError(f"cannot fuse weights of mixed formats {[type(p).__name__ for p in parts]}")
        return type(parts[0]).concat_rows(parts)
    return np.concatenate(parts)


def check_head_quant(quant: str | None, head_quant: str | None) -> None:
    if head_quant is None:
        return
    if quant not in FORMATS:
        raise ValueError(f"head_quant={head_quant!r} needs quantized matrices (quant one of {', '.join(FORMATS)})")
    if head_quant not in ("fp32",) + FORMATS:
        raise ValueError(f"unknown head_quant {head_quant!r}; choose one of: fp32, {', '.join(FORMATS)}")


def check_finite(weights: dict, source: str) -> None:
    """CheckpointError naming the first tensor holding a NaN or an infinity (a corrupt file, or a diverged training
    run): such a model would print garbage, or nothing, and exit as if all went well."""
    for name, w in weights.items():
        for a in w.arrays if isinstance(w, QuantizedWeight) else [w]:
            # A sum is NaN or infinite whenever any term is, and costs one streaming pass; only a sum that
            # overflowed from finite terms needs the exact element-wise test.
            with np.errstate(over="ignore", invalid="ignore"):
                suspect = a.dtype.kind == "f" and not np.isfinite(a.sum())
            if suspect and not np.isfinite(a).all():
                where = int(np.flatnonzero(~np.isfinite(a.ravel()))[0])
                raise CheckpointError(f"{source}: tensor {name!r} holds a non-finite value ({a.ravel()[where]}) at "
                                      f"flat index {where:,}; the file is corrupt: fetch it again")


def _is_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in MATRIX_NAMES


def quantize_weights(weights: dict, quant: str | None, head_quant: str | None = None) -> tuple[dict, list[dict]]:
    """Quantize every float matrix to `quant` (leaving ones already quantized natively), the output head and
    embedding to `head_quant` (default DEFAULT_HEAD_FORMAT[quant]); report the error of each.

    A tied output head is the embedding table itself, so it is quantized once and stays shared.
    """
    check_head_quant(quant, head_quant)
    report = []
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            report.append(dict(name=name, format=type(w).__name__ + " (native)", shape=w.shape, bytes=w.nbytes,
                               max_err=0.0, rms_err=0.0))
    if quant in (None, "fp32", "native"):
        return weights, report
    head_quant = head_quant or DEFAULT_HEAD_FORMAT[quant]
    out = dict(weights)
    for name, w in weights.items():
        fmt = head_quant if name in HEAD_NAMES else quant
        if _is_matrix(name) and not isinstance(w, QuantizedWeight) and fmt != "fp32":
            qw = quantize(w, fmt)
            max_err, rms_err = quantization_error(w, qw)
            out[name] = qw
            report.append(dict(name=name, format=fmt, shape=qw.shape, bytes=qw.nbytes,
                               max_err=max_err, rms_err=rms_err))
    return out, report


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


# --- GGUF ----------------------------------------------------------------------------------------------------
_GGUF_NAMES = {  # GGUF tensor name -> canonical name ({i} = layer)
    "token_embd.weight": "tok_embed", "output.weight": "lm_head", "output_norm.weight": "final_norm",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm", "blk.{i}.attn_q.weight": "layers.{i}.wq",
    "blk.{i}.attn_k.weight": "layers.{i}.wk", "blk.{i}.attn_v.weight": "layers.{i}.wv",
    "blk.{i}.attn_output.weight": "layers.{i}.wo", "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.w_gate", "blk.{i}.ffn_up.weight": "layers.{i}.w_up",
    "blk.{i}.ffn_down.weight": "layers.{i}.w_down",
}


MAX_CONTEXT = 1 << 20   # positions; a larger context_length would make the RoPE tables alone gigabytes


def _config_number(value, key: str, source: str, kind: type):
    """A config value as a positive int (kind=int) or a finite positive float; CheckpointError naming the key."""
    ok = (type(value) is int and value > 0 if kind is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0)
    if not ok:
        what = "a positive integer" if kind is int else "a finite positive number"
        raise CheckpointError(f"{source}: {key} is {value!r}, expected {what}; the file is corrupt or not a "
                              f"model config")
    return kind(value)


def _model_config(source: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), with its validation errors naming the file and the context bounded."""
    if fields["context_length"] > MAX_CONTEXT:
        raise CheckpointError(f"{source}: context length {fields['context_length']:,} is more than tinyllm supports "
                              f"({MAX_CONTEXT:,}); the file is corrupt or the model too large for this engine")
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def gguf_config(gg: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...)."""
    md = gg.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gg.path}: GGUF architecture {arch!r} is not supported (tinyllm reads 'llama' GGUF "
                              f"files; GPT-2 models load from a Hugging Face directory)")

    def get(key, kind=int, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gg.path}: metadata key {arch}.{key} is missing; the file is incomplete")
        return _config_number(value, f"metadata key {arch}.{key}", gg.path, kind)

    n_heads = get("attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", default=len(tokens) if isinstance(tokens, list) and tokens else None)
    return _model_config(
        gg.path, arch="llama", vocab_size=vocab, dim=get("embedding_length"), n_layers=get("block_count"),
        n_heads=n_heads, n_kv_heads=get("attention.head_count_kv", default=n_heads),
        ffn_dim=get("feed_forward_length"), context_length=get("context_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", float), rope_theta=get("rope.freq_base", float, 10000.0),
        tie_embeddings="output.weight" not in gg.tensors, name=str(md.get("general.name", "")),
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
    """Read a llama GGUF. Matrices are dequantized to float32, except that with quant="native" Q4_1 and Q8_0
    matrices (and with quant="q4_1", Q4_1 matrices) are repacked as they are, without loss."""
    try:
        gg = GGUFFile(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    config = gguf_config(gg)
    weights = {}
    for gguf_name, canonical in _GGUF_NAMES.items():
        for i in range(config.n_layers) if "{i}" in gguf_name else [None]:
            name = gguf_name.format(i=i)
            if name not in gg.tensors:
                if name == "output.weight":
                    continue  # tied output head
                raise CheckpointError(f"{gg.path}: tensor {name!r} is missing; the file is not a complete "
                                      f"{config.n_layers}-layer llama model")
            info = gg.tensors[name]
            keep = (quant == "native" and info.type_name in ("Q4_1", "Q8_0")) or (
                quant == "q4_1" and info.type_name == "Q4_1")
            try:
                if keep and len(info.shape) == 2:
                    weights[canonical.format(i=i)] = from_gguf_block(gg.raw(name), info.type_name, info.shape)
                else:
                    weights[canonical.format(i=i)] = gg.tensor(name)
                gg.release(name)                            # its bytes are copied out: free the file's pages
            except GGUFError as e:
                raise CheckpointError(f"{gg.path}: tensor {name!r}: {e}") from None
    check_shapes(config, weights, str(gg.path))      # first: the un-permutation needs the shapes it expects
    for i in range(config.n_layers):
        weights[f"layers.{i}.wq"] = unpermute_rope_rows(weights[f"layers.{i}.wq"], config.n_heads)
        weights[f"layers.{i}.wk"] = unpermute_rope_rows(weights[f"layers.{i}.wk"], config.n_kv_heads)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gg.metadata)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{gg.path}: cannot build the tokenizer from the file's metadata: {e}") from None
    return config, weights, tokenizer


# --- shape validation ----------------------------------------------------------------------------------------
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


# --- safetensors ---------------------------------------------------------------------------------------------
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bf16", "F64": np.float64}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as float32 arrays.

    The format: u64 header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then
    raw little-endian data. Read here (not with the safetensors package) because numpy has no bfloat16:
    bf16 is widened to fp32 by shifting its 16 bits into the top half of a 32-bit word.
    """
    with open(path, "rb") as f:
        if f.seek(0, 2) < 8:
            raise CheckpointError(f"{path}: file is truncated (no header); fetch it again")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise CheckpointError(f"{path}: file is truncated in its header; fetch it again")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{path}: header is not valid JSON; not a safetensors file?") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object; not a "
                              f"safetensors file?")
    header.pop("__metadata__", None)
    data_size = len(buf) - 8 - n
    out = {}
    for name, info in header.items():
        dtype, shape, begin, end = _safetensors_entry(path, name, info)
        if end > data_size:
            raise CheckpointError(f"{path}: file is truncated in tensor {name!r}; fetch it again")
        raw = np.frombuffer(buf, dtype=np.uint8, count=end - begin, offset=8 + n + begin)
        itemsize = 2 if dtype == "bf16" else np.dtype(dtype).itemsize
        if raw.size != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has {raw.size} bytes for shape {shape} of {info['dtype']}")
        if dtype == "bf16":
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.view(dtype).astype(np.float32)
        out[name] = arr.reshape(shape)
    return out


def _safetensors_entry(path: Path, name: str, info) -> tuple:
    """(dtype, shape, begin, end) of one header entry, every field checked; CheckpointError naming the tensor."""
    def bad(what: str):
        raise CheckpointError(f"{path}: tensor {name!r} has {what} in the header (file corrupt?)")

    if not isinstance(info, dict):
        bad(f"entry {info!r} instead of an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}; tinyllm reads "
                              f"{', '.join(_ST_DTYPES)} safetensors")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
        bad(f"shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        bad(f"data_offsets {offsets!r}")
    return _ST_DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


# --- Hugging Face directories --------------------------------------------------------------------------------
def hf_config(cfg: dict, source: str) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: config.json holds a JSON {type(cfg).__name__}, not an object")

    def get(key, kind=int, default=None):
        value = cfg.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{source}: config.json has no {key!r}; it is incomplete")
            value = default
        return _config_number(value, f"config.json {key!r}", source, kind)

    def flag(key) -> bool:
        value = cfg.get(key, False)
        if not isinstance(value, (bool, type(None))):
            raise CheckpointError(f"{source}: config.json {key!r} is {value!r}, expected true or false")
        return bool(value)

    model_type = cfg.get("model_type")
    name = cfg.get("_name_or_path", "")
    name = name if isinstance(name, str) else ""
    if model_type in ("llama", "mistral"):
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"{source}: config.json rope_scaling is {rope!r}, expected an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"{source}: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
        if cfg.get("mlp_bias"):
            raise CheckpointError(f"{source}: llama models with mlp_bias are not supported")
        if cfg.get("sliding_window") and model_type == "mistral":
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        n_heads = get("num_attention_heads")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return _model_config(
            source, arch="llama", vocab_size=get("vocab_size"), dim=get("hidden_size"),
            n_layers=get("num_hidden_layers"), n_heads=n_heads, n_kv_heads=get("num_key_value_heads", default=n_heads),
            ffn_dim=get("intermediate_size"), context_length=get("max_position_embeddings", default=2048),
            norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=_config_number(theta, "config.json 'rope_theta'", source, float),
            tie_embeddings=flag("tie_word_embeddings"), attn_bias=flag("attention_bias"),
            explicit_head_dim=get("head_dim") if cfg.get("head_dim") is not None else None, name=name,
        )
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{source}: GPT-2 activation {act!r} is not supported (only gelu_new)")
        D = get("n_embd")
        return _model_config(
            source, arch="gpt2", vocab_size=get("vocab_size"), dim=D, n_layers=get("n_layer"), n_heads=get("n_head"),
            n_kv_heads=get("n_head"), ffn_dim=get("n_inner", default=4 * D), context_length=get("n_positions"),
            norm_eps=get("layer_norm_epsilon", float, 1e-5), tie_embeddings=True, attn_bias=True, name=name,
        )
    raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (tinyllm runs llama, mistral "
                          f"without sliding window, and gpt2)")


def _hf_llama_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    w = {"tok_embed": raw["model.embed_tokens.weight"], "final_norm": raw["model.norm.weight"]}
    if "lm_head.weight" in raw and not c.tie_embeddings:
        w["lm_head"] = raw["lm_head.weight"]
    for i in range(c.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for hf, ours in [("input_layernorm.weight", "attn_norm"), ("post_attention_layernorm.weight", "ffn_norm"),
                         ("self_attn.q_proj.weight", "wq"), ("self_attn.k_proj.weight", "wk"),
                         ("self_attn.v_proj.weight", "wv"), ("self_attn.o_proj.weight", "wo"),
                         ("mlp.gate_proj.weight", "w_gate"), ("mlp.up_proj.weight", "w_up"),
                         ("mlp.down_proj.weight", "w_down"), ("self_attn.q_proj.bias", "bq"),
                         ("self_attn.k_proj.bias", "bk"), ("self_attn.v_proj.bias", "bv"),
                         ("self_attn.o_proj.bias", "bo")]:
            if p + hf in raw:
                w[q + ours] = raw[p + hf]
    return w


def _hf_gpt2_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2 stores its projections as Conv1D ([in, out]): transpose them to [out, in]; split the fused c_attn."""
    raw = {k.removeprefix("transformer."): v for k, v in raw.items()}
    w = {"tok_embed": raw["wte.weight"], "pos_embed": raw["wpe.weight"],
         "final_norm": raw["ln_f.weight"], "final_norm_b": raw["ln_f.bias"]}
    D = c.dim
    for i in range(c.n_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        qkv_w, qkv_b = raw[p + "attn.c_attn.weight"].T, raw[p + "attn.c_attn.bias"]   # [3D, D], [3D]
        w.update({
            q + "attn_norm": raw[p + "ln_1.weight"], q + "attn_norm_b": raw[p + "ln_1.bias"],
            q + "wq": qkv_w[:D], q + "wk": qkv_w[D:2 * D], q + "wv": qkv_w[2 * D:],
            q + "bq": qkv_b[:D], q + "bk": qkv_b[D:2 * D], q + "bv": qkv_b[2 * D:],
            q + "wo": raw[p + "attn.c_proj.weight"].T, q + "bo": raw[p + "attn.c_proj.bias"],
            q + "ffn_norm": raw[p + "ln_2.weight"], q + "ffn_norm_b": raw[p + "ln_2.bias"],
            q + "w_fc": raw[p + "mlp.c_fc.weight"].T, q + "b_fc": raw[p + "mlp.c_fc.bias"],
            q + "w_proj": raw[p + "mlp.c_proj.weight"].T, q + "b_proj": raw[p + "mlp.c_proj.bias"],
        })
    return {k: np.ascontiguousarray(v) for k, v in w.items()}


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json; a Hugging Face model directory needs config.json, "
                              f"*.safetensors and tokenizer.json")
    config = hf_config(_read_json(cfg_path), str(path))
    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: the index maps each tensor to its shard file
        index_json = _read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointError(f"{index}: 'weight_map' is not a mapping of tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        files = [path / s for s in shards]
        if any(not s or Path(s).name != s for s in shards):
            raise CheckpointError(f"{index}: a shard name is a path, not a file in {path}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (f" (found {', '.join(pickled)}: pickle checkpoints are never loaded; convert them to "
                f"safetensors)" if pickled else "")
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    raw = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{path}: shard {f.name} named in the index is missing")
        raw.update(read_safetensors(f))
    try:
        weights = (_hf_llama_names if config.arch == "llama" else _hf_gpt2_names)(raw, config)
    except KeyError as e:
        raise CheckpointError(f"{path}: weight {e.args[0]!r} is missing from the safetensors files") from None
    check_shapes(config, weights, str(path))
    tok_path = path / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(f"{path}: no tokenizer.json; tinyllm needs the model's tokenizer.json beside its weights")
    try:
        tokenizer = Tokenizer.from_tokenizer_json(tok_path)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e).removeprefix(f"{tok_path}: ")
        raise CheckpointError(f"{tok_path}: cannot build the tokenizer: {detail}") from None
    return config, weights, tokenizer


def _read_json(path: Path):
    """A JSON file's value; CheckpointError naming the file if it is not UTF-8 JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.__class__.__name__}: {str(e)[:80]})") from None
