"""A minimal GGUF writer for tests: builds small llama-shaped files (random weights) to load and to break."""
from __future__ import annotations

import struct

import numpy as np

from tinyllm.gguf import GGML_TYPES

TYPES = {name: (type_id, block, size) for type_id, (name, block, size) in GGML_TYPES.items()}  # (checked against
#                                                                                  gguf-py in test_kquants.py)
# where each block type keeps its fp16 scales (every other byte of a block may hold anything)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def random_blocks(type_name: str, n_blocks: int, rng, scale: float | None = None) -> np.ndarray:
    """[n_blocks, block bytes] of random bytes whose fp16 fields are finite: of every magnitude (random bit
    patterns: subnormals to 65504, either sign) when scale is None, else uniform in [-scale, scale]."""
    b = rng.integers(0, 256, (n_blocks, TYPES[type_name][2]), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        if scale is None:
            h = rng.integers(0, 1 << 16, n_blocks).astype(np.uint16)
            h[(h & 0x7C00) == 0x7C00] &= 0xBBFF                 # exponent all ones (inf, NaN) -> a finite one
        else:
            h = rng.uniform(-scale, scale, n_blocks).astype(np.float16).view(np.uint16)
        b[:, at:at + 2] = h.view(np.uint8).reshape(n_blocks, 2)
    return b


def q4_k_bytes(qw) -> np.ndarray:
    """A quant.Q4KBlock (rows a multiple of 256 long) as GGUF's Q4_K bytes, packed as ggml's quantize_row_q4_K
    packs them. -> [O, I/256 * 144] uint8"""
    O, I = qw.shape
    n = O * I // 256
    sc, mn = qw.scales.reshape(n, 8), qw.mins.reshape(n, 8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)        # scales 0-3, top bits of scales 4-7
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)        # minimums 0-3, top bits of minimums 4-7
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    nib = qw.packed.reshape(n, 8, 16)
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)           # [n, 8 blocks, 32 values]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)          # blocks 2p, 2p+1 share 32 bytes: low, high
    half = [a.reshape(n).astype(np.float16).view(np.uint8).reshape(n, 2) for a in (qw.d, qw.dmin)]
    return np.concatenate([*half, scales, qs], axis=1).reshape(O, -1)
_VALUE_TYPES = {int: 4, float: 6, bool: 7, str: 8}  # u32, f32, bool, string


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, list):
        if v and isinstance(v[0], str):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(s) for s in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
    raise TypeError(type(v))


def write_gguf(path, metadata: dict, tensors: dict[str, np.ndarray], types: dict[str, str] | None = None,
               alignment: int = 32) -> None:
    """tensors: name -> numpy array (numpy shape; written in ggml order). types: name -> 'F32' | 'F16' | any block
    type; a block type's tensor is either its raw blocks (uint8 [rows, row bytes]) or a float array whose size is
    written as zero bytes (when only the type id matters, to the reader's error)."""
    types = types or {}
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    header += b"".join(_string(k) + _value(v) for k, v in metadata.items())
    blobs, offset = [], 0
    for name, arr in tensors.items():
        t = types.get(name, "F32")
        type_id, block, size = TYPES[t]
        shape = arr.shape
        if t == "F32":
            blob = arr.astype(np.float32).tobytes()
        elif t == "F16":
            blob = arr.astype(np.float16).tobytes()
        elif arr.dtype == np.uint8:
            blob, shape = arr.tobytes(), (*arr.shape[:-1], arr.shape[-1] // size * block)
        else:
            blob = bytes(arr.size // block * size)
        dims = list(reversed(shape))
        header += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
        pad = -len(blob) % alignment
        blobs.append(blob + bytes(pad))
        offset += len(blob) + pad
    header += bytes(-len(header) % alignment)
    with open(path, "wb") as f:
        f.write(header + b"".join(blobs))


def tiny_llama(path, *, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn=48, context_length=64, drop=None,
               shapes=None, types=None, seed=0, metadata=None) -> dict[str, np.ndarray]:
    """Write a tiny random llama GGUF with a byte-level tokenizer; returns the tensors written.
    drop: tensor name to leave out; shapes: name -> wrong shape to write instead; metadata: keys to add or
    replace (a value of bytes is written as is, after the key: a hand-made type and value); types: name -> ggml
    type (a block type of F16_FIELDS gets random blocks with scales of +-0.0002, returned as their bytes)."""
    rng = np.random.default_rng(seed)
    # GPT-2 byte-to-unicode table, so tokens are the printable strings byte-level BPE uses
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tok = {b: chr(c) for b, c in zip(bs, cs)}
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [byte_tok[b] for b in range(256)]
    merges = ["h e", "l l", "he ll"]
    tokens += ["he", "ll", "hell"]
    V = len(tokens)
    hd = dim // n_heads
    md = {
        "general.architecture": "llama", "general.name": "tiny-test",
        "llama.block_count": n_layers, "llama.context_length": context_length, "llama.embedding_length": dim,
        "llama.feed_forward_length": ffn, "llama.attention.head_count": n_heads,
        "llama.attention.head_count_kv": n_kv_heads, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": V,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (V - 3), "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    md.update(metadata or {})
    t = {"token_embd.weight": rng.normal(0, 0.5, (V, dim)), "output_norm.weight": 1 + rng.normal(0, 0.1, dim)}
    for i in range(n_layers):
        p = f"blk.{i}."
        t.update({
            p + "attn_norm.weight": 1 + rng.normal(0, 0.1, dim), p + "ffn_norm.weight": 1 + rng.normal(0, 0.1, dim),
            p + "attn_q.weight": rng.normal(0, 0.3, (n_heads * hd, dim)),
            p + "attn_k.weight": rng.normal(0, 0.3, (n_kv_heads * hd, dim)),
            p + "attn_v.weight": rng.normal(0, 0.3, (n_kv_heads * hd, dim)),
            p + "attn_output.weight": rng.normal(0, 0.3, (dim, n_heads * hd)),
            p + "ffn_gate.weight": rng.normal(0, 0.3, (ffn, dim)), p + "ffn_up.weight": rng.normal(0, 0.3, (ffn, dim)),
            p + "ffn_down.weight": rng.normal(0, 0.3, (dim, ffn)),
        })
    t = {k: v.astype(np.float32) for k, v in t.items()}
    for name, shape in (shapes or {}).items():
        t[name] = rng.normal(0, 0.3, shape).astype(np.float32)
    for name, type_name in (types or {}).items():
        if type_name in F16_FIELDS:
            rows, cols = t[name].shape
            blocks = random_blocks(type_name, rows * cols // TYPES[type_name][1], rng, scale=0.0002)
            t[name] = blocks.reshape(rows, -1)                       # [rows, row bytes]
    if drop:
        del t[drop]
    write_gguf(path, md, t, types)
    return t
