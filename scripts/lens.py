"""The logit lens: what the model would predict if it stopped after each layer.

    python scripts/lens.py --prompt "The capital of France is"
    python scripts/lens.py --prompt "..." --out lens.png --positions 8
    python scripts/lens.py --prompt "The capital of France is" --compare "The capital of Italy is" --out lens.png

Each layer's output goes through the final norm and the output head (nostalgebraist 2020). The table shows,
per layer (rows) and position (columns), the most likely next token; the PNG colours each cell by that token's
probability. The last row is the model's own prediction. --compare runs a second prompt: its table follows, its
picture stands beside. PNGs need matplotlib (the `viz` extra).
"""
from __future__ import annotations

import argparse
import os
import sys
import unicodedata

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import tinyllm  # noqa: E402
from tinyllm.cli import pyplot  # noqa: E402
from tinyllm.requests import prompt_ids  # noqa: E402
from tinyllm.trace import Trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The logit lens of a prompt: the top next token after every layer.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--positions", type=int, default=10, help="show the last N positions in the table (default 10)")
    p.add_argument("--compare", default=None, metavar="PROMPT", help="a second prompt, shown after (and beside) it")
    p.add_argument("--out", default=None, help="also write a PNG heatmap here")
    p.add_argument("--max-positions", type=int, default=256, help="longest prompt to trace (memory bound)")
    return p.parse_args(argv)


def lens_table(trace: Trace, last: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """-> (token labels of the shown positions, top ids [L, P], their probabilities [L, P])."""
    S = len(trace.token_ids)
    shown = slice(max(0, S - last), S)
    ids, probs = zip(*(trace.logit_lens(layer, top=1) for layer in trace.layers))
    return trace.tokens[shown], np.stack(ids)[:, shown, 0], np.stack(probs)[:, shown, 0]


def shown(text: str) -> str:
    """A token's text made visible: spaces as '␣', newlines as '\\n', other invisible characters escaped (a top
    token is often only whitespace)."""
    text = text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def columns(text: str) -> int:
    """Terminal columns `text` takes: wide (CJK, emoji) characters two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def clip(text: str, most: int) -> str:
    """text in at most `most` terminal columns, cut with '…' when longer."""
    if columns(text) <= most:
        return text
    while columns(text) > most - 1:
        text = text[:-1]
    return text + "…"


def cell(text: str, width: int) -> str:
    """text in exactly `width` terminal columns, one space at least left between columns."""
    text = clip(text, width - 1)
    return text + " " * (width - columns(text))


def render(model, labels, top_ids, top_probs, width: int = 14) -> str:
    piece = lambda i: shown(model.tokenizer.decode([int(i)]))   # noqa: E731
    lines = ["layer | " + "".join(cell(shown(lab), width) for lab in labels)]
    for layer in range(top_ids.shape[0]):
        cells = "".join(cell(f"{clip(piece(i), width - 6)} {p:.2f}", width)
                        for i, p in zip(top_ids[layer], top_probs[layer]))
        lines.append(f"{layer:5d} | {cells}")
    return "\n".join(line.rstrip() for line in lines)


def plot(model, tables: list, out: str) -> None:
    """tables: (prompt, labels, top ids [L, P], their probabilities [L, P]) per prompt, drawn side by side."""
    plt = pyplot()
    L, P = tables[0][2].shape
    fig, axes = plt.subplots(1, len(tables), figsize=((1.0 + 1.1 * P) * len(tables), 0.9 + 0.28 * L), squeeze=False)
    for ax, (prompt, labels, top_ids, top_probs) in zip(axes.flat, tables):
        ax.imshow(top_probs, cmap="Blues", vmin=0, vmax=1, aspect="auto")
        for layer in range(L):
            for p in range(top_ids.shape[1]):
                ax.text(p, layer, shown(model.tokenizer.decode([int(top_ids[layer, p])]))[:8], ha="center",
                        va="center", fontsize=6, color="black" if top_probs[layer, p] < 0.6 else "white")
        ax.set_xticks(range(len(labels)), [shown(lab) for lab in labels], rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(L), [str(i) for i in range(L)], fontsize=6)
        ax.set_xlabel("input position (the token shown is what each layer predicts comes next)", fontsize=7)
        ax.set_ylabel("layer")
        ax.set_title(f"logit lens of {prompt!r}\ntop next token per layer, shaded by its probability", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = [args.prompt] + ([args.compare] if args.compare is not None else [])
    tables = []
    try:
        model = tinyllm.load(args.model)
        for prompt in prompts:
            trace = Trace(max_positions=args.max_positions)
            model.logits(prompt_ids(model, prompt, chat=args.chat), trace=trace)
            tables.append((prompt, *lens_table(trace, args.positions)))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for j, (prompt, labels, top_ids, top_probs) in enumerate(tables):
        if len(tables) > 1:
            print(("\n" if j else "") + f"{prompt!r}:")
        print(render(model, labels, top_ids, top_probs))
    if args.out:
        plot(model, tables, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
