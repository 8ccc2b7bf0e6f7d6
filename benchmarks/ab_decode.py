"""A/B: decode (or prefill) speed of two checkouts of tinyllm, measured alternately in one run.

    python benchmarks/ab_decode.py --old /path/to/old/checkout [--new .] [--rounds 7] [--contexts 0 256]
    python benchmarks/ab_decode.py --old ... --prefill 128 512 2048 [--steps 3]

Each side runs in its own worker process (its checkout first on sys.path) that loads every format once; the
driver then asks the two workers in turn for the same measurement (old, new, old, new, ...), so both sides see
the same drift of a shared machine, and only one worker runs at a time. A measurement is the median time of a
decode step at a fixed context (the cache is cut back after each step); with --prefill, the median time to
prefill a prompt of that many random tokens into an empty cache (--steps of them, after one to warm up).
Reported: per format and context (or prompt length), the median of the paired ratios new/old of tokens per
second. With --compile, also the first run of a fresh install
(an empty Numba cache) of `scripts/generate.py --max-new-tokens 1` on each side, its `JIT` time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import wait_for_background_compiles  # noqa: E402

FORMATS = ["fp32", "int8", "int8-block", "q4_1", "int8+a8", "int8-block+a8", "q4_1+a8", "native+a8"]

WORKER = r"""
import inspect, json, sys, time
import numpy as np
import tinyllm
# the same weights on both sides: where load() knows head_quant, q4_1 keeps the 4-bit head it always had before
SAME_HEAD = "head_quant" in inspect.signature(tinyllm.load).parameters
tinyllm.set_threads(THREADS)
models, warm = {}, set()
for line in sys.stdin:
    fmt, S, steps, prefill = json.loads(line)
    if fmt not in models:
        quant, _, a8 = fmt.partition("+")
        kw = dict(head_quant="q4_1") if SAME_HEAD and quant == "q4_1" else {}
        models[fmt] = tinyllm.load(quant=None if quant == "fp32" else quant, activations="int8" if a8 else "float32",
                                   **kw)
    m = models[fmt]
    rng = np.random.default_rng(0)
    if prefill:                                             # S: the prompt's length
        prompt = rng.integers(0, 1000, S)
        if (fmt, S) not in warm:                            # the first prefill of a length: touches the weights
            m.prefill(prompt, m.new_cache(S))
            warm.add((fmt, S))
        times = []
        for i in range(steps):
            cache = m.new_cache(S)
            t0 = time.perf_counter()
            m.prefill(prompt, cache)
            times.append(time.perf_counter() - t0)
        print(json.dumps(S / float(np.median(times))), flush=True)
        continue
    cache = m.new_cache(S + 2)
    if S:
        m.prefill(rng.integers(0, 1000, S), cache)
    m.decode_step(5, cache)
    times = []
    for i in range(steps):
        cache.truncate(S)
        t0 = time.perf_counter()
        m.decode_step(100 + i, cache)
        times.append(time.perf_counter() - t0)
    print(json.dumps(1.0 / float(np.median(times))), flush=True)
"""


class Worker:
    def __init__(self, checkout: Path, threads: int):
        # (what a worker's cache lacks: all compiled in its warm-up, none in the background while it is timed)
        env = dict(os.environ, PYTHONPATH=str(checkout), OPENBLAS_THREAD_TIMEOUT="1", TINYLLM_COMPILE_HELPER="0")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER.replace("THREADS", str(threads))], cwd=checkout,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def tok_per_s(self, fmt: str, S: int, steps: int, prefill: bool = False) -> float:
        self.proc.stdin.write(json.dumps([fmt, S, steps, prefill]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {fmt} died (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def first_run_jit(checkout: Path) -> float:
    """JIT seconds of a first run with an empty Numba cache, as the CLI reports them."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(checkout))
        r = subprocess.run([sys.executable, "scripts/generate.py", "--prompt", "Hi", "--max-new-tokens", "1"],
                           cwd=checkout, env=env, capture_output=True, text=True, check=True)
        wait_for_background_compiles()                              # (out of the next measurement's way)
    return float(re.search(r"JIT ([\d.]+) s", r.stderr).group(1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--contexts", nargs="+", type=int, default=[0, 256])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prefill", nargs="+", type=int, help="measure prefill of prompts this long instead of decode")
    p.add_argument("--steps", type=int, default=40, help="decode steps (or prefills) per measurement (their median "
                   "is taken)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time a first run's compile on each side")
    p.add_argument("--json", type=Path, help="write the raw measurements here")
    args = p.parse_args(argv)
    import numpy as np

    sides = {"old": Worker(args.old.resolve(), args.threads), "new": Worker(args.new.resolve(), args.threads)}
    raw = {}
    try:
        for r in range(args.rounds):
            for fmt in args.formats:
                for S in args.prefill or args.contexts:
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    got = {side: sides[side].tok_per_s(fmt, S, args.steps, bool(args.prefill)) for side in order}
                    raw.setdefault(f"{fmt}@{S}", []).append(got)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for w in sides.values():
            w.close()
    print(f"| format | {'prompt tokens' if args.prefill else 'context'} | old tok/s (median) | new tok/s (median) "
          "| median paired ratio new/old | min | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, runs in raw.items():
        fmt, S = key.split("@")
        ratios = [x["new"] / x["old"] for x in runs]
        print(f"| {fmt} | {S} | {np.median([x['old'] for x in runs]):.1f} | {np.median([x['new'] for x in runs]):.1f} "
              f"| {np.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} |")
    if args.compile:
        jit = {side: [] for side in ("old", "new")}
        for _ in range(2):
            for side, path in (("old", args.old), ("new", args.new)):
                jit[side].append(first_run_jit(path.resolve()))
        print(f"\nfirst run, empty Numba cache, fp32: JIT old {jit['old']} s, new {jit['new']} s")
        raw["first_run_jit_s"] = jit
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
