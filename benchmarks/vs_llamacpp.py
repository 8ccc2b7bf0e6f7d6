"""tinyllm against llama.cpp on the same work, measured alternately in one run (a benchmark, not a test).

    python benchmarks/vs_llamacpp.py --llama-bench PATH [--llama-batched-bench PATH] [--rounds 3] [--write]

For users who have llama.cpp built (README, "Side by side with llama.cpp"). The default model's file is
re-quantized with llama-quantize (found next to llama-bench unless --llama-quantize says where) to F32, Q8_0 and
Q4_K_M; the file's own Q4_1 is used as it is. Each llama.cpp format is compared with the tinyllm setting that
computes the same thing:

    F32     fp32 weights                      tinyllm quant=None
    Q8_0    8-bit blocks, int8 activations    tinyllm int8-block + int8 activations (and int8 per row + int8)
    Q4_1    the file's 4-bit blocks           tinyllm native + int8 activations
    Q4_K_M  the same file (Q4_K, Q6_K, Q5_0,  tinyllm native + int8 activations on that file
            Q8_0 tensors)

The work (llama-bench's names): tg64 (64 decode steps from an empty cache), pp128 / pp512 / pp2048 (a prompt of
random tokens), tg64@d2048 (64 decode steps after 2,048 cached tokens); with --llama-batched-bench, batched decode
of 1 / 8 / 32 sequences of 128 prompt tokens, 64 steps each (llama-batched-bench's S_TG). Both sides use the same
thread count (--threads, default 2) and alternate round by round; reported: the median tokens/s of each side and
their ratio. Before each timed test tinyllm runs one untimed pass or step of it, as llama-bench does (a first call
may compile). llama.cpp keeps its default float16 KV cache; tinyllm uses float32 unless --kv-dtype says otherwise.
--write saves the figures as benchmarks/vs_llamacpp.<cpu kind>.json and regenerates RESULTS.md (report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS (threads.py)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tinyllm  # noqa: E402
from tinyllm import hub  # noqa: E402
from tinyllm.paged import PagedKVCache  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import machine_info, machine_line, no_background_compiles, write_json  # noqa: E402

# llama.cpp file type -> the tinyllm settings compared with it: (label, quant, activations)
PAIRS = {"F32": [("fp32", None, "float32")],
         "Q8_0": [("int8-block+a8", "int8-block", "int8"), ("int8+a8", "int8", "int8")],
         "Q4_1": [("native+a8", "native", "int8")], "Q4_K_M": [("native+a8", "native", "int8")]}
ON_THE_FILE = ("Q4_1", "Q4_K_M")   # tinyllm loads the llama.cpp file itself (else the default file, quantized)
PROMPTS, GEN, DEPTH, BATCHES = (128, 512, 2048), 64, 2048, (1, 8, 32)


# --- llama.cpp's side ------------------------------------------------------------------------------------------
def requantize(quantize: Path, source: Path, kind: str, out_dir: Path) -> Path:
    """The default file re-quantized to `kind` (F32, Q8_0, Q4_K_M) by llama-quantize, kept between runs."""
    out = out_dir / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if not out.exists():
        subprocess.run([str(quantize), "--allow-requantize", str(source), str(out), kind], check=True,
                       capture_output=True)
    return out


def llama_bench(bench: Path, model: Path, threads: int) -> dict:
    """One llama-bench run of every test -> {test name: tokens/s}."""
    runs = [["-p", ",".join(map(str, PROMPTS)), "-n", str(GEN)], ["-p", "0", "-n", str(GEN), "-d", str(DEPTH)]]
    out = {}
    for extra in runs:
        r = subprocess.run([str(bench), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json", *extra],
                           check=True, capture_output=True, text=True)
        for test in json.loads(r.stdout):
            name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
            out[name + (f"@d{test['n_depth']}" if test.get("n_depth") else "")] = float(test["avg_ts"])
    return out


def llama_batched(batched: Path, model: Path, threads: int) -> dict:
    """llama-batched-bench's decode speed (S_TG, all sequences together) -> {"batch B": tokens/s}."""
    ctx = max(BATCHES) * (PROMPTS[0] + GEN)
    r = subprocess.run([str(batched), "-m", str(model), "-t", str(threads), "-c", str(ctx), "-b", "2048",
                        "-ub", "512", "-npp", str(PROMPTS[0]), "-ntg", str(GEN),
                        "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl"],
                       check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {f"batch {row['pl']}": float(row["speed_tg"]) for row in rows}


# --- tinyllm's side --------------------------------------------------------------------------------------------
def tinyllm_tests(model, batched: bool, kv_dtype: str) -> dict:
    """The same tests on a loaded model, its KV cache in kv_dtype -> {test name: tokens/s}."""
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(100, 40000, n)]   # noqa: E731
    out = {}
    for n in PROMPTS:
        model.prefill(ids(n), model.new_cache(n, kv_dtype))     # a warm-up pass, as llama-bench runs one per test
        cache = model.new_cache(n, kv_dtype)
        t0 = time.perf_counter()
        model.prefill(ids(n), cache)
        out[f"pp{n}"] = n / (time.perf_counter() - t0)
    for depth in (0, DEPTH):
        cache = model.new_cache(depth + GEN + 2, kv_dtype)
        model.prefill(ids(depth + 1), cache)
        model.decode_step(ids(1)[0], cache)                     # a warm-up step, as llama-bench runs one
        tokens = ids(GEN)
        t0 = time.perf_counter()
        for t in tokens:
            model.decode_step(t, cache)
        out[f"tg{GEN}" + (f"@d{depth}" if depth else "")] = GEN / (time.perf_counter() - t0)
    if batched:
        for B in BATCHES:
            pool = PagedKVCache(model.config, block_size=16, num_blocks=B * -(-(PROMPTS[0] + GEN + 2) // 16),
                                kv_dtype=kv_dtype)
            seqs = [pool.new_sequence() for _ in range(B)]
            model.forward_batch([ids(PROMPTS[0]) for _ in seqs], seqs, last_only=True)
            model.decode_batch(ids(B), seqs)                    # a warm-up step (a first call compiles)
            steps = [ids(B) for _ in range(GEN)]
            t0 = time.perf_counter()
            for tokens in steps:
                model.decode_batch(tokens, seqs)
            out[f"batch {B}"] = B * GEN / (time.perf_counter() - t0)
    return out


# --- the run ---------------------------------------------------------------------------------------------------
def markdown(results: dict, meta: dict) -> str:
    lines = ["## Side by side with llama.cpp", "", f"Measured {meta['date']} on {meta['machine']}, {meta['threads']} threads each, "
             f"{meta['rounds']} alternating rounds: `{meta['command']}`. Median tokens/s of each side, and "
             "tinyllm / llama.cpp. llama.cpp: float16 KV cache; tinyllm: " + meta["kv"] + " KV cache.", "",
             "| llama.cpp file | tinyllm setting | test | llama.cpp tok/s | tinyllm tok/s | ratio |",
             "|---|---|---|---:|---:|---:|"]
    for kind, settings in results.items():
        for label, tests in settings.items():
            for test, (theirs, ours) in tests.items():
                lines.append(f"| {kind} | {label} | {test} | {theirs:,.0f} | {ours:,.0f} | {ours / theirs:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    no_background_compiles()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", type=Path, help="path of a built llama-bench")
    ap.add_argument("--llama-batched-bench", type=Path, help="path of a built llama-batched-bench (batched decode)")
    ap.add_argument("--llama-quantize", type=Path, help="path of llama-quantize (default: next to llama-bench)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "int8"],
                    help="tinyllm's KV cache format (llama.cpp's is float16)")
    ap.add_argument("--write", action="store_true", help="put the table into RESULTS.md and vs_llamacpp.json")
    args = ap.parse_args(argv)
    if args.llama_bench is None:
        print("vs_llamacpp.py: pass --llama-bench PATH (a built llama.cpp; README, 'Side by side with llama.cpp')",
              file=sys.stderr)
        return 2
    quantize = args.llama_quantize or args.llama_bench.with_name("llama-quantize")
    for tool in [args.llama_bench, quantize] + ([args.llama_batched_bench] if args.llama_batched_bench else []):
        if not (tool.is_file() and os.access(tool, os.X_OK)):
            print(f"vs_llamacpp.py: {tool} is not an executable file", file=sys.stderr)
            return 2
    tinyllm.set_threads(args.threads)
    source = Path(hub.ensure_default_model())
    work = Path(tempfile.gettempdir()) / "tinyllm-vs-llamacpp"
    work.mkdir(exist_ok=True)
    results = {}
    for kind in args.formats:
        gguf = source if kind == "Q4_1" else requantize(quantize, source, kind, work)
        models = {label: tinyllm.load(gguf if kind in ON_THE_FILE else None, quant=quant, activations=act)
                  for label, quant, act in PAIRS[kind]}
        theirs, ours = [], {label: [] for label in models}
        for r in range(args.rounds):
            run = llama_bench(args.llama_bench, gguf, args.threads)
            if args.llama_batched_bench:
                run.update(llama_batched(args.llama_batched_bench, gguf, args.threads))
            theirs.append(run)
            for label, m in models.items():
                ours[label].append(tinyllm_tests(m, args.llama_batched_bench is not None, args.kv_dtype))
            print(f"{kind} round {r + 1}: llama.cpp {run}; tinyllm {[o[-1] for o in ours.values()]}", flush=True)
        results[kind] = {label: {test: (float(np.median([t[test] for t in theirs])),
                                        float(np.median([o[test] for o in runs]))) for test in theirs[0]}
                         for label, runs in ours.items()}
        del models
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=machine_line(machine_info()), threads=args.threads, rounds=args.rounds, kv=args.kv_dtype,
                command="python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:] if argv is None else argv))
    table = markdown(results, meta)
    print(table)
    if args.write:
        write_json("vs_llamacpp", dict(meta=meta, results=results), command=meta["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
