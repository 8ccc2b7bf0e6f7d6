"""Where each token looks: attention heatmaps of one layer, traced on a real forward pass.

    python scripts/attention.py --prompt "The capital of France is Paris. The capital of Italy is"
    python scripts/attention.py --prompt "..." --layer 3 --head 5 --out head.png
    python scripts/attention.py --prompt "..." --text          # in the terminal: the 3 positions each one reads most

Without --head: a grid of every head of the layer and their average; with --head: that head alone. Row t of a
heatmap is the distribution position t puts over positions 0..t (causal: nothing above the diagonal). PNGs need
matplotlib (the `viz` extra); --text needs nothing more.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import tinyllm  # noqa: E402
from tinyllm.requests import prompt_ids  # noqa: E402
from tinyllm.trace import Trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Attention heatmaps of one layer of a real forward pass.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--layer", type=int, default=None, help="layer to show (default: the last)")
    p.add_argument("--head", type=int, default=None, help="one query head (default: all, and their average)")
    p.add_argument("--out", default="attention.png", help="PNG to write (default: attention.png)")
    p.add_argument("--text", action="store_true", help="print the top-3 attended positions instead of a PNG")
    p.add_argument("--max-positions", type=int, default=256, help="longest prompt to trace (memory bound)")
    return p.parse_args(argv)


def need_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        sys.exit("error: the PNG needs matplotlib: pip install -e \".[viz]\" (or use --text)")


def traced_prompt(args):
    """Load the model and trace the prompt's forward pass. -> (model, trace, layer)"""
    model = tinyllm.load(args.model)
    ids = prompt_ids(model, args.prompt, chat=args.chat)
    n_layers, n_heads = model.config.n_layers, model.config.n_heads
    layer = n_layers - 1 if args.layer is None else args.layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"--layer {layer} is out of range: the model has layers 0 .. {n_layers - 1}")
    if args.head is not None and not 0 <= args.head < n_heads:
        raise ValueError(f"--head {args.head} is out of range: the model has heads 0 .. {n_heads - 1}")
    trace = Trace(layers=[layer], max_positions=args.max_positions)
    model.logits(ids, trace=trace)
    return model, trace, layer


def top_attended(att: np.ndarray, tokens: list[str], n: int = 3) -> list[str]:
    """att [S, S] (one head, or the average) -> a line per position: the n positions it reads most."""
    lines = []
    for t in range(att.shape[0]):
        top = np.argsort(-att[t, :t + 1], kind="stable")[:n]
        reads = ", ".join(f"{s}:{tokens[s]!r} {att[t, s]:.2f}" for s in top)
        lines.append(f"{t:4d} {tokens[t]!r:>16} -> {reads}")
    return lines


def plot(att: np.ndarray, tokens: list[str], titles: list[str], out: str) -> None:
    """att [n, S, S]: one heatmap per panel, token labels on both axes."""
    plt = need_matplotlib()
    n, S = att.shape[0], att.shape[1]
    cols = min(n, 5)
    rows = -(-n // cols)
    size = max(3.0, min(0.22 * S, 9.0))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    labels = [t.replace("\n", "\\n") for t in tokens]
    for ax, a, title in zip(axes.flat, att, titles):
        ax.imshow(a, cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        if S <= 48:
            ax.set_xticks(range(S), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(S), labels, fontsize=6)
        ax.set_xlabel("attends to (key position)", fontsize=7)
        ax.set_ylabel("query position", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, trace, layer = traced_prompt(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    att = trace.attention(layer)                                      # [H, S, S]
    tokens = trace.tokens
    heads = list(range(att.shape[0])) if args.head is None else [args.head]
    if args.text:
        chosen = att[args.head] if args.head is not None else att.mean(0)
        name = f"head {args.head}" if args.head is not None else f"the average of {att.shape[0]} heads"
        print(f"layer {layer}, {name}: for each position, the 3 positions it attends to most")
        print("\n".join(top_attended(chosen, tokens)))
        return 0
    panels = att[heads]
    titles = [f"layer {layer} head {h}" for h in heads]
    if args.head is None:
        panels = np.concatenate([panels, att.mean(0, keepdims=True)])
        titles.append(f"layer {layer}, average of heads")
    plot(panels, tokens, titles, args.out)
    print(f"wrote {args.out}: {len(titles)} heatmaps over {len(tokens)} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
