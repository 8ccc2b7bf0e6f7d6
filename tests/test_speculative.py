"""Speculative decoding is exact: the accept/resample rule alone, sampling distributions on tiny models (chi-square
against distributions enumerated from the no-cache forward), cache state after rollback, and greedy parity with
plain decoding on the real model for every draft source and k."""
import itertools
import json
import math

import numpy as np
import pytest

import tinyllm
from tinyllm.quant import Int8Block, Int8Channel, Q4Block
from tinyllm.sampling import SamplingParams, probabilities
from tinyllm.speculative import (ModelDraft, NgramDraft, SpeculativeStats, accept_greedy, accept_or_resample,
                                 early_exit, expected_speedup, make_draft, quantized_copy, speculative_generate)

from test_model import random_model
from tiny_gguf import tiny_llama


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square with df degrees of freedom at normal quantile z (3.09: p = 0.001),
    by the Wilson-Hilferty approximation (accurate to ~1% for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities; cells expected < 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token with probability 0 was produced"
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def assert_matches(counts, probs):
    stat, df = chi2_stat(np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64))
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} >= critical {chi2_critical(df):.1f} (df {df})"


# --- the pure rule ---------------------------------------------------------------------------------------------

def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)       # all accepted: the bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, 9)       # first mismatch: the target's own token
    assert accept_greedy([5], [4, 1]) == (0, 4)
    assert accept_greedy([], [3]) == (0, 3)                       # nothing drafted: a plain step


def _normalised(rng, V):
    x = rng.random(V) ** 2
    return x / x.sum()


def test_rule_output_is_distributed_as_the_target():
    """Drafts from q, the rule's output tokens from p: position 1 always, position 2 when the first draft was
    accepted; also for a point-mass draft. And the chi-square test has power: the raw drafts fail it."""
    rng = np.random.default_rng(0)
    V, N = 6, 20000
    p = np.stack([_normalised(rng, V) for _ in range(3)])          # [k+1, V], k = 2
    q = np.stack([_normalised(rng, V) for _ in range(2)])          # [k, V], far from p
    first, second, raw = np.zeros(V), np.zeros(V), np.zeros(V)
    first_pm = np.zeros(V)
    for _ in range(N):
        x = [int(rng.choice(V, p=q[0])), int(rng.choice(V, p=q[1]))]
        a, t = accept_or_resample(x, p, q, rng)
        out = x[:a] + [t]
        first[out[0]] += 1
        raw[x[0]] += 1
        if a >= 1:
            second[out[1]] += 1
        a, t = accept_or_resample([2, 3], p, None, rng)           # point mass on tokens 2, 3
        first_pm[([2, 3][:a] + [t])[0]] += 1
    assert_matches(first, p[0])
    assert_matches(second, p[1])
    assert_matches(first_pm, p[0])
    with pytest.raises(AssertionError):
        assert_matches(raw, p[0])


def test_rule_with_draft_equal_to_target_accepts_everything():
    rng = np.random.default_rng(1)
    p = np.stack([_normalised(rng, 5) for _ in range(4)])
    for _ in range(100):
        x = [int(rng.choice(5, p=p[i])) for i in range(3)]
        assert accept_or_resample(x, p, p[:3], rng)[0] == 3


def test_expected_speedup_formula():
    assert expected_speedup(0.0, 4, 0.0) == pytest.approx(1.0)    # nothing accepted, free draft: plain speed
    assert expected_speedup(1.0, 4, 0.0) == pytest.approx(5.0)    # all accepted: k+1 tokens per target pass
    assert expected_speedup(1.0, 4, 0.25) == pytest.approx(2.5)
    a, k, c = 0.8, 3, 0.1
    assert expected_speedup(a, k, c) == pytest.approx((1 + a + a * a + a ** 3) / (k * c + 1))


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    d = NgramDraft(max_n=3)
    assert d.propose([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3], 3, SamplingParams(), None) == ([4, 5, 7], None)
    assert d.propose([1, 2, 3, 4, 2], 2, SamplingParams(), None) == ([3, 4], None)   # falls back to n = 1
    assert d.propose([1, 2, 3], 2, SamplingParams(), None) == ([], None)            # no match: nothing drafted


# --- tiny models: exact sampling, cache state, greedy parity ---------------------------------------------------

V_SMALL = 5


@pytest.fixture(scope="module")
def small():
    """A tiny llama with a 5-token vocabulary, so sequence distributions can be enumerated exactly.
    The numpy backend: at this size Numba's thread start-up costs more than the arithmetic."""
    m = random_model("llama", vocab_size=V_SMALL, ffn_dim=64, context_length=32, seed=3)
    m.backend = "numpy"
    return m


def exact_marginals(model, prompt, params, n_tokens):
    """P(token at each generated position), by enumerating every continuation with the no-cache forward.
    -> [n_tokens, V]; and the joint of the first two positions [V, V]."""
    V = model.config.vocab_size
    marg = np.zeros((n_tokens, V))
    joint = np.zeros((V, V))
    frontier = [((), 1.0)]
    for pos in range(n_tokens):
        nxt = []
        for prefix, w in frontier:
            p = probabilities(model.logits(list(prompt) + list(prefix))[-1], params)   # [V]
            marg[pos] += w * p
            for t in range(V):
                nxt.append((prefix + (t,), w * p[t]))
                if pos == 1:
                    joint[prefix[0], t] += w * p[t]
        frontier = nxt
    return marg, joint


@pytest.mark.parametrize("source", ["bad-model"] + [pytest.param(s, marks=pytest.mark.slow)
                                                   for s in ("self-int8", "layers:1", "ngram")])
def test_speculative_sampling_matches_target_distribution(small, source):
    """Tokens 2-4 come out of speculative rounds (token 1 from the prefill): their marginals and the joint of
    tokens 1-2 must match the target's exact distribution, whatever the draft, even a random unrelated model."""
    params = SamplingParams(temperature=1.0)
    if source == "bad-model":
        bad = random_model("llama", vocab_size=V_SMALL, ffn_dim=64, context_length=32, seed=11)
        bad.backend = "numpy"
        draft = ModelDraft(bad, "bad")
    else:
        draft = make_draft(small, source)
    prompt, n_tok, N = [0, 1, 2, 1, 0, 1], 4, 2000
    marg, joint = exact_marginals(small, prompt, params, n_tok)
    rng = np.random.default_rng(42)
    counts = np.zeros((n_tok, V_SMALL))
    pairs = np.zeros((V_SMALL, V_SMALL))
    drafted = accepted = 0
    for _ in range(N):
        r = speculative_generate(small, prompt, draft, num_draft=2, max_new_tokens=n_tok, params=params, rng=rng)
        for pos, t in enumerate(r.token_ids):
            counts[pos, t] += 1
        pairs[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    assert 0 < accepted < drafted                  # both acceptances and rejections were exercised
    for pos in range(n_tok):
        assert_matches(counts[pos], marg[pos])
    assert_matches(pairs.ravel(), joint.ravel())


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny GGUF checkpoints with the same tokenizer: a target and an unrelated draft."""
    d = tmp_path_factory.mktemp("spec")
    tiny_llama(d / "target.gguf", seed=0, ffn=64)
    tiny_llama(d / "draft.gguf", seed=5, n_layers=1, ffn=64)
    return tinyllm.load(d / "target.gguf"), d / "draft.gguf"


def plain_run(model, prompt, tokens):
    """A plain run's cache over `tokens` (prefill the prompt, then one decode step per token but the last)."""
    cache = model.new_cache(len(prompt) + len(tokens))
    model.prefill(prompt, cache)
    for t in tokens[:-1]:
        model.decode_step(t, cache)
    return cache


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_speculative_run_equals_plain_run(tiny_pair, temperature):
    target, draft_path = tiny_pair
    prompt = target.tokenizer.encode("hello hello hell")
    for spec in ("ngram", "self-q4", f"draft={draft_path}"):
        r = speculative_generate(target, prompt, spec, num_draft=3, max_new_tokens=20,
                                 params=SamplingParams(temperature=temperature, seed=1))
        ref = plain_run(target, prompt, r.token_ids)
        assert r.cache.length == ref.length == len(prompt) + len(r.token_ids) - 1
        n = ref.length
        np.testing.assert_allclose(r.cache.k[:, :n], ref.k[:, :n], atol=1e-5)
        np.testing.assert_allclose(r.cache.v[:, :n], ref.v[:, :n], atol=1e-5)
        assert r.stats.emitted == len(r.token_ids) - 1              # every token after the prefill's
        assert r.stats.rounds > 0 or spec == "ngram"                 # random sampled text may never repeat


def test_draft_cache_tracks_the_committed_sequence(tiny_pair):
    """After each run the draft's cache holds a prefix of prompt + output that its own plain run would hold."""
    target, draft_path = tiny_pair
    draft = make_draft(target, f"draft={draft_path}")
    prompt = target.tokenizer.encode("hello")
    r = speculative_generate(target, prompt, draft, num_draft=4, max_new_tokens=16,
                             params=SamplingParams(temperature=1.0, seed=2))
    seq = prompt + r.token_ids
    n = draft.cache.length
    assert len(prompt) <= n <= len(seq) - 1
    ref = plain_run(draft.model, seq[:1], seq[1:n + 1])
    np.testing.assert_allclose(draft.cache.k[:, :n], ref.k[:, :n], atol=1e-5)


def test_generate_keyword_and_stats(tiny_pair):
    target, _ = tiny_pair
    plain = tinyllm.generate(target, "hello", max_new_tokens=12)
    res = tinyllm.generate(target, "hello", max_new_tokens=12, speculative="layers:1", num_draft=3)
    assert res.token_ids == plain.token_ids and res.text == plain.text
    st = res.stats.speculative
    assert isinstance(st, SpeculativeStats) and st.source == "layers:1" and st.num_draft == 3
    assert sum(st.accepted_hist) == st.rounds and len(st.accepted_hist) == 4
    assert st.accepted == sum(i * n for i, n in enumerate(st.accepted_hist)) and st.drafted >= st.accepted
    assert st.emitted == st.accepted + st.target_steps
    json.dumps(res.stats.as_dict())                                   # the CLI's --json output
    paged = tinyllm.generate(target, "hello", max_new_tokens=12, speculative="self-q4", num_draft=3, kv="paged")
    assert paged.token_ids == plain.token_ids                         # rollback through the paged cache too
    with pytest.raises(ValueError, match="num_draft"):
        tinyllm.generate(target, "hello", speculative="ngram", num_draft=0)
    with pytest.raises(ValueError, match="unknown draft source"):
        tinyllm.generate(target, "hello", speculative="nonsense")
    with pytest.raises(ValueError, match="layers:N"):
        make_draft(target, "layers:2")                                # the target has only 2 layers


def test_draft_builders_share_or_shrink_the_target(tiny_pair):
    target, _ = tiny_pair
    ee = early_exit(target, 1)
    assert ee.config.n_layers == 1 and ee.layers[0] is target.layers[0] and ee.lm_head is target.lm_head
    assert target.config.n_layers == 2 and len(target.layers) == 2   # the target is untouched
    q4 = quantized_copy(target, "q4_1")
    assert q4.weight_bytes < target.weight_bytes / 3 and target.quant == "fp32"
    # 4-bit matrices, an 8-bit head (DRAFT_HEAD_FORMAT), still tied to the embedding as in the target
    assert all(isinstance(w, Q4Block) for layer in q4.layers for w in (layer.wqkv, layer.wo, layer.w_in, layer.w_out))
    assert isinstance(q4.lm_head, Int8Block) and (q4.lm_head is q4.tok_embed) == target.tied_head
    i8 = quantized_copy(target, "int8")
    assert isinstance(i8.lm_head, Int8Channel) and isinstance(i8.layers[0].wo, Int8Channel)


def test_self_drafts_share_the_target_cache(tiny_pair):
    """A self-draft drafts in the target's own KV cache (nothing to prefill, nothing to catch up); another
    checkpoint keeps its own cache. Both give the plain greedy tokens."""
    target, draft_path = tiny_pair
    prompt = target.tokenizer.encode("hello hello hell")
    cache = target.new_cache(len(prompt) + 12)
    logits, plain = target.prefill(prompt, cache), []
    while len(plain) < 12:                                           # plain greedy decoding
        plain.append(int(np.argmax(logits)))
        logits = target.decode_step(plain[-1], cache)
    for spec, shared in (("self-q4", True), ("self-int8", True), ("layers:1", True), (f"draft={draft_path}", False)):
        draft = make_draft(target, spec)
        assert draft.shares_cache is shared
        r = speculative_generate(target, prompt, draft, num_draft=3, max_new_tokens=12)
        assert r.token_ids == plain, spec
        assert (draft.cache is r.cache) is shared
        if not shared:                                   # its own cache: prefilled, then kept up with seq
            assert len(prompt) - 1 <= draft.cache.length <= r.cache.length
        assert r.cache.length == len(prompt) + len(plain) - 1


@pytest.mark.slow
def test_self_q4_draft_is_the_files_own_quantization(default_model, default_model_path):
    """The fp32 target is dequantized from the file's Q4_1 matrices and Q8_0 embedding; the self-q4 draft
    quantizes it back to exactly those bytes (the same grid, found again from each block's min and max)."""
    draft = quantized_copy(default_model, "q4_1")
    native = tinyllm.load(default_model_path, quant="native")
    pairs = [(draft.tok_embed, native.tok_embed)] + [
        (getattr(d, name), getattr(n, name)) for d, n in zip(draft.layers, native.layers)
        for name in ("wqkv", "wo", "w_in", "w_out")]
    for ours, files in pairs:
        assert type(ours) is type(files)
        for a, b in zip(ours.arrays, files.arrays):
            np.testing.assert_array_equal(a, b)


# --- the real model: greedy speculative == plain greedy, token for token ---------------------------------------

PROMPTS = ["The capital of France is Paris. The capital of Germany is",
           "Repeat exactly: the cat sat on the mat, and the dog sat on the log.\nthe cat sat on"]


N_NEW = 8   # short: with k = 8 a single round can cover the whole generation; longer runs cost minutes here


@pytest.mark.parametrize("source", ["ngram"] + [pytest.param(s, marks=pytest.mark.slow)
                                               for s in ("self-int8", "self-q4", "layers:10", "draft=PATH")])
def test_greedy_speculative_equals_plain_greedy_on_default_model(default_model, default_model_path, source):
    m = default_model
    # draft=PATH: another checkpoint with this tokenizer; the only one here is the file itself (a cache of its own)
    draft = make_draft(m, f"draft={default_model_path}" if source == "draft=PATH" else source)
    for prompt in PROMPTS:
        ids = m.tokenizer.encode(prompt)
        cache = m.new_cache(len(ids) + N_NEW)
        plain = [int(np.argmax(m.prefill(ids, cache)))]
        while len(plain) < N_NEW:                                        # plain greedy decode, written out
            logits = m.decode_step(plain[-1], cache)
            plain.append(int(np.argmax(logits)))
        for k in (1, 2, 4, 8):
            r = speculative_generate(m, ids, draft, num_draft=k, max_new_tokens=N_NEW)
            assert r.token_ids == plain, (source, k, prompt)
            if k == 4:
                n = cache.length
                assert r.cache.length == n
                np.testing.assert_allclose(r.cache.k[:, :n], cache.k[:, :n], atol=2e-4)


def test_cli_speculative(tiny_pair, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    tiny_llama(tmp_path / "t.gguf", seed=0, ffn=64)
    script = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
    base = [sys.executable, str(script), "--model", str(tmp_path / "t.gguf"), "--prompt", "hello", "--raw",
            "--json", "--max-new-tokens", "10"]
    plain = json.loads(subprocess.run(base, capture_output=True, check=True, timeout=300).stdout)
    r = subprocess.run(base + ["--speculative", "self-int8", "--num-draft", "3"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["stats"]["speculative"]["source"] == "self-int8" and out["stats"]["speculative"]["drafted"] > 0
    assert "draft_build_s" in out and "draft_build_s" not in plain    # the draft is built before generating
    bad = subprocess.run(base + ["--speculative", "layers:x"], capture_output=True, timeout=300)
    assert bad.returncode == 2 and b"layers:N" in bad.stderr


def test_draft_errors_say_they_are_the_drafts(tiny_pair, tmp_path):
    target, _ = tiny_pair
    short = tmp_path / "short.gguf"
    tiny_llama(short, seed=5, n_layers=1, context_length=8)          # same tokenizer, a context of 8
    with pytest.raises(ValueError, match="the draft model's context is 8 positions but the prompt has 1[0-9] tokens"):
        tinyllm.generate(target, "hello hello hello hello hello", speculative=f"draft={short}", max_new_tokens=2)
    with pytest.raises(ValueError, match="the model path is empty"):
        make_draft(target, "draft=")                                  # not the current directory


def test_large_num_draft_summary_stays_one_short_line(tiny_pair):
    target, _ = tiny_pair
    res = tinyllm.generate(target, "hello hello hello", max_new_tokens=8, speculative="ngram", num_draft=10_000)
    summary = res.stats.speculative.summary()
    assert len(res.stats.speculative.accepted_hist) == 10_001 and len(summary) < 400
