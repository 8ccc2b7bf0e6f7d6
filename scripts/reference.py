"""The independent reference that tinyllm's tests compare against.

Nothing here is tinyllm code, and the tinyllm package never imports this module: it is built only from
third-party libraries, so that an error in tinyllm cannot hide by appearing on both sides of a comparison.

- ``reference_tokenizer``: the HF ``tokenizers`` library, fed the GGUF's own vocab and merges, with the
  pre-tokenizer SmolLM2 really uses (every digit split off alone, then GPT-2's byte-level regex). We do not use
  the tokenizer transformers builds from a GGUF: it lacks the digit split ("a  2" -> [81, 216, 216, 34]
  instead of [81, 256, 34]); see the "Reference trap" in DESIGN.md.
- ``suite_reference_tokenizer``: the same for the byte-level BPE vocabs of llama.cpp's tokenizer suite (Falcon,
  DeepSeek, MPT, Command R, Qwen, ...), each with its model's pre-tokenizer built from HF components (they pass
  every case of the suite: tests/test_tokenizer_suite.py).
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

# GGUF token_type values of control and user-defined tokens (llama.cpp's LLAMA_TOKEN_TYPE_*).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

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


# The pre-tokenizers of the byte-level BPE vocabularies in llama.cpp's tokenizer suite, built from HF tokenizers'
# own components as the models' tokenizer.json files describe them (written here independently of tinyllm).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_REGEX = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letter ranges, as (first, last) code points.
_DEEPSEEK_LETTERS = [
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
    (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
    (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
    (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943)]


def _suite_pre_tokenizer(pre: str):
    """The HF pre-tokenizer of a suite vocab's `tokenizer.ggml.pre` (ValueError for one not listed here)."""
    from tokenizers import Regex, pre_tokenizers

    def split(pattern: str):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    letters = "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTERS)
    steps = {
        "gpt-2": [byte_level], "mpt": [byte_level],
        "starcoder": [pre_tokenizers.Digits(individual_digits=True), byte_level],
        "refact": [pre_tokenizers.Digits(individual_digits=True), byte_level],
        "command-r": [pre_tokenizers.Digits(individual_digits=True), byte_level],
        "smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level],
        "llama-bpe": [split(_LLAMA3_REGEX), bytes_only],
        "qwen2": [split(_QWEN2_REGEX), bytes_only],
        "qwen35": [split(_QWEN35_REGEX), bytes_only],
        "falcon": [pre_tokenizers.Punctuation("contiguous"), byte_level, pre_tokenizers.Digits(individual_digits=False),
                   split("[0-9][0-9][0-9]")],
        "deepseek-coder": [split("[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"), split(_CJK_REGEX),
                           pre_tokenizers.Digits(individual_digits=True), bytes_only],
        "deepseek-llm": [split("[\r\n]"), split(rf"\s?[{letters}]+"),
                         split("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"), split(r"\s+$"),
                         split(_CJK_REGEX), pre_tokenizers.Digits(individual_digits=False), bytes_only],
    }
    if pre not in steps:
        raise ValueError(f"no reference pre-tokenizer for tokenizer.ggml.pre={pre!r}")
    return pre_tokenizers.Sequence(steps[pre])


def suite_reference_tokenizer(gguf_path):
    """A `tokenizers.Tokenizer` for a byte-level BPE vocab of llama.cpp's tokenizer suite (any GGUF of those pres).

    BPE over the GGUF's vocab and merges (Llama 3's with ignore_merges), the model's pre-tokenizer, control
    tokens (type 3) as special added tokens and user-defined ones (type 4) as plain added tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    meta = read_tokenizer_metadata(gguf_path)
    if meta["model"] != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {meta['model']!r}, not byte-level BPE")
    vocab = {tok: i for i, tok in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=meta["pre"] == "llama-bpe"))
    tok.pre_tokenizer = _suite_pre_tokenizer(meta["pre"])
    tok.decoder = decoders.ByteLevel()
    types = meta["token_type"]
    tok.add_tokens([AddedToken(meta["tokens"][i], special=types[i] == _TOKEN_TYPE_CONTROL, normalized=False)
                    for i in np.flatnonzero((types == _TOKEN_TYPE_CONTROL) | (types == _TOKEN_TYPE_USER_DEFINED))])
    return tok


def _suite_reference_json(gguf_path: str) -> str:
    """suite_reference_tokenizer(gguf_path) as the tokenizers library's JSON (what a worker process sends back)."""
    return suite_reference_tokenizer(gguf_path).to_str()


def suite_reference_tokenizers(gguf_paths, processes: int = 2) -> list:
    """suite_reference_tokenizer of each path, built in `processes` fresh processes at once: the gguf package reads
    a vocab at about 75 us a token (Command R's 256k tokens: 20 s), and the suite's eleven take over a minute alone.
    Each worker sends its tokenizer back as JSON."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tokenizers import Tokenizer

    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [Tokenizer.from_str(text) for text in pool.map(_suite_reference_json, map(str, gguf_paths))]


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
