"""Ablation and activation patching: the model's intervened forward equals one composed by hand from reference.py's
functions, on both backends, through generate's cache and with a trace; a pass without interventions is untouched."""
import numpy as np
import pytest

import tinyllm
from tinyllm import reference as R
from tinyllm.interventions import Patch
from tinyllm.trace import Trace
from tiny_gguf import tiny_llama

IDS = [40, 70, 80, 90, 33, 101, 44]            # byte tokens of the tiny model
CLEAN = [41, 71, 81, 91, 34, 102, 45]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("interventions") / "tiny.gguf"
    tiny_llama(p)
    return p


@pytest.fixture(scope="module")
def models(tiny_path):
    return {b: tinyllm.load(tiny_path, backend=b) for b in ("numba", "numpy")}


@pytest.fixture(scope="module")
def plain(tiny_path):
    return R.load(tiny_path)                    # (config, float32 weights) for the hand-composed forward


def hand_forward(config, w, ids, ablate=(), resid=None, head=None):
    """reference.py's pieces composed by hand, with the interventions written out where they happen.
    resid / head: (layer, {position: value}) / (layer, head, {position: value}). -> logits [T, V], and per layer
    the block outputs [T, D] and the head outputs [T, H, Dh]."""
    T, H, KVH, Dh = len(ids), config.n_heads, config.n_kv_heads, config.head_dim
    pos = np.arange(T)
    x = w["tok_embed"][ids]                                              # [T, D]
    outs, heads = [], []
    for i, layer in enumerate(w["layers"]):
        h = R.norm(config, x, layer["attn_norm"], None)                  # [T, D]
        qkv = R.linear(h, layer["wqkv"])                                 # [T, (H + 2*KVH) * Dh]
        q = R.rope(qkv[:, :H * Dh].reshape(T, H, Dh), pos, config.rope_theta)
        k = R.rope(qkv[:, H * Dh:(H + KVH) * Dh].reshape(T, KVH, Dh), pos, config.rope_theta)
        v = qkv[:, (H + KVH) * Dh:].reshape(T, KVH, Dh)
        z = R.attention(q, k, v, 0).reshape(T, H, Dh)                    # [T, H, Dh]: each head's output
        for layer_i, head_i in ablate:
            if layer_i == i:
                z[:, head_i] = 0
        if head is not None and head[0] == i:
            for p, value in head[2].items():
                z[p, head[1]] = value
        heads.append(z.copy())
        x = x + R.linear(z.reshape(T, H * Dh), layer["wo"])              # [T, D]
        x = x + R.linear(R.swiglu(R.norm(config, x, layer["ffn_norm"], None), layer["w_in"]), layer["w_out"])
        if resid is not None and resid[0] == i:
            for p, value in resid[1].items():
                x[p] = value
        outs.append(x.copy())
    x = R.norm(config, x, w["final_norm"], None)
    return x @ w["lm_head"].T, outs, heads                              # [T, V]


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_ablating_heads_zeroes_their_output(models, plain, backend):
    config, w = plain
    model = models[backend]
    ablate = [(0, 1), (1, 3)]
    got = model.logits(IDS, ablate=ablate)
    want, _, _ = hand_forward(config, w, IDS, ablate)
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert np.abs(got - model.logits(IDS)).max() > 1e-2              # the ablation changed something


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_patching_puts_the_clean_run_values_in_place(models, plain, backend):
    config, w = plain
    model = models[backend]
    _, clean_outs, clean_heads = hand_forward(config, w, CLEAN)
    tr = Trace()
    model.logits(CLEAN, trace=tr)
    np.testing.assert_allclose(tr.layer_output(0), clean_outs[0], atol=1e-4)   # what a patch takes is right
    np.testing.assert_allclose(tr.head_outputs(1), clean_heads[1], atol=1e-4)

    got = model.logits(IDS, patch=[Patch.residual(tr, layer=0, positions=[2, 4])])
    want, _, _ = hand_forward(config, w, IDS, resid=(0, {2: clean_outs[0][2], 4: clean_outs[0][4]}))
    np.testing.assert_allclose(got, want, atol=2e-4)
    np.testing.assert_allclose(got[:2], model.logits(IDS)[:2], atol=1e-5)   # earlier positions cannot see it

    got = model.logits(IDS, patch=Patch.head_output(tr, layer=1, head=2, positions=[5], source_positions=[6]))
    want, _, _ = hand_forward(config, w, IDS, head=(1, 2, {5: clean_heads[1][6, 2]}))
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_generate_ablates_every_pass_through_the_cache_and_the_trace(models, plain):
    config, w = plain
    ablate = [(0, 0), (1, 1), (1, 2)]
    ids = list(IDS)
    for _ in range(5):                                                   # greedy over the hand forward, no cache
        logits, outs, _ = hand_forward(config, w, ids, ablate)
        ids.append(int(np.argmax(logits[-1])))
    for backend, model in models.items():
        out = tinyllm.generate(model, IDS, max_new_tokens=5, ablate=ablate, ignore_eos=True, trace=True)
        assert out.token_ids == ids[len(IDS):], backend
        np.testing.assert_allclose(out.trace.layer_output(1), outs[1], atol=2e-4)   # (the last token never ran)
        plain_out = tinyllm.generate(model, IDS, max_new_tokens=5, ignore_eos=True)
        assert plain_out.token_ids != out.token_ids                     # (the ablation matters for this prompt)


def test_a_pass_without_interventions_stays_fused_and_an_intervened_one_does_not(models, monkeypatch):
    model = models["numba"]
    calls = []
    real = model.compute.decode_blocks
    monkeypatch.setattr(model.compute, "decode_blocks", lambda *a: calls.append(1) or real(*a))
    tinyllm.generate(model, IDS, max_new_tokens=3, ignore_eos=True)
    fused = len(calls)
    tinyllm.generate(model, IDS, max_new_tokens=3, ignore_eos=True, ablate=[(0, 0)])
    assert fused >= 2 and len(calls) == fused


def test_bad_interventions_say_what_is_wrong(models):
    model = models["numpy"]
    tr = Trace()
    model.logits(CLEAN, trace=tr)
    cases = [
        (dict(ablate=[(2, 0)]), "layer 2 is out of range: the model has 2 layers"),
        (dict(ablate=[(0, 4)]), "head 4 is out of range: the model has 4 heads"),
        (dict(ablate=[3]), "ablate takes \\(layer, head\\) pairs"),
        (dict(patch=["resid"]), "patch takes Patch objects"),
        (dict(patch=[Patch(0, (1,), np.zeros((1, 5)))]), "patch values have shape \\(1, 5\\), need \\(1, 32\\)"),
        (dict(patch=[Patch.residual(tr, 0, [9], source_positions=[1])]), "patch position 9 is never reached"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.logits(IDS, **kwargs)
    with pytest.raises(ValueError, match="one source position per position"):
        Patch.residual(tr, 0, [1, 2], source_positions=[1])
    with pytest.raises(ValueError, match="ablate and patch follow plain decoding"):
        tinyllm.generate(model, IDS, max_new_tokens=2, ablate=[(0, 0)], speculative="ngram")


def test_patch_script_restores_everything_at_the_last_residual_and_nothing_before_the_change(tiny_path):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "scripts" / "patch.py"
    r = subprocess.run([sys.executable, str(script), "--model", str(tiny_path), "--clean", "a big cat", "--corrupt",
                        "a big cot", "--answer", "s"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1].split() for line in r.stdout.splitlines()[2:]]   # layer rows, one cell per position
    grid = np.array(rows, dtype=float)                                          # [L, T]
    assert grid.shape == (2, 9)                                                 # 9 byte tokens
    assert grid[-1, -1] == 1.0                                                  # the last residual is the answer
    assert not grid[:, :7].any()                                                # positions before 'a' / 'o' are equal
    bad = subprocess.run([sys.executable, str(script), "--model", str(tiny_path), "--clean", "a cat", "--corrupt",
                          "a big cat", "--answer", "s"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "the prompts have 5 and 9 tokens" in bad.stderr
