"""Activation patching: which layers, at which positions, carry the fact that decides the answer?

    python scripts/patch.py --clean "The capital of France is" --corrupt "The capital of Italy is" --answer " Paris"
    python scripts/patch.py ... --wrong " Rome" --out patch.png

Both prompts run once; then, for every layer and position, the corrupted prompt runs again with the residual stream
leaving that block at that position replaced by the clean run's (interventions.Patch.residual). Each cell says how
much of the clean answer that one replacement restores: (m - m_corrupt) / (m_clean - m_corrupt), where m is the
answer's probability at the last position (or, with --wrong, the logit of the answer minus the wrong one's). 1 means
that residual alone carries everything the clean prompt adds; 0, nothing. The prompts must have the same number of
tokens. The PNG needs matplotlib (the `viz` extra).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import tinyllm  # noqa: E402
from tinyllm.cli import pyplot  # noqa: E402
from tinyllm import ops  # noqa: E402
from tinyllm.interventions import Patch  # noqa: E402
from tinyllm.trace import Trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Activation patching over layers and positions: where does the fact "
                                            "that decides the answer travel?")
    p.add_argument("--clean", required=True, help="the prompt whose answer is right, e.g. 'The capital of France is'")
    p.add_argument("--corrupt", required=True, help="the same prompt with one fact changed (same token count)")
    p.add_argument("--answer", required=True, help="the clean prompt's next token, e.g. ' Paris' (one token)")
    p.add_argument("--wrong", default=None, help="the corrupted prompt's answer, e.g. ' Rome': measure the logit "
                                                  "difference instead of the answer's probability")
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="also write a PNG heatmap here")
    return p.parse_args(argv)


def one_token(model, text: str, flag: str) -> int:
    ids = model.tokenizer.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens {ids}: give one token (often with its leading space)")
    return ids[0]


def metric(logits: np.ndarray, answer: int, wrong: int | None) -> float:
    """logits [V] of the last position -> p(answer), or logit(answer) - logit(wrong)."""
    if wrong is not None:
        return float(logits[answer] - logits[wrong])
    return float(ops.softmax(logits.astype(np.float64))[answer])


def patching_grid(model, clean: list[int], corrupt: list[int], answer: int, wrong: int | None = None):
    """-> (restored [L, T], m_clean, m_corrupt): per layer and position, the fraction of the clean answer that
    patching that one residual into the corrupted run restores."""
    if len(clean) != len(corrupt):
        raise ValueError(f"the prompts have {len(clean)} and {len(corrupt)} tokens: patching needs the same count "
                         f"(change one word for one of the same token length)")
    trace = Trace()
    m_clean = metric(model.logits(clean, trace=trace)[-1], answer, wrong)
    m_corrupt = metric(model.logits(corrupt)[-1], answer, wrong)
    if abs(m_clean - m_corrupt) < 1e-9:
        raise ValueError("the two prompts give the same answer score: nothing to restore (change the fact, or "
                         "the answer)")
    L, T = model.config.n_layers, len(clean)
    restored = np.zeros((L, T))                                                 # [L, T]
    for layer in range(L):
        for t in range(T):
            patched = model.logits(corrupt, patch=[Patch.residual(trace, layer, [t])])[-1]   # [V]
            restored[layer, t] = (metric(patched, answer, wrong) - m_corrupt) / (m_clean - m_corrupt)
    return restored, m_clean, m_corrupt


def render(labels: list[str], restored: np.ndarray) -> str:
    width = max(8, max(len(lab) for lab in labels) + 2)
    lines = ["layer | " + "".join(f"{lab:>{width}}" for lab in labels)]
    for layer, row in enumerate(restored):
        lines.append(f"{layer:5d} | " + "".join(f"{v:>{width}.2f}" for v in row))
    return "\n".join(lines)


def plot(labels: list[str], restored: np.ndarray, title: str, out: str) -> None:
    plt = pyplot()
    L, T = restored.shape
    fig, ax = plt.subplots(figsize=(2.0 + 0.9 * T, 1.2 + 0.2 * L))
    im = ax.imshow(restored, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(T), labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(L), [str(i) for i in range(L)], fontsize=6)
    ax.set_xlabel("position whose residual is patched (clean token / corrupted token)")
    ax.set_ylabel("layer (residual leaving it)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="fraction of the clean answer restored")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = tinyllm.load(args.model)
        tok = model.tokenizer
        clean, corrupt = tok.encode(args.clean), tok.encode(args.corrupt)
        answer = one_token(model, args.answer, "--answer")
        wrong = None if args.wrong is None else one_token(model, args.wrong, "--wrong")
        restored, m_clean, m_corrupt = patching_grid(model, clean, corrupt, answer, wrong)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    piece = lambda i: tok.decode([i]).replace(" ", "␣").replace("\n", "\\n")   # noqa: E731
    labels = [piece(a) if a == b else f"{piece(a)}/{piece(b)}" for a, b in zip(clean, corrupt)]
    what = f"logit({args.answer!r}) - logit({args.wrong!r})" if wrong is not None else f"p({args.answer!r})"
    print(f"{what}: clean {m_clean:.3f}, corrupted {m_corrupt:.3f}; fraction restored by patching one residual:")
    print(render(labels, restored))
    if args.out:
        plot(labels, restored, f"patching {args.clean!r} into {args.corrupt!r}: {what}", args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
