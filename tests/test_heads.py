"""Head detectors find heads built by hand to be each kind; the patterns they score against are what they say."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyllm import heads
from tinyllm.config import ModelConfig
from tinyllm.model import Transformer

V, D, H, DH, N = 16, 48, 4, 32, 8          # vocabulary, width, heads, head dim, random tokens (then repeated)
THETA = 10000.0
CONTENT = list(range(8, 16)) + list(range(24, 32))   # head dims of the slow RoPE pairs (8..15): token codes


def rotation(angle: float) -> np.ndarray:
    return np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])


def positional(wq, wk, pairs, phase, amplitude: float, scale: float) -> None:
    """q, k of one head from the constant channel 0, so that its scores are amplitude * sum_p cos(d theta_p - phase(theta_p))
    over RoPE pairs p, d = t - j the distance: phase theta peaks at the previous position, pi/2 on a slow pair grows
    with d (the farthest, position 0, wins), pi is least at d = 0. scale: channel 0 after the block's RMSNorm."""
    for p in pairs:
        theta = THETA ** (-2 * p / DH)
        c = np.sqrt(amplitude * np.sqrt(DH))                             # (scores are divided by sqrt(Dh))
        k = np.array([c, 0.0])
        q = rotation(-phase(theta)) @ k                                  # rotated q . k = cos(d theta - phase)
        wq[[p, p + DH // 2], 0], wk[[p, p + DH // 2], 0] = q * scale, k * scale


def hand_built_model() -> tuple[Transformer, dict]:
    """Two layers; residual channels: 0 constant, 1..16 the token, 17..32 the previous token (written by layer 0).
    Layer 0: head 0 previous-token (its value, the token, goes to channels 17..32), head 1 sink, head 2 duplicate
    token, head 3 idle. Layer 1: head 0 induction (query: the token; key: the previous token), the rest idle.
    -> the model and {kind: (layer, head)}"""
    config = ModelConfig(arch="llama", vocab_size=V, dim=D, n_layers=2, n_heads=H, n_kv_heads=H, ffn_dim=4,
                         context_length=64, rope_theta=THETA, explicit_head_dim=DH)
    embed = np.zeros((V, D), np.float32)
    embed[:, 0] = 1
    embed[np.arange(V), 1 + np.arange(V)] = 1
    w = {"tok_embed": embed, "final_norm": np.ones(D, np.float32)}
    s0, s1 = np.sqrt(2 / D), np.sqrt(3 / D)        # the RMS of the residual entering layer 0 and layer 1
    for i in range(2):
        wq, wk, wv = (np.zeros((H, DH, D)) for _ in range(3))             # per head [Dh, D]
        wo = np.zeros((D, H * DH))
        s = s0 if i == 0 else s1
        if i == 0:
            positional(wq[0], wk[0], range(5), lambda th: th, 20.0, s)   # peaks at d = 1
            wv[0][np.arange(V), 1 + np.arange(V)] = s                     # value: the token, one-hot
            wo[17 + np.arange(V), np.arange(V)] = 1                       # written to the previous-token channels
            positional(wq[1], wk[1], [12], lambda th: np.pi / 2, 15000.0, s)   # theta_12 = 0.001
            wq[2][CONTENT, 1 + np.arange(V)] = wk[2][CONTENT, 1 + np.arange(V)] = np.sqrt(30 * np.sqrt(DH)) * s
            positional(wq[2], wk[2], range(5), lambda th: np.pi, 2.0, s)  # -cos(d theta): itself scores least
        else:
            wq[0][CONTENT, 1 + np.arange(V)] = np.sqrt(30 * np.sqrt(DH)) * s
            wk[0][CONTENT, 17 + np.arange(V)] = np.sqrt(30 * np.sqrt(DH)) * s
        w.update({f"layers.{i}.attn_norm": np.ones(D, np.float32), f"layers.{i}.ffn_norm": np.ones(D, np.float32),
                  f"layers.{i}.wq": wq.reshape(H * DH, D).astype(np.float32),
                  f"layers.{i}.wk": wk.reshape(H * DH, D).astype(np.float32),
                  f"layers.{i}.wv": wv.reshape(H * DH, D).astype(np.float32), f"layers.{i}.wo": wo.astype(np.float32),
                  f"layers.{i}.w_gate": np.zeros((4, D), np.float32), f"layers.{i}.w_up": np.zeros((4, D), np.float32),
                  f"layers.{i}.w_down": np.zeros((D, 4), np.float32)})
    model = Transformer(config, w, backend="numpy")
    return model, {"previous_token": (0, 0), "sink": (0, 1), "duplicate_token": (0, 2), "induction": (1, 0)}


def test_detectors_find_the_heads_built_to_be_each_kind():
    model, built = hand_built_model()
    scores = heads.head_scores(model, n=N)
    for kind, (layer, head) in built.items():
        s = scores[kind]
        assert s.shape == (2, H)
        assert s[layer, head] > 0.9, (kind, s)                            # the built head does the job
        others = np.delete(s.ravel(), layer * H + head)
        assert others.max() < 0.6, (kind, s)                              # and no other head does it as well
    assert heads.top_heads(scores, k=1)["induction"][0][:2] == built["induction"]


def test_patterns_mark_what_each_kind_reads():
    ids = [5, 7, 9, 5, 7, 9]
    looks = heads.where_each_kind_looks(ids)
    marked = {kind: sorted(zip(*np.nonzero(m))) for kind, m in looks.items()}
    assert marked["previous_token"] == [(t, t - 1) for t in range(1, 6)]
    assert marked["duplicate_token"] == [(3, 0), (4, 1), (5, 2)]
    assert marked["induction"] == [(3, 1), (4, 2), (5, 3)]                # the token after the earlier copy
    assert marked["sink"] == [(t, 0) for t in range(1, 6)]
    attention = np.zeros((1, 6, 6))
    attention[0, np.arange(6), np.maximum(np.arange(6) - 1, 0)] = 1       # a perfect previous-token head
    assert heads.score(attention, looks["previous_token"])[0] == 1.0
    assert heads.score(attention, looks["induction"])[0] == 0.0


def test_the_sequence_is_random_distinct_ordinary_tokens_repeated():
    model, _ = hand_built_model()
    ids = heads.repeated_random_tokens(model, n=N, seed=1)
    assert ids[:N] == ids[N:] and len(set(ids[:N])) == N
    with pytest.raises(ValueError, match="n=40 random tokens repeated do not fit"):
        heads.repeated_random_tokens(model, n=40)


def test_heads_script_prints_the_best_heads_and_a_grid(tmp_path):
    from tiny_gguf import tiny_llama
    path = tmp_path / "tiny.gguf"
    tiny_llama(path)
    script = Path(__file__).resolve().parent.parent / "scripts" / "heads.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), "--model", str(path), "--n", "20", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(heads.KINDS) and len(lines[1].split()) == 5
    r = run("--grid", "sink")
    rows = r.stdout.splitlines()
    assert r.returncode == 0 and len(rows) == 3 and rows[0].startswith("sink: layer |")
    bad = run("--n", "40")
    assert bad.returncode == 2 and "do not fit" in bad.stderr
