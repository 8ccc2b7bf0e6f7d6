"""The trace: what it records equals what the run computed, and recording changes nothing."""
import numpy as np
import pytest

import tinyllm
from tinyllm import ops, sampling
from tinyllm.trace import Trace, TraceLimitError
from tiny_gguf import tiny_llama

PROMPT = "hello world, the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tiny_llama(p)
    return tinyllm.load(p)


@pytest.fixture(scope="module")
def traced(tiny):
    return tinyllm.generate(tiny, PROMPT, max_new_tokens=6, trace=True)


def test_attention_rows_are_causal_distributions(traced, tiny):
    tr = traced.trace
    S = len(tr.token_ids)
    assert S == len(traced.prompt_ids) + len(traced.token_ids) - 1   # the last token is sampled, never run
    for layer in tr.layers:
        a = tr.attention(layer)                                        # [H, S, S]
        assert a.shape == (tiny.config.n_heads, S, S) and a.dtype == np.float32
        np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)
        assert not np.triu(a, k=1).any() and (np.diagonal(a, axis1=1, axis2=2) > 0).all()


def test_attention_probabilities_are_what_attention_used(traced, tiny):
    """probs @ V of the trace equals the attention output the model computes from the recorded q, k, v (GQA)."""
    tr = traced.trace
    G = tiny.config.kv_mul
    for layer in tr.layers:
        q, k, v = tr.q(layer), tr.k(layer), tr.v(layer)
        want = ops.attention(q, k, v, 0).reshape(q.shape)              # [S, H, Dh]
        got = np.einsum("hts,shd->thd", tr.attention(layer), v[:, np.arange(q.shape[1]) // G])
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_last_layer_of_the_logit_lens_is_the_model_output(traced, tiny):
    tr = traced.trace
    ids, probs = tr.logit_lens(tr.layers[-1])                           # [S, 5] each
    logits = tiny.logits(tr.token_ids)                                 # [S, V]
    p = ops.softmax(logits.astype(np.float64), axis=-1)
    np.testing.assert_array_equal(ids[:, 0], logits.argmax(-1))
    np.testing.assert_allclose(probs, np.take_along_axis(p, ids, -1), atol=1e-5)
    assert (np.diff(probs, axis=-1) <= 0).all()


def test_traced_and_untraced_runs_give_the_same_tokens(tiny):
    for kw in (dict(), dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=3)):
        plain = tinyllm.generate(tiny, PROMPT, max_new_tokens=8, **kw)
        traced = tinyllm.generate(tiny, PROMPT, max_new_tokens=8, trace=True, **kw)
        assert traced.token_ids == plain.token_ids and plain.trace is None


def test_sampling_stages_compose_to_the_distribution_sampled(tiny):
    """Each generated token's stages, in order, end in the distribution sampling.probabilities gives for the
    penalized logits of that step; the drawn token is the one generated."""
    kw = dict(temperature=0.8, top_k=15, top_p=0.8, min_p=0.05, repetition_penalty=1.2)
    params = sampling.SamplingParams(**kw)
    out = tinyllm.generate(tiny, PROMPT, max_new_tokens=5, trace=True, seed=7, ignore_eos=True, **kw)
    tr = out.trace
    names = [s.stage for s in tr.sampling[0].stages]
    assert names == ["raw", "repetition penalty", "temperature", "top-k", "top-p", "min-p"]
    ids = list(out.prompt_ids)
    for j, chosen in enumerate(tr.sampling):
        logits = tiny.logits(ids)[-1]
        want = sampling.probabilities(sampling.apply_repetition_penalty(logits, ids, 1.2), params)
        last = chosen.stages[-1]
        np.testing.assert_allclose(last.probs, want[last.ids], atol=1e-5)   # (no-cache logits: ~1e-6 apart)
        assert chosen.token == out.token_ids[j] and chosen.prob == pytest.approx(want[chosen.token], abs=1e-5)
        assert np.count_nonzero(want) <= 15                            # top-k kept at most 15
        ids.append(chosen.token)
    greedy = tinyllm.generate(tiny, PROMPT, max_new_tokens=2, trace=True).trace.sampling[0]
    assert [s.stage for s in greedy.stages] == ["raw", "greedy"] and greedy.prob == 1.0


def test_a_sampling_stage_lists_only_the_tokens_that_survived_it(tiny):
    """No stage is padded with cut tokens at probability 0; each says how many tokens it kept."""
    V = tiny.config.vocab_size
    greedy = tinyllm.generate(tiny, PROMPT, max_new_tokens=1, trace=True).trace.sampling[0]
    raw, chosen = greedy.stages
    assert (chosen.ids, chosen.probs, chosen.kept) == ([greedy.token], [1.0], 1)
    assert raw.kept == V and len(raw.ids) == 10 and min(raw.probs) > 0
    tr = tinyllm.generate(tiny, PROMPT, max_new_tokens=3, trace=True, seed=1, temperature=1.0, top_k=4,
                          top_p=0.5).trace
    for token in tr.sampling:
        for stage in token.stages:
            assert len(stage.ids) == min(10, stage.kept) and min(stage.probs) > 0, stage
        top_k, top_p = token.stages[-2:]
        assert top_k.kept == 4 and 1 <= top_p.kept <= 4 and token.token in top_p.ids


@pytest.mark.parametrize("other", [dict(backend="numpy"), dict(kv="paged")])
def test_backends_and_caches_give_the_same_trace(tiny, traced, other):
    if "backend" in other:
        tiny.backend = "numpy"
        try:
            out = tinyllm.generate(tiny, PROMPT, max_new_tokens=6, trace=True)
        finally:
            tiny.backend = "numba"
    else:
        out = tinyllm.generate(tiny, PROMPT, max_new_tokens=6, trace=True, **other)
    a, b = traced.trace, out.trace
    assert a.token_ids == b.token_ids
    for layer in a.layers:
        np.testing.assert_allclose(b.attention(layer), a.attention(layer), atol=1e-4)
        np.testing.assert_allclose(b.k(layer), a.k(layer), atol=1e-4)
        np.testing.assert_allclose(b.residual_norms(layer), a.residual_norms(layer), rtol=1e-4)


def test_trace_and_patch_are_part_of_the_package_api(tiny):
    import tinyllm.interventions
    assert tinyllm.Trace is Trace and tinyllm.Patch is tinyllm.interventions.Patch
    assert {"Trace", "Patch"} <= set(tinyllm.__all__)
    tr = tinyllm.Trace(layers=[1])
    tiny.logits([40, 41], trace=tr)
    assert tr.layers == [1] and tr.layer_output(1).shape == (2, tiny.config.dim)


def test_the_no_cache_forward_can_be_traced_and_selections_bound_memory(tiny):
    tr = Trace(layers=[1], heads=[0, 2])
    logits = tiny.logits([5, 6, 7, 8], trace=tr)
    np.testing.assert_array_equal(logits, tiny.logits([5, 6, 7, 8]))
    assert tr.layers == [1] and tr.attention(1).shape == (2, 4, 4)
    with pytest.raises(ValueError, match="layer 0 was not traced"):
        tr.attention(0)
    with pytest.raises(TraceLimitError, match="capped at 3 positions"):
        tiny.logits([5, 6, 7, 8], trace=Trace(max_positions=3))
    with pytest.raises(ValueError, match="out of range"):
        tiny.logits([5, 6], trace=Trace(layers=[99]))
    with pytest.raises(ValueError, match="one sequence"):
        tiny.logits([1, 2], trace=tr)                                   # a second sequence into a used trace
    with pytest.raises(ValueError, match="speculative"):
        tinyllm.generate(tiny, PROMPT, max_new_tokens=2, trace=True, speculative="ngram")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny_scripts") / "tiny.gguf"
    tiny_llama(p)
    return p


def _script(name, *args):
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(repo / "scripts" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_attention_script_lists_the_most_attended_positions(tiny_path, tiny):
    r = _script("attention.py", "--model", tiny_path, "--prompt", "hello world", "--layer", 1, "--text")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    n = len(tiny.tokenizer.encode("hello world"))
    assert lines[0].startswith("layer 1, the average of 4 heads") and len(lines) == 1 + n
    assert lines[1].split("->")[1].strip().startswith("0:")       # the first position can only read itself
    bad = _script("attention.py", "--model", tiny_path, "--prompt", "hi", "--layer", 7, "--text")
    errors = [line for line in bad.stderr.splitlines() if not line.startswith("tinyllm: ")]   # (a compile notice)
    assert bad.returncode == 2 and errors == ["error: --layer 7 is out of range: the model has layers 0 .. 1"]


@pytest.mark.parametrize("script, extra", [
    ("attention.py", ["--layer", 0]), ("lens.py", ["--compare", "the cat sat"]),
    ("attention.py", ["--layer", 1, "--head", 2, "--first", "renormalise", "--compare", "the cat sat"]),
    pytest.param("attention.py", ["--layer", 1, "--lines", "--first", "hide"], marks=pytest.mark.slow)])
def test_picture_scripts_write_a_png_or_say_what_to_install(tiny_path, tmp_path, script, extra):
    out = tmp_path / "picture.png"
    r = _script(script, "--model", tiny_path, "--prompt", "hello world", "--out", out, *extra)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.returncode != 0 and 'pip install -e ".[viz]"' in r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lens_script_table_ends_with_the_model_prediction(tiny_path, tiny):
    r = _script("lens.py", "--model", tiny_path, "--prompt", "hello world")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].startswith("layer |") and len(rows) == 1 + tiny.config.n_layers
    logits = tiny.logits(tiny.tokenizer.encode("hello world"))[-1]
    top = tiny.tokenizer.decode([int(logits.argmax())]).replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")[:10]
    p = ops.softmax(logits.astype(np.float64)).max()
    assert rows[-1].rstrip().endswith(f"{top} {p:.2f}")                # the last layer, last position


def test_lens_table_columns_stay_aligned_with_long_and_wide_tokens():
    import re
    from types import SimpleNamespace
    import lens                                                          # scripts/lens.py (conftest puts it on the path)
    pieces = {0: "internationalization", 1: "a", 2: "日本語の文章です", 3: "\u200b", 4: "tab\there"}
    model = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: pieces[ids[0]]))
    labels = ["supercalifragilistic", "x", "日本語の文章です", " of"]
    top_ids = np.array([[0, 1, 2, 3], [4, 0, 1, 2]])                     # [L, P]
    table = lens.render(model, labels, top_ids, np.full((2, 4), 0.5)).splitlines()
    for line in table:
        cells = list(re.finditer(r"\S+ \d\.\d\d" if line[0] != "l" else r"\S+", line[8:]))
        starts = [lens.columns(line[:8 + m.start()]) for m in cells]
        assert len(starts) == 4 and len({b - a for a, b in zip(starts, starts[1:])}) == 1, line   # evenly spaced
        assert starts[0] == 8, line
    assert table[0].split("|")[0] == "layer " and lens.columns(table[0]) <= 8 + 4 * 14


def test_attention_views_mask_the_future_and_leave_out_the_sink_as_asked():
    import attention                                                     # scripts/attention.py
    rng = np.random.default_rng(0)
    S = 6
    att = ops.softmax(np.where(np.tril(np.ones((S, S), bool)), rng.normal(size=(2, S, S)), -np.inf))   # [2, S, S]
    att = np.where(np.tril(np.ones((S, S), bool)), att, 0)              # as Trace.attention gives it
    shown = attention.view(att)
    assert (shown.mask == np.triu(np.ones((S, S), bool), k=1)).all()     # exactly the future is masked
    np.testing.assert_array_equal(shown.data, att)
    hidden = attention.view(att, "hide")
    assert hidden.mask[:, :, 0].all() and not hidden.mask[:, 1:, 1:][:, np.tril(np.ones((S - 1, S - 1), bool))].any()
    renorm = attention.view(att, "renormalise")
    np.testing.assert_allclose(renorm.sum(axis=-1)[:, 1:], 1.0, rtol=1e-6)   # rows over positions 1..t
    np.testing.assert_allclose(renorm[:, 3, 1:4], att[:, 3, 1:4] / att[:, 3, 1:4].sum(-1, keepdims=True), rtol=1e-6)
    assert renorm.mask[:, 0].all()                                       # row 0 reads only position 0: nothing left
