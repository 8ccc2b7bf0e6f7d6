"""Every family (Llama 3.x with its RoPE scaling, DeepSeek-Coder's linear scaling, Mistral, Qwen2, Qwen3, Granite,
StarCoder2, GPT-NeoX as Pythia is, OLMo 2, Falcon in its three layouts, MPT, GPT-2): tiny random checkpoints made by
transformers, loaded by tinyllm from the Hugging Face directory and from the GGUF file that llama.cpp's own converter
writes of it, with logits compared to transformers' on a multi-token prompt."""
import json
import subprocess
import sys

import numpy as np
import pytest

import tinyllm
from tinyllm import reference
from tinyllm.checkpoint import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from test_hf_loader import TEXT, save_tokenizer  # noqa: E402  (needs tokenizers)

pytestmark = pytest.mark.reference
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent

BASE = dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)   # (defaults lie outside a tiny vocab)
COMMON = BASE | dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
FALCON = BASE | dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)   # pairs of every kind at Dh 16
# family -> (transformers config and model class, its settings, the pre-tokenizer the GGUF records)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", COMMON | dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
               "llama-bpe"),
    "deepseek": ("LlamaConfig", "LlamaForCausalLM",                   # DeepSeek-Coder: Llama, RoPE scaled linearly
                 COMMON | dict(rope_theta=100000.0, rope_scaling=dict(rope_type="linear", factor=4.0)), "deepseek-coder"),
    "mistral": ("MistralConfig", "MistralForCausalLM", COMMON | dict(sliding_window=None), "llama-bpe"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", COMMON, "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", COMMON | dict(head_dim=32), "qwen2"),      # H * Dh = 128 != D = 64
    "granite": ("GraniteConfig", "GraniteForCausalLM", COMMON | dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                                     attention_multiplier=0.0078125, logits_scaling=8.0),
                "llama-bpe"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", COMMON, "starcoder"),   # LayerNorm, GELU, biases
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", COMMON | dict(rotary_pct=0.5, num_key_value_heads=None),
                 "gpt-2"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", COMMON, "llama-bpe"),    # norms after the sublayers, q/k norms over all
    # falcon-7b: one KV head, attention and MLP side by side on one norm; falcon-40b: KV groups, a norm for each;
    # falcon-rw: ALiBi, H KV heads, attention then MLP, biases everywhere
    "falcon": ("FalconConfig", "FalconForCausalLM", FALCON | dict(multi_query=True, parallel_attn=True), "falcon"),
    "falcon_40b": ("FalconConfig", "FalconForCausalLM", FALCON | dict(new_decoder_architecture=True, num_kv_heads=2),
                   "falcon"),
    "falcon_rw": ("FalconConfig", "FalconForCausalLM", FALCON | dict(alibi=True, multi_query=False, parallel_attn=False,
                                                                     bias=True, tie_word_embeddings=True), "falcon"),
    "mpt": ("MptConfig", "MptForCausalLM", BASE | dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                                       attn_config=dict(clip_qkv=0.6)), "mpt"),   # ALiBi, clamped qkv
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", BASE | dict(n_embd=64, n_layer=2, n_head=4, n_positions=128), "gpt-2"),
}
FAMILY_OF = {"llama3": "llama", "deepseek": "llama", "falcon_40b": "falcon", "falcon_rw": "falcon"}   # config.family


def make_family(family: str, directory, seed=0):
    """Save a tiny random checkpoint of `family` in `directory`; -> the transformers model, re-read from it."""
    config_class, model_class, settings, _ = FAMILIES[family]
    torch.manual_seed(seed)
    tok = save_tokenizer(directory)
    cfg = getattr(transformers, config_class)(vocab_size=tok.get_vocab_size(), **settings)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():                       # larger random weights than the init, so errors would show
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(directory)
    if family == "falcon":                      # as falcon-7b's config.json: multi_query says KVH = 1, no num_kv_heads
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_kv_heads"}))
    # the converter asks AutoTokenizer, which would take gpt-neox's own class (and its extra tokens) from config.json
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return getattr(transformers, model_class).from_pretrained(directory, dtype=torch.float32).eval()


def reference_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def assert_close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-5 * (1 + np.abs(want).max()))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_family(request.param, directory)
    return request.param, directory, hf


def test_hf_directory_matches_transformers(family):
    name, directory, hf = family
    model = tinyllm.load(directory)
    assert model.config.family == FAMILY_OF.get(name, name)
    assert model.has_fusable_blocks == (name in ("llama3", "deepseek", "mistral", "granite"))   # one-call blocks
    ids = model.tokenizer.encode(TEXT)
    want = reference_logits(hf, ids)
    assert_close(model.logits(ids), want)                       # the no-cache forward
    cache = model.new_cache(len(ids))                           # and prefill, then a decode step, through the cache
    assert_close(model.prefill(ids[:-1], cache), want[-2])
    assert_close(model.decode_step(ids[-1], cache), want[-1])
    config, weights = reference.load(directory)                 # and the plain-numpy reference
    assert_close(reference.logits(config, weights, ids), want)
    model.backend = "numpy"                                     # and the numpy backend
    assert_close(model.logits(ids), want)


def test_greedy_tokens_equal_transformers(family):
    name, directory, hf = family
    prompt = tinyllm.load(directory).tokenizer.encode(TEXT)[:12]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           pad_token_id=0)[0, len(prompt):].tolist()
    for backend in ("numba", "numpy"):
        out = tinyllm.generate(tinyllm.load(directory, backend=backend), prompt, max_new_tokens=12, ignore_eos=True)
        assert out.token_ids == want, backend


@pytest.mark.slow                                               # fetches llama.cpp's source once (the sdist)
def test_gguf_from_llamacpps_converter_matches_transformers(family, tmp_path):
    name, directory, hf = family
    if name == "falcon_rw":
        pytest.skip("llama.cpp's falcon is RoPE only: its converter has no name for falcon-rw's second norm")
    out = tmp_path / f"{name}.gguf"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_with_llamacpp.py"), str(directory),
                           str(out), "--pre-tokenizer", FAMILIES[name][3]], capture_output=True, text=True)
    if proc.returncode and "could not download" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = tinyllm.load(out)
    ids = model.tokenizer.encode(TEXT)
    assert_close(model.logits(ids), reference_logits(hf, ids))


def test_each_difference_matters(family):
    """The checks above can fail: drop what makes the family different and the logits move far from the reference."""
    name, directory, hf = family
    if name == "mistral":
        pytest.skip("mistral without a sliding window is llama")
    model = tinyllm.load(directory, backend="numpy")
    ids = model.tokenizer.encode(TEXT)
    want = reference_logits(hf, ids)
    import dataclasses
    if name in ("llama3", "deepseek"):
        model.rope_cos, model.rope_sin = tinyllm.ops.rope_tables(model.config.head_dim, 128, model.config.rope_theta)
    elif name in ("falcon_rw", "mpt"):
        model.alibi_slopes = np.zeros_like(model.alibi_slopes)
    elif name == "falcon_40b":                  # the MLP's own norm
        for layer in model.layers:
            layer.ffn_norm, layer.ffn_norm_b = layer.attn_norm, layer.attn_norm_b
    elif name == "gpt2":
        model.pos_embed = np.zeros_like(model.pos_embed)
    elif name == "qwen2":
        for layer in model.layers:
            layer.bqkv = None
    elif name == "starcoder2":
        for layer in model.layers:
            layer.b_in = layer.b_out = None
    elif name in ("gpt_neox", "olmo2", "qwen3", "falcon"):
        model.config = dataclasses.replace(model.config, **{"gpt_neox": dict(parallel_residual=False),
                                                            "olmo2": dict(qk_norm=""), "qwen3": dict(qk_norm=""),
                                                            "falcon": dict(parallel_residual=False)}[name])
    else:
        model.config = dataclasses.replace(model.config, logit_scale=1.0)
    assert np.abs(model.logits(ids) - want).max() > 1e-2 * (1 + np.abs(want).max())
    if name == "mpt":                           # and the clamp of q, k, v matters too
        model = tinyllm.load(directory, backend="numpy")
        model.config = dataclasses.replace(model.config, clip_qkv=0.0)
        assert np.abs(model.logits(ids) - want).max() > 1e-2 * (1 + np.abs(want).max())


def test_alibi_through_the_paged_cache_and_in_a_trace(tmp_path):
    """An ALiBi model's other paths: one-token decodes batched over a paged pool (AlibiOps.paged_attention) equal
    each sequence alone, and a trace's attention probabilities, bias included, equal transformers' attention weights."""
    from tinyllm.paged import PagedKVCache
    from tinyllm.trace import Trace

    hf = make_family("mpt", tmp_path)
    model = tinyllm.load(tmp_path)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in (3, 9, 17)]
    pool = PagedKVCache(model.config, block_size=4, num_blocks=40)
    caches = [pool.new_sequence() for _ in prompts]
    model.forward_batch(prompts, caches, last_only=True)
    batched = model.forward_batch([[1], [2], [3]], caches, last_only=True)
    for j, p in enumerate(prompts):
        assert_close(batched[j][0], model.logits(p + [j + 1])[-1])
    ids, trace = model.tokenizer.encode(TEXT)[:20], Trace()
    model.logits(ids, trace=trace)
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_attentions=True).attentions           # per layer [1, H, S, S]
    for layer in range(model.config.n_layers):
        np.testing.assert_allclose(trace.attention(layer), want[layer][0].numpy(), atol=1e-5)


def test_alibi_slopes_equal_transformers_and_llamacpp():
    """ops.alibi_slopes against MPT's and Falcon's own functions in transformers, for head counts powers of two and
    not; Falcon's rounds its slopes to bfloat16 (tinyllm keeps float32, as llama.cpp does)."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for H in (1, 3, 4, 6, 8, 12, 32, 71):
        got = tinyllm.ops.alibi_slopes(H)
        mpt = -build_mpt_alibi_tensor(H, 2)[:, 0, 0].numpy()              # [H]: the bias one position back
        falcon = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), H, torch.float32).reshape(H, 2)[:, 1]
        np.testing.assert_allclose(got, mpt, rtol=1e-6)
        np.testing.assert_array_equal(torch.tensor(got).bfloat16().float().numpy(), falcon.numpy())
    np.testing.assert_allclose(tinyllm.ops.alibi_slopes(8, max_bias=16.0), tinyllm.ops.alibi_slopes(8) ** 2, rtol=1e-6)


def test_llama3_rope_factors_equal_llamacpps_tensor():
    """ops.llama3_rope_factors against the factors transformers applies (its inverse frequencies, divided)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")                   # [Dh/2] inverse frequencies
    plain = 500000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    got = tinyllm.ops.llama3_rope_factors(16, 500000.0, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(got, (plain / scaled.double()).numpy(), rtol=1e-5)
    assert got.min() == 1.0 and got.max() == 8.0 and 1.0 < got[1] < 8.0     # kept, slowed, and one blended


def test_unsupported_family_or_rope_is_a_one_line_error(tmp_path):
    make_family("qwen2", tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(cfg | {"model_type": "bloom"}))
    with pytest.raises(CheckpointError, match=r"model_type 'bloom' is not supported \(tinyllm runs llama, mistral, "
                                              r"qwen2, qwen3, granite, starcoder2, gpt_neox, olmo2, falcon, mpt and gpt2\)"):
        tinyllm.load(tmp_path)
    path.write_text(json.dumps(cfg | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(CheckpointError, match="RoPE scaling 'yarn' is not supported"):
        tinyllm.load(tmp_path)
    (tmp_path / "mpt").mkdir()
    make_family("mpt", tmp_path / "mpt")
    path = tmp_path / "mpt" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(cfg | {"attn_config": cfg["attn_config"] | {"qk_ln": True}}))
    with pytest.raises(CheckpointError, match=r"MPT with qk_ln is not supported \(tinyllm runs MPT-7b's layout"):
        tinyllm.load(tmp_path / "mpt")


def test_a_sliding_window_makes_the_context(tmp_path):
    """Attention within a window of W positions is full attention for sequences of at most W: the context is W."""
    make_family("mistral", tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"sliding_window": 32}))
    model = tinyllm.load(tmp_path)
    assert model.config.context_length == 32
    with pytest.raises(ValueError, match="exceeds the model's context length 32"):
        model.logits(np.arange(33))
