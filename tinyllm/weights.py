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
import mmap
import struct
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .gguf import GGUFError, GGUFFile
from .quant import FORMATS, QuantizedWeight, from_gguf_block, quantization_error, quantize
from .tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or describes a model tinyllm does not run."""


QUANT_CHOICES = (None, "fp32", "native") + FORMATS
# the matrices quantization applies to (norms, biases and learned positions stay float32)
MATRIX_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_fc", "w_proj", "tok_embed", "lm_head")


def load_checkpoint(path: str | Path, quant: str | None = None):
    """-> (config, weights, tokenizer, quant_report). quant: None/"fp32", "int8", "int8-block", "q4_1", or
    "native" (keep each GGUF tensor in the format the file stores it, where tinyllm has that format)."""
    if quant not in QUANT_CHOICES:
        raise ValueError(f"unknown quant {quant!r}; choose one of: fp32, native, {', '.join(FORMATS)}")
    path = Path(path)
    if path.is_dir():
        if quant == "native":
            raise CheckpointError(f"{path}: quant='native' needs a GGUF file (safetensors hold float weights)")
        config, weights, tokenizer = load_hf_dir(path)
    elif not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    elif path.suffix == ".gguf" or _magic(path) == b"GGUF":
        config, weights, tokenizer = load_gguf(path, quant)
    else:
        raise CheckpointError(f"{path}: not a .gguf file or a Hugging Face model directory")
    weights, report = quantize_weights(weights, quant)
    return config, weights, tokenizer, report


def _is_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in MATRIX_NAMES


def quantize_weights(weights: dict, quant: str | None) -> tuple[dict, list[dict]]:
    """Quantize every float matrix to `quant` (leaving ones already quantized natively); report the error of each.

    A tied output head is the embedding table itself, so it is quantized once and stays shared.
    """
    report = []
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            report.append(dict(name=name, format=type(w).__name__ + " (native)", shape=w.shape, bytes=w.nbytes,
                               max_err=0.0, rms_err=0.0))
    if quant in (None, "fp32", "native"):
        return weights, report
    out = dict(weights)
    for name, w in weights.items():
        if _is_matrix(name) and not isinstance(w, QuantizedWeight):
            qw = quantize(w, quant)
            max_err, rms_err = quantization_error(w, qw)
            out[name] = qw
            report.append(dict(name=name, format=quant, shape=qw.shape, bytes=qw.nbytes,
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


def gguf_config(gg: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...)."""
    md = gg.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gg.path}: GGUF architecture {arch!r} is not supported (tinyllm reads 'llama' GGUF "
                              f"files; GPT-2 models load from a Hugging Face directory)")

    def get(key, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gg.path}: metadata key {arch}.{key} is missing; the file is incomplete")
        return value

    n_heads = int(get("attention.head_count"))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    return ModelConfig(
        arch="llama", vocab_size=vocab, dim=int(get("embedding_length")), n_layers=int(get("block_count")),
        n_heads=n_heads, n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        ffn_dim=int(get("feed_forward_length")), context_length=int(get("context_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=float(get("rope.freq_base", 10000.0)),
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
            except GGUFError as e:
                raise CheckpointError(f"{gg.path}: tensor {name!r}: {e}") from None
    for i in range(config.n_layers):
        weights[f"layers.{i}.wq"] = unpermute_rope_rows(weights[f"layers.{i}.wq"], config.n_heads)
        weights[f"layers.{i}.wk"] = unpermute_rope_rows(weights[f"layers.{i}.wk"], config.n_kv_heads)
    check_shapes(config, weights, str(gg.path))
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
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(buf) < 8:
        raise CheckpointError(f"{path}: file is truncated (no header); fetch it again")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise CheckpointError(f"{path}: file is truncated in its header; fetch it again")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: header is not valid JSON; not a safetensors file?") from None
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}; tinyllm reads "
                                  f"{', '.join(_ST_DTYPES)} safetensors")
        begin, end = info["data_offsets"]
        if 8 + n + end > len(buf):
            raise CheckpointError(f"{path}: file is truncated in tensor {name!r}; fetch it again")
        raw = np.frombuffer(buf, dtype=np.uint8, count=end - begin, offset=8 + n + begin)
        if dtype == "bf16":
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.view(dtype).astype(np.float32)
        if arr.size != int(np.prod(info["shape"], dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name!r} has {arr.size} values for shape {info['shape']}")
        out[name] = arr.reshape(info["shape"])
    return out


# --- Hugging Face directories --------------------------------------------------------------------------------
def hf_config(cfg: dict, source: str) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type in ("llama", "mistral"):
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"{source}: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
        if cfg.get("mlp_bias"):
            raise CheckpointError(f"{source}: llama models with mlp_bias are not supported")
        if cfg.get("sliding_window") and model_type == "mistral":
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            arch="llama", vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            ffn_dim=cfg["intermediate_size"], context_length=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), attn_bias=bool(cfg.get("attention_bias")),
            explicit_head_dim=cfg.get("head_dim"), name=cfg.get("_name_or_path", ""),
        )
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{source}: GPT-2 activation {act!r} is not supported (only gelu_new)")
        D = cfg["n_embd"]
        return ModelConfig(
            arch="gpt2", vocab_size=cfg["vocab_size"], dim=D, n_layers=cfg["n_layer"], n_heads=cfg["n_head"],
            n_kv_heads=cfg["n_head"], ffn_dim=cfg.get("n_inner") or 4 * D, context_length=cfg["n_positions"],
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5), tie_embeddings=True, attn_bias=True,
            name=cfg.get("_name_or_path", ""),
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
    config = hf_config(json.loads(cfg_path.read_text()), str(path))
    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: the index maps each tensor to its shard file
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
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
    return config, weights, Tokenizer.from_tokenizer_json(tok_path)
