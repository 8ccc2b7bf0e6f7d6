"""Which heads do a recognisable job: previous-token, induction, duplicate-token and sink heads, scored.

    python scripts/heads.py                        # the best heads of each kind
    python scripts/heads.py --grid induction       # one kind's score for every [layer, head]
    python scripts/heads.py --out heads.png        # every kind as a [layers x heads] picture

The model reads n random tokens repeated once (A B C ... A B C ...); a head's score is the attention it puts
where a head of that kind looks, averaged over the positions that have such a place (tinyllm/heads.py). 1 means
the head does nothing else. The PNG needs matplotlib (the `viz` extra).
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
from tinyllm import heads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Score every attention head as a previous-token, induction, "
                                            "duplicate-token and sink head.")
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--n", type=int, default=50, help="random tokens in the sequence, before it repeats (default 50)")
    p.add_argument("--seed", type=int, default=0, help="which random tokens (default 0)")
    p.add_argument("--top", type=int, default=5, help="heads listed per kind (default 5)")
    p.add_argument("--grid", choices=heads.KINDS, default=None, help="print this kind's [layers x heads] scores")
    p.add_argument("--out", default=None, help="also write a PNG of every kind's [layers x heads] scores")
    return p.parse_args(argv)


def render_top(scores: dict, k: int) -> str:
    lines = [f"{'kind':<16} best heads as layer.head score"]
    for kind, best in heads.top_heads(scores, k).items():
        lines.append(f"{kind:<16} " + "  ".join(f"{layer}.{head} {s:.2f}" for layer, head, s in best))
    return "\n".join(lines)


def render_grid(scores: np.ndarray, kind: str) -> str:
    L, H = scores.shape
    lines = [f"{kind}: layer | " + " ".join(f"h{h:<3d}" for h in range(H))]
    lines += [f"{'':>{len(kind) + 2}}{layer:5d} | " + " ".join(f"{s:.2f}" for s in row) for layer, row in
              enumerate(scores)]
    return "\n".join(lines)


def plot(scores: dict, title: str, out: str) -> None:
    plt = pyplot()
    L, H = next(iter(scores.values())).shape
    fig, axes = plt.subplots(1, len(scores), figsize=(1.6 + 0.45 * H * len(scores), 1.5 + 0.2 * L), sharey=True)
    for ax, (kind, s) in zip(axes, scores.items()):
        im = ax.imshow(s, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_title(kind.replace("_", " "), fontsize=9)
        ax.set_xticks(range(H), [str(h) for h in range(H)], fontsize=6)
        ax.set_xlabel("head")
    axes[0].set_yticks(range(L), [str(i) for i in range(L)], fontsize=6)
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=list(axes), label="score (attention where that kind looks)", shrink=0.8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = tinyllm.load(args.model)
        scores = heads.head_scores(model, n=args.n, seed=args.seed)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_grid(scores[args.grid], args.grid) if args.grid else render_top(scores, args.top))
    if args.out:
        name = model.config.name or "model"
        plot(scores, f"{name}: head scores on {args.n} random tokens repeated", args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
