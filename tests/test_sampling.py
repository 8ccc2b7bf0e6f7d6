"""Sampling: each transform does what it says, invalid values are refused, and seeds reproduce."""
import numpy as np
import pytest

from tinyllm.sampling import SamplingParams, apply_repetition_penalty, probabilities, sample

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))   # a known distribution


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == 1


def test_temperature_one_is_the_model_distribution():
    np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(temperature=1.0)), [0.5, 0.3, 0.15, 0.05],
                               rtol=1e-6)


def test_temperature_sharpens_and_flattens():
    cold = probabilities(LOGITS, SamplingParams(temperature=0.2))
    hot = probabilities(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0] > 0.9 and hot[0] < 0.5 and hot[3] > 0.05


def test_top_k_keeps_k():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("top_p, support", [(0.5, 1), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_smallest_set_reaching_p(top_p, support):
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert np.count_nonzero(p) == support and p.sum() == pytest.approx(1.0)


def test_min_p_is_relative_to_the_top_token():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, min_p=0.29))  # floor 0.145: keeps 0.5, 0.3, 0.15
    assert np.count_nonzero(p) == 3


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0])
    assert logits[0] == 2.0                                              # input untouched


def test_samples_follow_the_distribution():
    rng = np.random.default_rng(123)
    params = SamplingParams(temperature=1.0)
    draws = np.bincount([sample(LOGITS, params, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(draws, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_seed_reproduces():
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(LOGITS, params, rng) for rng in [params.make_rng()] for _ in range(50)]
    b = [sample(LOGITS, params, rng) for rng in [params.make_rng()] for _ in range(50)]
    c_params = SamplingParams(temperature=1.0, seed=8)
    c = [sample(LOGITS, c_params, rng) for rng in [c_params.make_rng()] for _ in range(50)]
    assert a == b and a != c


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
])
def test_invalid_values_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"invalid {name}="):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-6, 1e-300, 5e-324])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    logits = np.random.default_rng(0).normal(0, 5, 1000).astype(np.float32)
    params = SamplingParams(temperature=temperature, seed=0)
    rng = params.make_rng()
    assert [sample(logits, params, rng) for _ in range(5)] == [int(np.argmax(logits))] * 5
    p = probabilities(logits, params)
    assert np.isfinite(p).all() and p[np.argmax(logits)] == 1.0
