"""Write the reference fixtures tinyllm's real-model tests compare against.

    python scripts/make_reference_fixtures.py [--gguf weights/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 2]

Everything comes from scripts/reference.py (HF `tokenizers` built from the GGUF vocab/merges, transformers in
torch fp32), never from tinyllm. Outputs, both committed:

- tests/fixtures/smollm2_reference.json: the prompts (text, and messages for chat prompts), their token ids,
  40-token greedy continuations, some tokenizer-only cases, and provenance (library versions, date, command,
  the GGUF's sha256).
- tests/fixtures/smollm2_reference.npz (np.savez_compressed, no pickled objects). Full logits [T, 49152] per
  prompt would be tens of MB, so it keeps, for prompt k ("p{k}_..."):
    columns                 [C] int32    a fixed, seeded set of C=256 vocab ids shared by every prompt
    p{k}_ids                [T] int32    the prompt's token ids
    p{k}_cols               [T, C] f32   logits of every prompt position at `columns`
    p{k}_top_ids            [T, 10] i32  every position's 10 largest logits: their ids ...
    p{k}_top_vals           [T, 10] f32  ... and values
    p{k}_last               [V] f32      the full logits row of the last prompt position
    p{k}_gen_ids            [N] int32    greedy continuation (N=40; with the KV cache, no stop tokens)
    p{k}_gen_margin         [N] f32      per step, top-1 minus top-2 logit (near-ties excuse a mismatch)
    p{k}_gen_cols           [N, C] f32   per step, logits at `columns` ...
    p{k}_gen_top_ids        [N, 10] i32  ... and the 10 largest logits (ids, values), for checking the decode
    p{k}_gen_top_vals       [N, 10] f32  path of tinyllm step by step while its tokens agree with these
  Row n of the gen_* arrays holds the logits that chose gen_ids[n] (row 0 equals p{k}_last).

Takes about a minute on 2 cores (most of it loading and dequantizing the model in transformers).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import reference  # noqa: E402  (scripts/ is not a package)

N_COLUMNS = 256  # shared vocab columns stored for every position
COLUMN_SEED = 20250101  # seed of the column choice (np.random.default_rng)
TOP_K = 10  # per position, the ids/values of the K largest logits are stored
N_GENERATE = 40  # greedy continuation length per prompt

LONG_STORY = (
    "The lighthouse at the end of the northern pier had been dark for eleven years when Mara Ellison bought it "
    "at auction for less than the price of a used car. Her friends thought she had lost her mind. The building "
    "leaked, the iron stairs were red with rust, and the nearest grocery store was a forty-minute drive along a "
    "road that flooded every spring. But Mara had spent two decades working in a windowless office, and the "
    "idea of waking up to the sound of waves was worth every inconvenience.\n\n"
    "The first winter was harder than she expected. Storms rolled in from the sea almost every week, and the "
    "wind found its way through every crack in the old stone walls. She learned to patch the roof with tar and "
    "canvas, to keep a stack of dry wood by the stove, and to read the sky the way the fishermen did. In the "
    "evenings she sat at the kitchen table with a lamp and a stack of books about the history of the coast, "
    "and slowly she began to understand why the lighthouse had been built in the first place.\n\n"
    "More than a hundred ships had been lost on the rocks below the point before the tower was finished. The "
    "keepers who lived there had kept careful logs of every storm, every wreck and every rescue, and Mara found "
    "those logs in a wooden chest under the stairs. The handwriting changed every few decades as one keeper "
    "replaced another, but the entries were always short and calm, even when they described nights of terrible "
    "danger. One entry, written during a gale in the autumn of a year long past, simply read: Light kept "
    "burning all night. Two boats came in safely. Tea at dawn.\n\n"
    "By the time spring arrived, Mara had decided what she would do with the place. She would restore the "
    "lamp, open the tower to visitors on weekends, and publish the keepers' logs so that their quiet courage "
    "would not be forgotten. It would take years, and most of her savings, but for the first time in a long "
    "while she knew exactly what she wanted to spend her days doing."
)

GARDEN_ESSAY = (
    "A small vegetable garden can produce a surprising amount of food if it is planned with care. The most "
    "important decision is where to put it: most vegetables need at least six hours of direct sunlight each "
    "day, and soil that drains well after rain. Before planting anything, it is worth testing the soil and "
    "mixing in a few inches of compost, which feeds the plants and helps the ground hold moisture during dry "
    "weeks. Beginners often plant too much at once; it is better to start with three or four crops that your "
    "family actually likes to eat, such as tomatoes, beans, lettuce and squash, and to add more the next year "
    "once you have learned how much time the garden really needs."
)


def build_prompts() -> list[dict]:
    """The fixture prompts: name, kind ("plain" or "chat"), text, and messages for chat prompts."""
    chat_short = [{"role": "user", "content": "What is the capital of France?"}]
    chat_math = [
        {
            "role": "user",
            "content": "I have 12 apples and give away 5, then buy 24 more. How many apples do I have now? "
            "Explain each step.",
        }
    ]
    chat_multi = [
        {"role": "user", "content": "Can you suggest a name for a small bakery by the sea?"},
        {
            "role": "assistant",
            "content": "How about \"Salt & Crumb\"? It hints at the ocean air and at fresh bread.",
        },
        {"role": "user", "content": "I like it. Now write a two-sentence description for its website."},
    ]
    prompts = [
        {"name": "two_tokens", "kind": "plain", "text": "Once upon"},
        {"name": "plain_short", "kind": "plain", "text": "The three primary colors are"},
        {"name": "chat_capital", "kind": "chat", "messages": chat_short},
        {"name": "chat_math_digits", "kind": "chat", "messages": chat_math},
        {"name": "chat_multi_turn", "kind": "chat", "messages": chat_multi},
        {"name": "plain_garden", "kind": "plain", "text": GARDEN_ESSAY},
        {"name": "plain_long_story", "kind": "plain", "text": LONG_STORY},
    ]
    for p in prompts:
        if p["kind"] == "chat":
            p["text"] = reference.chatml(p["messages"], add_generation_prompt=True)
    return prompts


# Tokenizer-only cases (no model run): edge cases for the pre-tokenizer, the digit split and special tokens.
TOKENIZER_CASES = [
    "a  2",
    "In 2024, 3.14159 and 1,000,000 were all numbers; so was x2y3.",
    "  leading spaces, trailing spaces   \n\n\ttabs\tand\r\nwindows newlines\n",
    "don't can't I'll we've they're she'd he's I'm",
    "héllo naïve café; 日本語のテキスト; emoji 🤖🚀; Ελληνικά; русский",
    "def add(a, b):\n    return a + b  # comment\n\nprint(add(2, 40))\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|im_start|>assistant\n",
    "!!! ??? ... --- *** ((( ))) @user #tag $100 %50 ^_^ ~/path/to/file.txt",
]


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and values of the k largest entries of each row, largest first: ([R, k] int32, [R, k] float32)."""
    idx = np.argpartition(-logits, k, axis=-1)[:, :k]  # [R, k], unordered
    vals = np.take_along_axis(logits, idx, axis=-1)  # [R, k]
    order = np.argsort(-vals, axis=-1, kind="stable")  # [R, k]
    idx = np.take_along_axis(idx, order, axis=-1)  # [R, k]
    vals = np.take_along_axis(vals, order, axis=-1)  # [R, k]
    return idx.astype(np.int32), vals.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(REPO / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "smollm2_reference"))
    args = ap.parse_args()

    import tokenizers
    import torch
    import transformers

    gguf_path = Path(args.gguf)
    t_start = time.perf_counter()
    tok = reference.reference_tokenizer(gguf_path)
    model = reference.reference_model(gguf_path, threads=args.threads)
    vocab_size = int(model.config.vocab_size)

    rng = np.random.default_rng(COLUMN_SEED)
    columns = np.sort(rng.choice(vocab_size, size=N_COLUMNS, replace=False)).astype(np.int32)  # [C]
    arrays: dict[str, np.ndarray] = {"columns": columns}

    prompts = build_prompts()
    for k, p in enumerate(prompts):
        ids = tok.encode(p["text"]).ids
        p["ids"] = ids
        logits = reference.reference_logits(model, ids)  # [T, V]
        gen_ids, gen_logits = reference.reference_greedy(model, ids, N_GENERATE, return_logits=True)  # [N, V]
        top_ids, top_vals = top_k(logits, TOP_K)  # [T, 10] each
        gen_top_ids, gen_top_vals = top_k(gen_logits, TOP_K)  # [N, 10] each
        margin = gen_top_vals[:, 0] - gen_top_vals[:, 1]  # [N]
        assert np.array_equal(gen_top_ids[:, 0], np.array(gen_ids)), "greedy ids must be the row argmax"
        arrays[f"p{k}_ids"] = np.array(ids, dtype=np.int32)  # [T]
        arrays[f"p{k}_cols"] = logits[:, columns]  # [T, C]
        arrays[f"p{k}_top_ids"] = top_ids
        arrays[f"p{k}_top_vals"] = top_vals
        arrays[f"p{k}_last"] = logits[-1].copy()  # [V]
        arrays[f"p{k}_gen_ids"] = np.array(gen_ids, dtype=np.int32)  # [N]
        arrays[f"p{k}_gen_margin"] = margin.astype(np.float32)  # [N]
        arrays[f"p{k}_gen_cols"] = gen_logits[:, columns]  # [N, C]
        arrays[f"p{k}_gen_top_ids"] = gen_top_ids
        arrays[f"p{k}_gen_top_vals"] = gen_top_vals
        p["n_tokens"] = len(ids)
        p["greedy_ids"] = gen_ids
        p["greedy_text"] = tok.decode(gen_ids, skip_special_tokens=False)
        p["greedy_min_margin"] = float(margin.min())
        # The cached last-row logits and the no-cache forward must agree closely inside the reference itself.
        p["reference_cache_vs_nocache_last_row_max_abs"] = float(np.abs(gen_logits[0] - logits[-1]).max())
        print(f"p{k} {p['name']:18s} T={len(ids):4d} min margin {margin.min():.4f}  {p['greedy_text'][:60]!r}")

    cases = [{"text": s, "ids": tok.encode(s).ids} for s in TOKENIZER_CASES]
    elapsed = time.perf_counter() - t_start
    gguf_mod_version = None
    try:
        from importlib.metadata import version

        gguf_mod_version = version("gguf")
    except Exception:  # pragma: no cover - metadata missing
        pass
    doc = {
        "description": "Reference values for tests/test_reference_model.py: HF tokenizers (from the GGUF "
        "vocab/merges, digit-split pre-tokenizer) + transformers fp32 on the GGUF. Arrays are in the .npz "
        "next to this file; see scripts/make_reference_fixtures.py for the layout.",
        "provenance": {
            "command": "python scripts/make_reference_fixtures.py --threads " + str(args.threads),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gguf": gguf_mod_version,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "gguf_file": gguf_path.name,
            "gguf_sha256": sha256_of(gguf_path),
            "runtime_s": round(elapsed, 1),
        },
        "vocab_size": vocab_size,
        "n_columns": N_COLUMNS,
        "column_seed": COLUMN_SEED,
        "top_k": TOP_K,
        "n_generate": N_GENERATE,
        "prompts": prompts,
        "tokenizer_cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out.with_suffix(".npz"), **arrays)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    size = out.with_suffix(".npz").stat().st_size + out.with_suffix(".json").stat().st_size
    print(f"wrote {out}.npz/.json ({size / 1e6:.2f} MB) in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
