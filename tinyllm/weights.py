"""Load a checkpoint into (ModelConfig, canonical named float32 arrays, tokenizer), quantized and fused as asked.

Two sources, each mapped to one naming scheme with every shape checked (checkpoint.py), so that a wrong or partial
file fails here with a message naming the tensor, not later inside a matmul:
  * a GGUF file (llama.cpp's format; the default model): gguf_weights.py;
  * a Hugging Face directory (config.json + safetensors + tokenizer.json): hf_weights.py.
After either, `load_checkpoint` checks that every value is finite, quantizes the matrices (quant.py) and stacks
q/k/v and gate/up into one matrix each. Left out: keeping a converted copy on disk (converted.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import converted
from .checkpoint import CheckpointError, expected_shapes  # noqa: F401  (callers import these from here too)
from .gguf_weights import gguf_config, load_gguf, unpermute_rope_rows  # noqa: F401
from .hf_weights import hf_config, load_hf_dir, read_safetensors  # noqa: F401
from .quant import FORMATS, QuantizedWeight, quantization_error, quantize, same_format

QUANT_CHOICES = (None, "fp32", "native") + FORMATS
# the matrices quantization applies to (norms, biases and learned positions stay float32)
MATRIX_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_fc", "w_proj", "tok_embed", "lm_head")


# The output head's format (and the tied embedding's) when quantizing, by the matrices' format. A 4-bit head costs
# far more quality than 4-bit matrices do (benchmarks/RESULTS.md, "Quality per format"), so 4-bit formats keep it at 8 bits, as
# llama.cpp's 4-bit mixes and the default model's own file do. `head_quant=` overrides it.
DEFAULT_HEAD_FORMAT = {"int8": "int8", "int8-block": "int8-block", "q4_1": "int8-block", "q4_k": "int8-block"}
HEAD_NAMES = ("tok_embed", "lm_head")


def load_checkpoint(path: str | Path, quant: str | None = None, head_quant: str | None = None):
    """-> (config, weights, tokenizer, quant_report). quant: None/"fp32", "int8", "int8-block", "q4_1", "q4_k", or
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
    """Stack [O_i, I] matrices into one [sum O_i, I] (float arrays or quantized weights of one type). Parts of mixed
    formats (a file's mix of types kept natively, e.g. Q4_K q/k beside a Q6_K v) are stacked in one format where
    that is exact (Q5_0 beside Q8_0: int8 blocks), else as float32 (quant.same_format)."""
    parts = same_format(parts)
    if isinstance(parts[0], QuantizedWeight):
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
