"""Hugging Face directories: tiny random Llama (GQA, sharded, bf16) and GPT-2 models saved by transformers,
loaded by tinyllm, with logits compared to transformers' own on multi-token prompts."""
import json

import numpy as np
import pytest

import tinyllm
from tinyllm.weights import read_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.reference

TEXT = ("The quick brown fox jumps over the lazy dog. Tokenizers merge frequent pairs of bytes into tokens; "
        "rare strings shatter into bytes. 12345 numbers, café, naïve, and some code: def f(x): return x * 2\n")


def save_tokenizer(directory, vocab_size=300):
    """Train a small byte-level BPE with the tokenizers library and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def reference_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def make_llama(directory, *, tie=False, dtype=torch.float32, shard=None, seed=0):
    torch.manual_seed(seed)
    ref_tok = save_tokenizer(directory)
    cfg = transformers.LlamaConfig(vocab_size=ref_tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=tie,
                                   rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                       # larger random weights than the init, so errors would show
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype)
    model.save_pretrained(directory, max_shard_size=shard) if shard else model.save_pretrained(directory)
    # the reference reads back what was saved, in fp32 (RoPE tables recomputed in fp32, not cast from bf16)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return reloaded, ref_tok


def make_gpt2(directory, seed=0):
    torch.manual_seed(seed)
    ref_tok = save_tokenizer(directory)
    cfg = transformers.GPT2Config(vocab_size=ref_tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4,
                                  n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name:
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return model, ref_tok


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gqa_logits_match_transformers(tmp_path, tie):
    hf, ref_tok = make_llama(tmp_path, tie=tie)
    model = tinyllm.load(tmp_path)
    assert model.config.n_kv_heads == 2 and model.config.tie_embeddings == tie
    ids = model.tokenizer.encode(TEXT)
    assert ids == ref_tok.encode(TEXT).ids
    assert len(ids) > 30                         # long enough for RoPE at many positions to matter
    np.testing.assert_allclose(model.logits(ids), reference_logits(hf, ids), atol=1e-4)


def test_llama_sharded_bf16(tmp_path):
    hf, _ = make_llama(tmp_path, dtype=torch.bfloat16, shard="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = tinyllm.load(tmp_path)
    ids = model.tokenizer.encode(TEXT)[:40]
    # transformers' reference here runs the bf16 weights in fp32: the same values tinyllm widens them to
    np.testing.assert_allclose(model.logits(ids), reference_logits(hf, ids), atol=1e-4)


def test_gpt2_logits_match_transformers(tmp_path):
    hf, ref_tok = make_gpt2(tmp_path)
    model = tinyllm.load(tmp_path)
    ids = model.tokenizer.encode(TEXT)
    assert ids == ref_tok.encode(TEXT).ids
    np.testing.assert_allclose(model.logits(ids), reference_logits(hf, ids), atol=1e-4)
    cache = model.new_cache(len(ids))                 # and through the cache
    model.prefill(ids[:-1], cache)
    np.testing.assert_allclose(model.decode_step(ids[-1], cache), reference_logits(hf, ids)[-1], atol=1e-4)


def test_safetensors_reader_matches_library(tmp_path):
    from safetensors.numpy import save_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float16)}
    save_file(arrays, str(tmp_path / "x.safetensors"))
    got = read_safetensors(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(got["a"], arrays["a"])
    np.testing.assert_array_equal(got["b"], arrays["b"].astype(np.float32))


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        tinyllm.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        tinyllm.load(tmp_path)
    make_llama(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        tinyllm.load(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        tinyllm.load(tmp_path)
    st.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle checkpoints are never loaded"):
        tinyllm.load(tmp_path)
