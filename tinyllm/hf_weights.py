"""A Hugging Face model directory as (ModelConfig, canonical named arrays, Tokenizer): config.json, model.safetensors
(or shards with an index) and tokenizer.json, for the RoPE-block families (llama incl. Llama 3.x's and linear RoPE
scaling, mistral, qwen2, qwen3, granite, starcoder2, gpt_neox, olmo2, falcon; a sliding window W makes the context
W), the ALiBi ones (mpt, falcon-rw) and GPT-2. No pickle is ever read: .bin / .pt checkpoints are refused.
Left out: other RoPE scalings, MoE, and other families (refused with a message naming the supported ones).
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, check_shapes, config_number, fold_scales, model_config
from .config import FAMILIES, LLAMA_FAMILIES, ModelConfig
from .ops import alibi_slopes, llama3_rope_factors
from .tokenizer import Tokenizer


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
        return config_number(value, f"config.json {key!r}", source, kind)

    def flag(key) -> bool:
        value = cfg.get(key, False)
        if not isinstance(value, (bool, type(None))):
            raise CheckpointError(f"{source}: config.json {key!r} is {value!r}, expected true or false")
        return bool(value)

    model_type = cfg.get("model_type")
    name = cfg.get("_name_or_path", "")
    name = name if isinstance(name, str) else ""
    if model_type in LLAMA_FAMILIES:
        rope = rope_parameters(cfg, source)
        if cfg.get("mlp_bias"):
            raise CheckpointError(f"{source}: llama models with mlp_bias are not supported")
        context = get("max_position_embeddings", default=2048)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if isinstance(window, int) and 0 < window < context:
            context = window    # attention within a window of W is full attention for sequences of at most W
        n_heads = get("num_attention_heads")
        theta = rope.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
        neox, starcoder2, granite = model_type == "gpt_neox", model_type == "starcoder2", model_type == "granite"
        if starcoder2 and not cfg.get("use_bias", True):
            raise CheckpointError(f"{source}: starcoder2 without biases (use_bias false) is not supported")
        act = cfg.get("hidden_act", "silu")
        mlp = "swiglu" if not (neox or starcoder2) else {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                                                         "gelu_new": "gelu_tanh"}.get(act)
        if mlp is None or mlp == "swiglu" and act != "silu":
            raise CheckpointError(f"{source}: activation {act!r} is not supported for {model_type}")
        head_dim = get("head_dim") if cfg.get("head_dim") is not None else None
        rotary = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))
        rotary_dim = int(rotary * (head_dim or get("hidden_size") // n_heads)) if rotary != 1.0 else None
        eps_key = "layer_norm_eps" if neox else "norm_epsilon" if starcoder2 else "rms_norm_eps"
        return model_config(
            source, arch="llama", vocab_size=get("vocab_size"), dim=get("hidden_size"),
            n_layers=get("num_hidden_layers"), n_heads=n_heads, n_kv_heads=get("num_key_value_heads", default=n_heads),
            ffn_dim=get("intermediate_size"), context_length=context, norm_eps=get(eps_key, float, 1e-6),
            rope_theta=config_number(theta, "config.json 'rope_theta'", source, float),
            tie_embeddings=flag("tie_word_embeddings") if "tie_word_embeddings" in cfg else starcoder2,
            attn_bias=flag("attention_bias") or starcoder2, qkv_bias=model_type == "qwen2",
            qk_norm={"qwen3": "head", "olmo2": "all"}.get(model_type, ""), post_norm=model_type == "olmo2",
            explicit_head_dim=head_dim,
            embed_scale=get("embedding_multiplier", float, 1.0) if granite else 1.0,
            logit_scale=get("logits_scaling", float, 1.0) if granite else 1.0,
            norm="layer" if neox or starcoder2 else "rms", mlp=mlp, rotary_dim=rotary_dim,
            parallel_residual=neox and cfg.get("use_parallel_residual", True) is not False,
            family=model_type, name=name,
        )
    if model_type == "falcon":
        return _falcon_config(cfg, source, get, flag, name)
    if model_type == "mpt":
        return _mpt_config(cfg, source, get, name)
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{source}: GPT-2 activation {act!r} is not supported (only gelu_new)")
        D = get("n_embd")
        return model_config(
            source, arch="gpt2", vocab_size=get("vocab_size"), dim=D, n_layers=get("n_layer"), n_heads=get("n_head"),
            n_kv_heads=get("n_head"), ffn_dim=get("n_inner", default=4 * D), context_length=get("n_positions"),
            norm_eps=get("layer_norm_epsilon", float, 1e-5), attn_bias=True, family="gpt2",
            tie_embeddings=cfg.get("tie_word_embeddings", True) is not False,
            name=name,
        )
    raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (tinyllm runs "
                          f"{', '.join(FAMILIES[:-1])} and {FAMILIES[-1]})")


def _falcon_config(cfg: dict, source: str, get, flag, name: str) -> ModelConfig:
    """Falcon: LayerNorm, an exact-GELU MLP, attention and MLP side by side (parallel_attn) or one after the other;
    one KV head (multi_query: falcon-7b), KVH of them (new_decoder_architecture: falcon-40b) or H (falcon-rw); RoPE,
    or ALiBi (alibi: falcon-rw); biases on every projection or none (bias)."""
    act = cfg.get("activation", "gelu")
    if act != "gelu" or cfg.get("apply_residual_connection_post_layernorm"):
        raise CheckpointError(f"{source}: falcon with activation {act!r} or apply_residual_connection_post_layernorm "
                              f"is not supported (the Falcon checkpoints' exact GELU and pre-norm blocks are)")
    rope = rope_parameters(cfg, source)
    n_heads, new = get("num_attention_heads"), flag("new_decoder_architecture")
    n_kv_heads = (get("num_kv_heads", default=n_heads) if new else
                  1 if cfg.get("multi_query", True) is not False else n_heads)   # (multi_query: true by default)
    D, bias = get("hidden_size"), flag("bias")
    return model_config(
        source, arch="alibi" if flag("alibi") else "llama", vocab_size=get("vocab_size"), dim=D,
        n_layers=get("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=get("ffn_hidden_size", default=4 * D), context_length=get("max_position_embeddings", default=2048),
        norm_eps=get("layer_norm_epsilon", float, 1e-5),
        rope_theta=config_number(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "config.json 'rope_theta'",
                                 source, float),
        tie_embeddings=cfg.get("tie_word_embeddings", True) is not False, attn_bias=bias, mlp_bias=bias,
        norm="layer", mlp="gelu", parallel_residual=new or cfg.get("parallel_attn", True) is not False,
        family="falcon", name=name,
    )


def _mpt_config(cfg: dict, source: str, get, name: str) -> ModelConfig:
    """MPT as transformers runs it: ALiBi, LayerNorm without biases, no biases anywhere, an exact-GELU MLP, q/k/v
    clamped to clip_qkv if set. Refused: the attn_config options transformers' MPT does not run either."""
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise CheckpointError(f"{source}: config.json attn_config is {attn!r}, expected an object")
    unsupported = {"alibi false (learned positions)": attn.get("alibi", True) is False,
                   f"attn_type {attn.get('attn_type')!r}": attn.get("attn_type", "multihead_attention")
                   != "multihead_attention", "qk_ln": bool(attn.get("qk_ln")), "prefix_lm": bool(attn.get("prefix_lm")),
                   "softmax_scale": attn.get("softmax_scale") is not None, "biases (no_bias false)":
                   cfg.get("no_bias", True) is False, "logit_scale": cfg.get("logit_scale") is not None}
    if any(unsupported.values()):
        raise CheckpointError(f"{source}: MPT with {', '.join(k for k, bad in unsupported.items() if bad)} is not "
                              f"supported (tinyllm runs MPT-7b's layout: ALiBi, no biases)")
    clip = attn.get("clip_qkv")
    D = get("d_model")
    return model_config(
        source, arch="alibi", vocab_size=get("vocab_size"), dim=D, n_layers=get("n_layers"), n_heads=get("n_heads"),
        n_kv_heads=get("n_heads"), ffn_dim=get("expansion_ratio", default=4) * D, context_length=get("max_seq_len"),
        norm_eps=get("layer_norm_epsilon", float, 1e-5), tie_embeddings=cfg.get("tie_word_embeddings", True) is not False,
        norm="layer_nobias", mlp="gelu", mlp_bias=False,
        clip_qkv=0.0 if clip is None else config_number(clip, "config.json attn_config 'clip_qkv'", source, float),
        family="mpt", name=name,
    )


def hf_alibi_slopes(cfg: dict, config: ModelConfig, source: str) -> np.ndarray:
    """The ALiBi slopes [H] of an MPT or Falcon-RW config. transformers' Falcon adds the bias to the scores after
    they are divided by sqrt(Dh) and divides it too, so its slopes are the usual ones / sqrt(Dh)."""
    if config.family == "falcon":
        return alibi_slopes(config.n_heads) / np.float32(math.sqrt(config.head_dim))
    max_bias = (cfg.get("attn_config") or {}).get("alibi_bias_max", 8)
    return alibi_slopes(config.n_heads, config_number(max_bias, "config.json attn_config 'alibi_bias_max'", source, float))


def rope_parameters(cfg: dict, source: str) -> dict:
    """config.json's RoPE settings (`rope_parameters`, or the older `rope_scaling`); only plain RoPE and Llama 3's
    scaling are supported."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: config.json rope_scaling is {rope!r}, expected an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3", "linear"):
        raise CheckpointError(f"{source}: RoPE scaling {rope_type!r} is not supported (plain RoPE, 'linear' and "
                              f"'llama3')")
    return rope


def hf_rope_factors(cfg: dict, config: ModelConfig, source: str) -> np.ndarray | None:
    """Llama 3.x's RoPE scaling, or linear scaling (DeepSeek-Coder), as frequency divisors [Dh/2] (what the GGUF
    calls rope_freqs), or None."""
    rope = rope_parameters(cfg, source)
    num = lambda key, default: config_number(rope.get(key, default), f"config.json rope {key!r}", source, float)  # noqa: E731
    if rope.get("rope_type", rope.get("type")) == "linear":     # positions / factor: every frequency factor x slower
        return np.full(config.rope_dim // 2, num("factor", None), dtype=np.float32)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    low, high = num("low_freq_factor", 1.0), num("high_freq_factor", 4.0)
    if high <= low:
        raise CheckpointError(f"{source}: config.json rope high_freq_factor ({high}) must exceed low_freq_factor")
    return llama3_rope_factors(config.head_dim, config.rope_theta, num("factor", 8.0), low, high,
                               num("original_max_position_embeddings", 8192))


def _hf_llama_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face's llama-family names -> canonical ones (checkpoint.py)."""
    w = {"tok_embed": raw["model.embed_tokens.weight"], "final_norm": raw["model.norm.weight"]}
    if "model.norm.bias" in raw:
        w["final_norm_b"] = raw["model.norm.bias"]
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
                         ("self_attn.o_proj.bias", "bo"), ("self_attn.q_norm.weight", "q_norm"),
                         ("self_attn.k_norm.weight", "k_norm"), ("input_layernorm.bias", "attn_norm_b"),
                         ("post_attention_layernorm.bias", "ffn_norm_b"), ("mlp.c_fc.weight", "w_fc"),
                         ("mlp.c_fc.bias", "b_fc"), ("mlp.c_proj.weight", "w_proj"), ("mlp.c_proj.bias", "b_proj")]:
            if c.post_norm:          # olmo2 names its norms after where they were: after attention, after the MLP
                ours = {"ffn_norm": "attn_post_norm"}.get(ours, ours)
            if p + hf in raw:
                w[q + ours] = raw[p + hf]
        if p + "post_feedforward_layernorm.weight" in raw:
            w[q + "ffn_post_norm"] = raw[p + "post_feedforward_layernorm.weight"]
    return w


def split_grouped_qkv(w: dict, fused: str, layer: str, c: ModelConfig) -> None:
    """A fused query_key_value whose rows go KV head by KV head, each with its G query heads, then its key, then its
    value ([KVH, G + 2, Dh] rows: Falcon in all three layouts; GPT-NeoX's [H, 3, Dh] is G = 1) -> the layer's wq, wk,
    wv (and bq, bk, bv if there is a bias), in w, in place of `fused` + ".weight" / ".bias"."""
    G, rows = c.kv_mul, c.q_dim + 2 * c.kv_dim
    for kind in ("weight", "bias"):
        if f"{fused}.{kind}" not in w and kind == "bias":
            continue
        t = w.pop(f"{fused}.{kind}")                                    # [(H + 2*KVH) * Dh, (D)]
        if t.shape[0] != rows:
            raise CheckpointError(f"{fused}.{kind} has {t.shape[0]} rows, the config says {rows}")
        grouped = t.reshape(c.n_kv_heads, G + 2, c.head_dim, *t.shape[1:])   # [KVH, G + 2, Dh, (D)]
        parts = grouped[:, :G], grouped[:, G], grouped[:, G + 1]        # [KVH, G, Dh, (D)], [KVH, Dh, (D)] x 2
        for part, a in zip("qkv", parts):
            w[layer + ("w" if kind == "weight" else "b") + part] = a.reshape(-1, *t.shape[1:])


def _hf_gpt_neox_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-NeoX (Pythia) names -> canonical ones; its fused query_key_value holds each head's q, k, v rows together
    ([H, 3, Dh] rows): split into wq, wk, wv."""
    raw = {k.removeprefix("gpt_neox."): v for k, v in raw.items()}
    head = raw.get("embed_out.weight", raw.get("lm_head.weight"))
    w = {"tok_embed": raw["embed_in.weight"], "final_norm": raw["final_layer_norm.weight"],
         "final_norm_b": raw["final_layer_norm.bias"], **({"lm_head": head} if head is not None else {})}
    for i in range(c.n_layers):
        p, q = f"layers.{i}.", f"layers.{i}."
        split_grouped_qkv(raw, p + "attention.query_key_value", q, c)
        w.update({k: raw[k] for k in (q + "wq", q + "wk", q + "wv", q + "bq", q + "bk", q + "bv")})
        w.update({
            q + "attn_norm": raw[p + "input_layernorm.weight"], q + "attn_norm_b": raw[p + "input_layernorm.bias"],
            q + "wo": raw[p + "attention.dense.weight"], q + "bo": raw[p + "attention.dense.bias"],
            q + "ffn_norm": raw[p + "post_attention_layernorm.weight"],
            q + "ffn_norm_b": raw[p + "post_attention_layernorm.bias"],
            q + "w_fc": raw[p + "mlp.dense_h_to_4h.weight"], q + "b_fc": raw[p + "mlp.dense_h_to_4h.bias"],
            q + "w_proj": raw[p + "mlp.dense_4h_to_h.weight"], q + "b_proj": raw[p + "mlp.dense_4h_to_h.bias"],
        })
    return {k: np.ascontiguousarray(v) for k, v in w.items()}


def _hf_falcon_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """Falcon names -> canonical ones. Its norms: falcon-40b's ln_attn and ln_mlp, or one input_layernorm that
    falcon-7b's side-by-side attention and MLP share (the same array as both), or falcon-rw's two in sequence."""
    w = {k.removeprefix("transformer."): v for k, v in raw.items()}
    out = {"tok_embed": w["word_embeddings.weight"], "final_norm": w["ln_f.weight"], "final_norm_b": w["ln_f.bias"]}
    if not c.tie_embeddings:
        out["lm_head"] = w["lm_head.weight"]
    for i in range(c.n_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        two = p + "ln_attn.weight" in w
        norms = {"attn_norm": "ln_attn" if two else "input_layernorm",
                 "ffn_norm": "ln_mlp" if two else "input_layernorm" if c.parallel_residual else "post_attention_layernorm"}
        for ours, theirs in norms.items():
            out[q + ours], out[q + ours + "_b"] = w[p + theirs + ".weight"], w[p + theirs + ".bias"]
        split_grouped_qkv(w, p + "self_attention.query_key_value", q, c)
        names = {"self_attention.dense": ("wo", "bo"), "mlp.dense_h_to_4h": ("w_fc", "b_fc"),
                 "mlp.dense_4h_to_h": ("w_proj", "b_proj")}
        for theirs, (ours_w, ours_b) in names.items():
            out[q + ours_w] = w[p + theirs + ".weight"]
            if p + theirs + ".bias" in w:
                out[q + ours_b] = w[p + theirs + ".bias"]
        out.update({k: w[k] for k in (q + "wq", q + "wk", q + "wv", q + "bq", q + "bk", q + "bv") if k in w})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _hf_mpt_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """MPT names -> canonical ones; its fused Wqkv is rows [q | k | v]."""
    w = {k.removeprefix("transformer."): v for k, v in raw.items()}
    out = {"tok_embed": w["wte.weight"], "final_norm": w["norm_f.weight"]}
    if not c.tie_embeddings:
        out["lm_head"] = w["lm_head.weight"]
    D = c.dim
    for i in range(c.n_layers):
        p, q = f"blocks.{i}.", f"layers.{i}."
        qkv = w[p + "attn.Wqkv.weight"]                              # [3D, D]
        out.update({q + "attn_norm": w[p + "norm_1.weight"], q + "wq": qkv[:D], q + "wk": qkv[D:2 * D],
                    q + "wv": qkv[2 * D:], q + "wo": w[p + "attn.out_proj.weight"], q + "ffn_norm": w[p + "norm_2.weight"],
                    q + "w_fc": w[p + "ffn.up_proj.weight"], q + "w_proj": w[p + "ffn.down_proj.weight"]})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _hf_gpt2_names(raw: dict[str, np.ndarray], c: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2 stores its projections as Conv1D ([in, out]): transpose them to [out, in]; split the fused c_attn."""
    raw = {k.removeprefix("transformer."): v for k, v in raw.items()}
    w = {"tok_embed": raw["wte.weight"], "pos_embed": raw["wpe.weight"],
         "final_norm": raw["ln_f.weight"], "final_norm_b": raw["ln_f.bias"]}
    if not c.tie_embeddings:
        w["lm_head"] = raw["lm_head.weight"]
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
    cfg = _read_json(cfg_path)
    config = hf_config(cfg, str(path))
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
        names = {"gpt2": _hf_gpt2_names, "gpt_neox": _hf_gpt_neox_names, "falcon": _hf_falcon_names,
                 "mpt": _hf_mpt_names}.get(config.family, _hf_llama_names)
        weights = names(raw, config)
    except KeyError as e:
        raise CheckpointError(f"{path}: weight {e.args[0]!r} is missing from the safetensors files") from None
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if config.family == "granite":
        fold_scales(weights, config, attention_scale=config_number(cfg.get("attention_multiplier", 1.0),
                                                                    "config.json 'attention_multiplier'", str(path), float),
                    residual_scale=config_number(cfg.get("residual_multiplier", 1.0),
                                                 "config.json 'residual_multiplier'", str(path), float))
    rope_freqs = hf_rope_factors(cfg, config, str(path)) if config.arch == "llama" else None
    if rope_freqs is not None:
        weights["rope_freqs"] = rope_freqs
    if config.arch == "alibi":
        weights["alibi_slopes"] = hf_alibi_slopes(cfg, config, str(path))
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
