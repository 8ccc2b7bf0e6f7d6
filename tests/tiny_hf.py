"""A minimal Hugging Face directory writer for tests (no torch): config.json, safetensors weights (one file or
two shards with an index) and a byte-level BPE tokenizer.json, for a tiny random llama, to load and to break."""
from __future__ import annotations

import json
import struct

import numpy as np

from tinyllm.vocab_files import byte_level_alphabet


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        blob = arr.astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def tiny_hf_llama(directory, *, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=48, sharded=False, seed=0) -> dict:
    """Write the directory; returns the config dict written."""
    rng = np.random.default_rng(seed)
    alphabet = byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    merges = ["h e", "l l", "he ll"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    eot = len(vocab)
    V, hd = eot + 1, dim // n_heads
    config = {"model_type": "llama", "vocab_size": V, "hidden_size": dim, "intermediate_size": ffn,
              "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
                 "added_tokens": [{"id": eot, "content": "<|endoftext|>", "special": True}],
                 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
                 "decoder": {"type": "ByteLevel"}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (V, dim)), "model.norm.weight": 1 + rng.normal(0, 0.1, dim)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + rng.normal(0, 0.1, dim),
                  p + "post_attention_layernorm.weight": 1 + rng.normal(0, 0.1, dim),
                  p + "self_attn.q_proj.weight": rng.normal(0, 0.3, (n_heads * hd, dim)),
                  p + "self_attn.k_proj.weight": rng.normal(0, 0.3, (n_kv_heads * hd, dim)),
                  p + "self_attn.v_proj.weight": rng.normal(0, 0.3, (n_kv_heads * hd, dim)),
                  p + "self_attn.o_proj.weight": rng.normal(0, 0.3, (dim, n_heads * hd)),
                  p + "mlp.gate_proj.weight": rng.normal(0, 0.3, (ffn, dim)),
                  p + "mlp.up_proj.weight": rng.normal(0, 0.3, (ffn, dim)),
                  p + "mlp.down_proj.weight": rng.normal(0, 0.3, (dim, ffn))})
    if not sharded:
        write_safetensors(directory / "model.safetensors", w)
        return config
    names = list(w)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, shard_names in halves.items():
        write_safetensors(directory / shard, {n: w[n] for n in shard_names})
    weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return config
