"""The independent reference that tinyllm's tests compare against.

Nothing here is tinyllm code, and the tinyllm package never imports this module: it is built only from
third-party libraries, so that an error in tinyllm cannot hide by appearing on both sides of a comparison.

- ``reference_tokenizer``: the HF ``tokenizers`` library, fed the GGUF's own vocab and merges, with the
  pre-tokenizer SmolLM2 really uses (every digit split off alone, then GPT-2's byte-level regex). We do not use
  the tokenizer transformers builds from a GGUF: it lacks the digit split ("a  2" -> [81, 216, 216, 34]
  instead of [81, 256, 34]); see the "Reference trap" in DESIGN.md.
- ``reference_model``: transformers' Llama loaded from the same GGUF file; transformers dequantizes the
  Q4_1/Q8_0 tensors to the same fp32 weights tinyllm uses, and runs in torch fp32.
- ``reference_logits`` / ``reference_greedy``: plain forward passes and greedy decoding with the HF KV cache.

Heavy imports (torch, transformers, tokenizers, gguf) happen inside the functions, so importing this module is
cheap and works without them installed. Used by tests/test_reference_model.py,
scripts/make_reference_fixtures.py and benchmarks/bench_vs_transformers.py.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

# GGUF token_type value of control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL).
_TOKEN_TYPE_CONTROL = 3

# SmolLM2's default system message, inserted by its ChatML template when the conversation has none.
DEFAULT_SYSTEM_MESSAGE = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _gguf_string(field) -> str:
    """The value of a scalar string field of a gguf.GGUFReader."""
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _gguf_string_array(field) -> list[str]:
    """The values of an array-of-strings field of a gguf.GGUFReader."""
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _gguf_int_array(field) -> np.ndarray:
    """The values of an array-of-integers field of a gguf.GGUFReader, as an int64 array."""
    return np.array([int(field.parts[i][0]) for i in field.data], dtype=np.int64)  # [n]


def read_tokenizer_metadata(gguf_path) -> dict:
    """Vocab, merges, token types and chat template from a GGUF file's metadata (read with the `gguf` package)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = reader.fields
    meta = {
        "model": _gguf_string(fields["tokenizer.ggml.model"]),
        "pre": _gguf_string(fields["tokenizer.ggml.pre"]),
        "tokens": _gguf_string_array(fields["tokenizer.ggml.tokens"]),
        "merges": _gguf_string_array(fields["tokenizer.ggml.merges"]),
        "token_type": _gguf_int_array(fields["tokenizer.ggml.token_type"]),
    }
    if "tokenizer.chat_template" in fields:
        meta["chat_template"] = _gguf_string(fields["tokenizer.chat_template"])
    return meta


def reference_tokenizer(gguf_path):
    """A `tokenizers.Tokenizer` equivalent to SmolLM2's, built from the GGUF's vocab and merges.

    BPE over GPT-2 byte-level symbols; pre-tokenizer: every digit alone, then the GPT-2 regex (byte-level);
    ByteLevel decoder; control tokens (token_type 3, ids 0-16) registered as special tokens, so their text in
    a prompt encodes to their single id. No BOS is added (SmolLM2 adds none).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    meta = read_tokenizer_metadata(gguf_path)
    if meta["model"] != "gpt2" or meta["pre"] != "smollm":
        raise ValueError(f"expected a gpt2/smollm tokenizer, got model={meta['model']!r} pre={meta['pre']!r}")
    vocab = {tok: i for i, tok in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control_ids = np.flatnonzero(meta["token_type"] == _TOKEN_TYPE_CONTROL)  # [n_control]
    tok.add_special_tokens(
        [AddedToken(meta["tokens"][i], special=True, normalized=False) for i in control_ids]
    )
    # Adding tokens that already exist in the vocab must keep their ids.
    for i in control_ids:
        assert tok.token_to_id(meta["tokens"][i]) == i, meta["tokens"][i]
    return tok


def chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """SmolLM2's ChatML template (the GGUF's `tokenizer.chat_template`), written out by hand.

    Inserts the default system message when the first message is not a system message.
    """
    out = []
    for k, m in enumerate(messages):
        if k == 0 and m["role"] != "system":
            out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_MESSAGE}<|im_end|>\n")
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _transformers_at_least(version: str) -> bool:
    """True when the installed transformers is at least `version` (e.g. "4.56")."""
    import transformers

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())

    return parts(transformers.__version__) >= parts(version)


def reference_model(gguf_path, threads: int | None = 2):
    """transformers' LlamaForCausalLM loaded from the GGUF file, dequantized to torch fp32, in eval mode.

    `threads`: passed to torch.set_num_threads (None leaves torch's default). Needs torch, transformers,
    gguf and accelerate.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    path = Path(gguf_path).resolve()
    # transformers >= 4.56 names the argument `dtype` (and warns on the old `torch_dtype`).
    dtype_kw = "dtype" if _transformers_at_least("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **{dtype_kw: torch.float32})
    model.eval()
    return model


def reference_forward(model, ids, cache=None):
    """One forward of the reference model over `ids` (a list of ints), continuing `cache` if given.

    Returns (logits, cache): logits a torch float32 tensor [len(ids), V]; cache the HF KV cache to pass to the
    next call (created on the first call). Works whether transformers calls it `cache` (>= 5.x) or
    `past_key_values` (4.x).
    """
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long)  # [1, T]
    new_name = "cache" in inspect.signature(model.forward).parameters
    kwargs = {"cache" if new_name else "past_key_values": cache} if cache is not None else {}
    with torch.inference_mode():
        out = model(input_ids=x, use_cache=True, **kwargs)
    new_cache = out.cache if new_name else out.past_key_values
    return out.logits[0], new_cache  # [T, V]


def reference_logits(model, ids) -> np.ndarray:
    """Logits of every position of `ids` (one forward, no cache): float32 array [T, V]."""
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long)  # [1, T]
    with torch.inference_mode():
        out = model(input_ids=x, use_cache=False)
    return out.logits[0].float().numpy().astype(np.float32, copy=False)  # [T, V]


def reference_greedy(model, ids, n: int, return_logits: bool = False):
    """Greedy continuation of `ids` for `n` tokens with the HF KV cache (argmax each step, no stop tokens).

    Returns the list of n generated ids; with return_logits=True, also the float32 array [n, V] of logits
    each generated token was chosen from (row k produced token k).
    """
    out_ids: list[int] = []
    rows: list[np.ndarray] = []
    logits, cache = reference_forward(model, ids)  # [T, V]
    for step in range(n):
        row = logits[-1].float().numpy()  # [V]
        nxt = int(np.argmax(row))
        out_ids.append(nxt)
        rows.append(row.copy())
        if step < n - 1:
            logits, cache = reference_forward(model, [nxt], cache)  # [1, V]
    if return_logits:
        return out_ids, np.stack(rows).astype(np.float32)  # [n, V]
    return out_ids
