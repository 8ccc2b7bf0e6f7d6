"""Where each token looks: attention heatmaps of one layer, traced on a real forward pass.

    python scripts/attention.py --prompt "The capital of France is Paris. The capital of Italy is"
    python scripts/attention.py --prompt "..." --layer 3 --head 5 --out head.png
    python scripts/attention.py --prompt "..." --layer 3 --head 5 --lines            # bertviz's head view
    python scripts/attention.py --prompt "..." --first renormalise     # position 0 (the sink) left out
    python scripts/attention.py --prompt "...France..." --compare "...Italy..." --layer 3 --head 5
    python scripts/attention.py --prompt "..." --text          # in the terminal: the 3 positions each one reads most

Without --head: a grid of every head of the layer and their average; with --head: that head alone. Row t of a
heatmap is the distribution position t puts over positions 0..t; the cells above the diagonal (the future, which
the causal mask hides) are drawn grey, apart from attention that is merely ~0. Most heads park most of their
attention on position 0, the attention sink; --first hide greys that column out and scales the colours to the
rest, --first renormalise also divides each row by what is left (what the head reads when it reads something).
--lines draws the tokens twice, left and right, with a line from each query to each key as thick as the
attention. --compare runs a second prompt and draws it beside the first. PNGs need matplotlib (the `viz` extra);
--text needs nothing more.
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
from tinyllm.requests import prompt_ids  # noqa: E402
from tinyllm.trace import Trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Attention heatmaps of one layer of a real forward pass.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--layer", type=int, default=None, help="layer to show (default: the last)")
    p.add_argument("--head", type=int, default=None, help="one query head (default: all, and their average)")
    p.add_argument("--first", choices=FIRST_MODES, default="show",
                   help="position 0, the attention sink: show it, hide it (grey), or renormalise the rows without it")
    p.add_argument("--lines", action="store_true", help="draw lines from each token to the tokens it attends to "
                                                         "(one head, or the average) instead of heatmaps")
    p.add_argument("--compare", default=None, metavar="PROMPT", help="a second prompt, drawn beside the first")
    p.add_argument("--out", default="attention.png", help="PNG to write (default: attention.png)")
    p.add_argument("--text", action="store_true", help="print the top-3 attended positions instead of a PNG")
    p.add_argument("--max-positions", type=int, default=256, help="longest prompt to trace (memory bound)")
    return p.parse_args(argv)


FIRST_MODES = ("show", "hide", "renormalise")


def view(att: np.ndarray, first: str = "show") -> np.ma.MaskedArray:
    """att [..., S, S] (rows: queries, zeros above the diagonal) as drawn: the future masked, and position 0 kept,
    masked ("hide"), or masked with each row divided by what the other positions get ("renormalise"; row 0, which
    can only read position 0, is then masked whole). -> a masked array of att's shape"""
    S = att.shape[-1]
    hidden = np.broadcast_to(np.triu(np.ones((S, S), dtype=bool), k=1), att.shape).copy()   # [..., S, S]
    if first != "show":
        hidden[..., :, 0] = True
    if first == "renormalise":
        rest = att[..., :, 1:].sum(axis=-1, keepdims=True)                        # [..., S, 1]
        att = np.divide(att, rest, out=np.zeros_like(att), where=rest > 0)
        hidden[..., 0, :] = True
    return np.ma.masked_array(att, mask=hidden)


def traced_prompt(args, model=None, prompt=None):
    """Load the model (unless given) and trace a prompt's forward pass. -> (model, trace, layer)"""
    model = model or tinyllm.load(args.model)
    ids = prompt_ids(model, args.prompt if prompt is None else prompt, chat=args.chat)
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


def plot(panels: list, titles: list[str], out: str, first: str = "show") -> None:
    """panels: (att [S, S], tokens) per heatmap, token labels on both axes, the future grey, one colour bar."""
    plt = pyplot(" (or use --text)")
    n = len(panels)
    cols = min(n, 5)
    rows = -(-n // cols)
    S = max(a.shape[0] for a, _ in panels)
    size = max(3.2, min(0.24 * S, 9.0))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.2, size * rows), squeeze=False)
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#d9d9d9")                             # masked cells: the future (and position 0 when left out)
    shown = [view(a, first) for a, _ in panels]
    top = max(float(v.max()) if v.count() else 1.0 for v in shown) if first != "show" else 1.0
    for ax, v, (_, tokens), title in zip(axes.flat, shown, panels, titles):
        im = ax.imshow(v, cmap=cmap, vmin=0, vmax=top)
        ax.set_title(title, fontsize=9)
        labels = [t.replace("\n", "\\n") for t in tokens]
        if len(tokens) <= 48:
            ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)), labels, fontsize=6)
        ax.set_xlabel("attends to (key position)", fontsize=7)
        ax.set_ylabel("query position", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    what = {"show": "attention", "hide": "attention, position 0 hidden",
            "renormalise": "share of what is not on position 0"}[first]
    fig.colorbar(im, ax=list(axes.flat), shrink=0.7, label=f"{what} (grey: masked)")
    fig.savefig(out, dpi=110, bbox_inches="tight")


def plot_lines(panels: list, titles: list[str], out: str, first: str = "show") -> None:
    """bertviz's head view: per panel the tokens in two columns, a line from each query (left) to each key (right)
    as thick and dark as the attention."""
    plt = pyplot(" (or use --text)")
    S = max(a.shape[0] for a, _ in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 0.8 + 0.26 * S), squeeze=False)
    for ax, (att, tokens), title in zip(axes.flat, panels, titles):
        v = view(att, first).filled(0)                  # [S, S]: masked cells draw no line
        v = v / max(float(v.max()), 1e-9)
        n = len(tokens)
        for t in range(n):
            for j in range(t + 1):
                if v[t, j] > 0.02:
                    ax.plot([0, 1], [t, j], color="tab:blue", alpha=float(v[t, j]), linewidth=3 * float(v[t, j]))
        for t, tok in enumerate(tokens):
            label = tok.replace("\n", "\\n")
            ax.text(-0.05, t, label, ha="right", va="center", fontsize=7)
            ax.text(1.05, t, label, ha="left", va="center", fontsize=7)
        ax.set_xlim(-0.9, 1.9)
        ax.set_ylim(n - 0.5, -0.5)
        ax.axis("off")
        ax.set_title(title + "\nquery (left) -> key (right)", fontsize=9)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, trace, layer = traced_prompt(args)
        runs = [("", trace)]
        if args.compare is not None:
            runs.append(("B: ", traced_prompt(args, model, args.compare)[1]))
            runs[0] = ("A: ", trace)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    att = trace.attention(layer)                                      # [H, S, S]
    if args.text:
        chosen = att[args.head] if args.head is not None else att.mean(0)
        name = f"head {args.head}" if args.head is not None else f"the average of {att.shape[0]} heads"
        print(f"layer {layer}, {name}: for each position, the 3 positions it attends to most")
        print("\n".join(top_attended(chosen, trace.tokens)))
        return 0
    panels, titles = [], []
    for tag, tr in runs:
        a = tr.attention(layer)                                       # [H, S, S]
        heads = list(range(a.shape[0])) if args.head is None else [args.head]
        if args.compare is not None or args.lines:                    # one panel per prompt: a head or the average
            heads = heads if args.head is not None else []
        panels += [(a[h], tr.tokens) for h in heads]
        titles += [f"{tag}layer {layer} head {h}" for h in heads]
        if args.head is None:
            panels.append((a.mean(0), tr.tokens))
            titles.append(f"{tag}layer {layer}, average of heads")
    (plot_lines if args.lines else plot)(panels, titles, args.out, args.first)
    print(f"wrote {args.out}: {len(titles)} {'views' if args.lines else 'heatmaps'} over "
          f"{' and '.join(str(len(tr.tokens)) for _, tr in runs)} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
