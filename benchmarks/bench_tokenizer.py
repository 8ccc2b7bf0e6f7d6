"""Encoding speed: tinyllm's pure-Python BPE against HF `tokenizers` (Rust), one thread, same texts, same run.

    python benchmarks/bench_tokenizer.py [--mb 4] [--repeats 3] [--model PATH | --vocab NAME]

--vocab NAME takes a vocab of llama.cpp's tokenizer suite (falcon, deepseek-llm, command-r, ...; fetch it first
with scripts/fetch_tokenizer_suite.py) and compares with HF tokenizers built for it by scripts/reference.py.

Texts (built offline, deterministic): "docs+code" is Python's own documentation (pydoc_data) followed by standard
library sources; "multilingual" samples words from sentences in ten scripts, with emoji and random numbers.
Each is encoded three ways:
  big string   the whole text in one encode() call;
  2 KB docs    the text cut into 2,000-character documents, one encode() call each (prompt-sized inputs).
Cold means an empty word cache (tinyllm's, and HF's BPE cache); warm means encoding the same text again.
Speeds are MB/s of UTF-8 input (1 MB = 10^6 bytes), best of --repeats. ratio = tinyllm / tokenizers.
Both must produce the same ids: the script checks that before it reports anything. On the default model the
figures are saved as benchmarks/tokenizer.<cpu kind>.json and RESULTS.md regenerated (report.py; --no-write: not).
"""
from __future__ import annotations

import os

# One thread for the Rust side (rayon only parallelises batches, but make it explicit), before the import.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from tinyllm.gguf import GGUFFile  # noqa: E402
from tinyllm.tokenizer import Tokenizer  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog, and I'll say it wasn't me; DON'T blame the dog!",
    "def encode(self, text: str) -> list[int]:\n    return [self.vocab[w] for w in text.split()]  # 42\n",
    '{"model": "SmolLM2-135M", "layers": 30, "dims": [576, 1536], "rope_theta": 100000.0}',
    "Привет, мир! Как дела? Сегодня 25 градусов.",
    "Γειά σου Κόσμε· η θερμοκρασία είναι 18 βαθμοί.",
    "你好，世界！今天是2024年5月1日。日本語のテキストです。한국어 텍스트도 있습니다.",
    "مرحبا بالعالم، كيف حالك؟ الرقم ٤٢",
    "नमस्ते दुनिया, आप कैसे हैं? संख्या ४२",
    "café naïve résumé Ångström Zürich São Paulo\tcrème brûlée",
    "emoji: 😀 👩🏽‍💻 👨‍👩‍👧‍👦 🇫🇷 🎉 — x² + y³ ≈ ½ ∑ᵢ aᵢ",
]


def docs_and_code(n_bytes: int) -> str:
    """English documentation prose, then Python standard library sources, cut at about n_bytes of UTF-8."""
    import pydoc_data.topics

    parts = ["".join(pydoc_data.topics.topics.values())]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if sum(map(len, parts)) >= n_bytes:
            break
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "".join(parts).encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def multilingual(n_bytes: int, seed: int = 0) -> str:
    """Words drawn at random from SENTENCES (keeping each word's script), with random numbers mixed in."""
    rng = random.Random(seed)
    words = [w for s in SENTENCES for w in s.split(" ")]
    out, size = [], 0
    while size < n_bytes:
        piece = rng.choice(words) if rng.random() < 0.9 else str(rng.randrange(10 ** rng.randrange(1, 8)))
        piece += rng.choice([" ", " ", " ", " ", "\n", ", ", ". ", "  "])
        out.append(piece)
        size += len(piece.encode("utf-8"))
    return "".join(out)


def best_time(fn, repeats: int, setup=lambda: None) -> float:
    """Seconds of the fastest of `repeats` calls of fn(), each after setup() (not timed)."""
    best = float("inf")
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="size of each text in MB (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    which.add_argument("--vocab", default=None, help="a vocab of llama.cpp's tokenizer suite, e.g. falcon")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    import tokenizers

    import fetch_tokenizer_suite
    import reference
    from tinyllm import hub

    if args.vocab:
        model = fetch_tokenizer_suite.vocab_path(args.vocab)
        if not model.exists():
            raise SystemExit(f"{model} does not exist: run python scripts/fetch_tokenizer_suite.py, and pick --vocab "
                             f"from gpt-2, llama-bpe, qwen2, qwen35, refact, starcoder, command-r, deepseek-coder, "
                             f"deepseek-llm, falcon, mpt")
    else:
        model = Path(args.model) if args.model else hub.ensure_default_model()
    try:
        ours = Tokenizer.from_gguf_metadata(GGUFFile(model).metadata)
    except ValueError as e:
        raise SystemExit(f"{model.name}: {e}") from None
    theirs = reference.suite_reference_tokenizer(model) if args.vocab else reference.reference_tokenizer(model)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}; "
          f"tokenizers {tokenizers.__version__}; RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}, "
          f"TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")
    print(f"model: {model.name}; best of {args.repeats}; MB/s of UTF-8 input; ratio = tinyllm / tokenizers\n")

    def clear_caches():
        ours.clear_cache()
        theirs.model._clear_cache()   # HF's BPE word cache (a private method, present in tokenizers >= 0.13)

    n_bytes = int(args.mb * 1e6)
    header = f"{'text':<14}{'calls':<13}{'MB':>6} | {'tinyllm cold':>12} {'warm':>7} | " \
             f"{'tokenizers cold':>15} {'warm':>7} | {'ratio cold':>10} {'warm':>6}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, text in [("docs+code", docs_and_code(n_bytes)), ("multilingual", multilingual(n_bytes))]:
        mb = len(text.encode("utf-8")) / 1e6
        docs = [text[i:i + 2000] for i in range(0, len(text), 2000)]
        calls = {
            "big string": (lambda: ours.encode(text), lambda: theirs.encode(text, add_special_tokens=False)),
            "2 KB docs": (lambda: [ours.encode(d) for d in docs],
                          lambda: [theirs.encode(d, add_special_tokens=False) for d in docs]),
        }
        clear_caches()
        if ours.encode(text) != theirs.encode(text, add_special_tokens=False).ids:
            raise SystemExit(f"{name}: tinyllm and tokenizers disagree on the ids; fix that before timing")
        for how, (run_ours, run_theirs) in calls.items():
            speeds = [mb / best_time(run_ours, args.repeats, clear_caches),
                      mb / best_time(run_ours, args.repeats),                     # warm: caches kept
                      mb / best_time(run_theirs, args.repeats, clear_caches),
                      mb / best_time(run_theirs, args.repeats)]
            print(f"{name:<14}{how:<13}{mb:>6.2f} | {speeds[0]:>12.2f} {speeds[1]:>7.2f} | {speeds[2]:>15.2f} "
                  f"{speeds[3]:>7.2f} | {speeds[0] / speeds[2]:>10.2f} {speeds[1] / speeds[3]:>6.2f}")
            rows.append(dict(text=name, calls=how, mb=mb, tinyllm_cold=speeds[0], tinyllm_warm=speeds[1],
                             tokenizers_cold=speeds[2], tokenizers_warm=speeds[3]))
    if not (args.no_write or args.vocab or args.model):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from report import write_json
        write_json("tokenizer", dict(rows=rows, repeats=args.repeats, vocab=model.name,
                                     tokenizers=tokenizers.__version__),
                   command=" ".join(["python benchmarks/bench_tokenizer.py"] + sys.argv[1:]))


if __name__ == "__main__":
    main()
