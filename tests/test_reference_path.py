"""tinyllm/reference.py, the plain-numpy reading path, against the engine: same logits, same greedy tokens."""
import numpy as np
import pytest

from tinyllm import reference
from tinyllm.config import ModelConfig
from tinyllm.model import Transformer
from tinyllm.weights import expected_shapes

from tiny_gguf import tiny_llama


def random_weights(arch: str, seed: int = 0) -> tuple[ModelConfig, dict]:
    """A tiny random model as the loaders' canonical flat names (q, k, v and gate, up still separate)."""
    config = ModelConfig(arch=arch, vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2 if arch == "llama" else 4,
                         ffn_dim=48, context_length=64, attn_bias=arch == "gpt2")
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in expected_shapes(config).items():
        scale, mean = (0.1, 1.0) if name.endswith("norm") else (0.3, 0.0)
        flat[name] = (mean + rng.normal(0, scale, shape)).astype(np.float32)
    return config, flat


def engine_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The engine's own prefill + decode loop, greedy."""
    cache = model.new_cache(len(prompt) + n)
    logits, out = model.prefill(prompt, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_step(out[-1], cache)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reference_logits_equal_the_numpy_engine(arch):
    config, flat = random_weights(arch)
    weights = reference.plain_weights(config, flat)
    engine = Transformer(config, dict(flat), backend="numpy")
    ids = [3, 17, 5, 42, 8, 8, 1, 30, 12, 7]
    np.testing.assert_allclose(reference.logits(config, weights, ids), engine.logits(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefill_then_decode_equals_the_no_cache_forward(arch):
    config, flat = random_weights(arch, seed=1)
    weights = reference.plain_weights(config, flat)
    ids = [4, 9, 2, 33, 21, 6, 11]
    full = reference.logits(config, weights, ids)                       # [T, V]
    cache = reference.new_cache(config, 16)
    np.testing.assert_allclose(reference.prefill(config, weights, ids[:4], cache), full[3], atol=1e-5, rtol=0)
    for t in range(4, len(ids)):
        np.testing.assert_allclose(reference.decode_step(config, weights, ids[t], cache), full[t], atol=1e-5, rtol=0)
    assert cache.length == len(ids)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reference_greedy_tokens_equal_the_engines(arch):
    config, flat = random_weights(arch, seed=2)
    weights = reference.plain_weights(config, flat)
    prompt = [5, 1, 44, 23, 9]
    ours = reference.generate(config, weights, prompt, max_new_tokens=12)
    assert ours == engine_greedy(Transformer(config, dict(flat)), prompt, 12)          # the numba backend
    assert len(ours) == 12


def test_reference_loads_a_gguf_file_like_the_engine(tmp_path):
    """A tiny GGUF file through reference.load: GGUF's permuted q/k rows come out as the engine reads them."""
    import tinyllm

    path = tmp_path / "tiny.gguf"
    tiny_llama(path, n_layers=2)
    config, weights = reference.load(path)
    engine = tinyllm.load(path, backend="numpy")
    ids = list(range(3, 40, 3))
    np.testing.assert_allclose(reference.logits(config, weights, ids), engine.logits(ids), atol=1e-5, rtol=0)
    assert all(w.dtype == np.float32 for layer in weights["layers"] for w in layer.values())


def test_generate_stops_at_a_stop_id_and_at_the_context():
    config, flat = random_weights("llama", seed=3)
    weights = reference.plain_weights(config, flat)
    free = reference.generate(config, weights, [1, 2, 3], max_new_tokens=6)
    assert reference.generate(config, weights, [1, 2, 3], max_new_tokens=6, stop_ids={free[0]}) == free[:1]
    long = reference.generate(config, weights, [i % 50 for i in range(60)], max_new_tokens=10)   # context is 64
    assert len(long) == 4
    with pytest.raises(ValueError, match="do not fit"):
        reference.logits(config, weights, list(range(1, 50)) * 2)


def test_sample_keeps_only_the_top_k_and_top_p_tokens():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    assert reference.sample(logits) == 0
    assert {reference.sample(logits, 1.0, top_k=2, rng=rng) for _ in range(200)} == {0, 1}
    assert {reference.sample(logits, 1.0, top_p=0.8, rng=rng) for _ in range(200)} == {0, 1}
    assert {reference.sample(logits, 1.0, top_p=0.81, rng=rng) for _ in range(300)} == {0, 1, 2}
    counts = np.bincount([reference.sample(logits, 1.0, rng=rng) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.slow
def test_reference_on_the_default_model_equals_the_engine(default_model_path, default_model):
    """The real model: logits within 1e-5 of the numpy engine's, and the same greedy tokens as the numba engine."""
    config, weights = reference.load(default_model_path)
    prompt = default_model.tokenizer.encode("The capital of France is")
    backend = default_model.backend
    try:
        default_model.backend = "numpy"
        np.testing.assert_allclose(reference.logits(config, weights, prompt), default_model.logits(prompt),
                                   atol=1e-5, rtol=0)
    finally:
        default_model.backend = backend
    assert reference.generate(config, weights, prompt, max_new_tokens=8) == engine_greedy(default_model, prompt, 8)
