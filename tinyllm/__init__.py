"""tinyllm: transformer inference from scratch in numpy.

    import tinyllm
    model = tinyllm.load()                                   # SmolLM2-135M-Instruct, fetched on first use
    out = tinyllm.generate(model, "The capital of France is", max_new_tokens=16)
    print(out.text, out.stats.summary())

Read reference.py first: the whole idea (load, forward, prefill, decode_step, sample, generate) in about 230 lines
of plain numpy. Then the engine, in the order a token travels: tokenizer.py -> model.py (ops.py, kv_cache.py) ->
sampling.py -> requests.py -> generate.py; backend.py picks what runs each pass, kernels/ holds the compiled twins
of ops.py. Weights come from weights.py (gguf.py for GGUF files; converted.py keeps a converted file on disk for the
next load); hub.py fetches the default model.
"""
from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .generate import CacheSpec, GenerationResult, GenerationStats, generate, stream
from .interventions import Patch
from .model import Transformer
from .sampling import SamplingParams
from .threads import set_threads
from .trace import Trace

__all__ = ["load", "generate", "stream", "set_threads", "Transformer", "ModelConfig", "SamplingParams", "CacheSpec",
           "GenerationResult", "GenerationStats", "Trace", "Patch"]



def load(path: str | Path | None = None, quant: str | None = None, backend: str = "numba",
         activations: str = "float32", head_quant: str | None = None) -> Transformer:
    """Load a model: a .gguf file, a Hugging Face directory, or (path=None) the default model. A GGUF file's first
    load in a format keeps the converted model on disk, and later loads map it (converted.py).

    quant: None / "fp32" keeps float32 weights (dequantized from the file's storage type); "int8" (one scale
    per row), "int8-block" (one scale per 32 values), "q4_1" (4-bit, scale and minimum per 32 values), "q4_k"
    (4-bit, llama.cpp's Q4_K: 6-bit scales and minimums per 32 values in super-blocks of 256) quantize the matrices
    at load; "native" keeps the file's own Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K values as they are (the types of
    Q4_K_M files; docs/quantization.md says how each is laid out for the kernels).
    head_quant: the output head's (and tied embedding's) format when quantizing: by default the matrices' own for
    the 8-bit formats and "int8-block" for the 4-bit ones (a 4-bit head costs far more quality); any format or
    "fp32" overrides.
    backend: "numba" (fast kernels) or "numpy" (plain, steppable reference).
    activations: "float32" (quantized matrices multiply the float activations) or "int8" (the activations are
    rounded to int8 blocks too, and multiplied in integer arithmetic: llama.cpp's scheme, faster, less exact).
    """
    from . import hub
    from .weights import QUANT_CHOICES, check_head_quant, load_checkpoint

    if path is not None and not str(path).strip():
        raise ValueError("the model path is empty: give a .gguf file or a Hugging Face directory (or none for the "
                         "default model)")
    if quant not in QUANT_CHOICES:
        raise ValueError(f"unknown quant {quant!r}; choose one of: {', '.join(q for q in QUANT_CHOICES if q)}")
    if backend not in ("numba", "numpy"):
        raise ValueError(f"unknown backend {backend!r}; choose one of: numba, numpy")
    check_head_quant(quant, head_quant)
    config, weights, tokenizer, report = load_checkpoint(hub.ensure_default_model() if path is None else path, quant,
                                                         head_quant)
    return Transformer(config, weights, tokenizer, backend=backend, quant=quant, quant_report=report,
                       activations=activations)
