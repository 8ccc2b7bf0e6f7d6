#!/usr/bin/env python
"""Decode on a busy machine: tok/s quiet and beside 1 and 3 competing busy processes, measured alternately.

    python benchmarks/contention.py [--formats fp32 native+a8] [--competitors 1 3] [--rounds 5] [--seconds 3]
                                    [--threads 2] [--old /path/to/other/checkout] [--llama-bench PATH] [--write]

A competitor is a process with two busy threads (two shell loops that never sleep), as a build or another model
would be. Each round measures every format quiet and beside each number of competitors, in turn, so drift hits
all of them alike; a measurement is the decode steps done in `--seconds` (and at least 16 steps, a short answer) at
context 64 (the cache cut back after each step), over the time they took: stalled steps count, as a user waits for them. Reported: median tok/s per format and condition, and each condition's median
ratio to quiet in the same round. With --old, the same measurements also run in a worker on another checkout
(alternating with this one), for an A/B of what a change does under load. With --llama-bench, llama.cpp's decode
of the same model runs in each condition too (llama-bench's tg of LLAMA_TOKENS tokens, its own tok/s: F32 for fp32,
the Q4_1 file for native+a8), and its ratio to its own quiet run stands beside tinyllm's.
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

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = r"""
import json, sys, time
import numpy as np
import tinyllm
tinyllm.set_threads(THREADS)
models = {}
for line in sys.stdin:
    fmt, seconds = json.loads(line)
    if fmt not in models:
        quant, _, a8 = fmt.partition("+")
        models[fmt] = tinyllm.load(quant=None if quant == "fp32" else quant,
                                   activations="int8" if a8 else "float32")
        m = models[fmt]
        c = m.new_cache(80)
        m.prefill(np.arange(64), c)
        m.decode_step(1, c)
    m = models[fmt]
    cache = m.new_cache(80)
    m.prefill(np.arange(64), cache)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() < t0 + seconds or steps < 16:     # a short answer's worth of steps, at least
        m.decode_step(1, cache)
        cache.length = 64
        steps += 1
    print(json.dumps(steps / (time.perf_counter() - t0)), flush=True)
"""


class Side:
    """A worker process decoding with one checkout of tinyllm."""

    def __init__(self, checkout: Path, threads: int):
        code = f"import sys; sys.path.insert(0, {str(checkout)!r})\n" + WORKER.replace("THREADS", str(threads))
        env = dict(os.environ, OPENBLAS_THREAD_TIMEOUT="1")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=checkout, env=env)

    def tok_per_s(self, fmt: str, seconds: float) -> float:
        self.proc.stdin.write(json.dumps([fmt, seconds]) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


LLAMA_FILES = {"fp32": "F32", "native+a8": "Q4_1"}   # tinyllm's format -> the llama.cpp file it is compared with
LLAMA_TOKENS = 64


class LlamaSide:
    """llama-bench decoding LLAMA_TOKENS tokens of the default model's file of each format's kind."""

    def __init__(self, bench: Path, threads: int):
        from vs_llamacpp import requantize                    # (imports tinyllm: the default file, its F32 twin)
        from tinyllm import hub
        source = Path(hub.ensure_default_model())
        work = Path(tempfile.gettempdir()) / "tinyllm-vs-llamacpp"
        work.mkdir(exist_ok=True)
        quantize = bench.with_name("llama-quantize")
        self.files = {fmt: source if kind == "Q4_1" else requantize(quantize, source, kind, work)
                      for fmt, kind in LLAMA_FILES.items()}
        self.bench, self.threads = bench, threads

    def tok_per_s(self, fmt: str, seconds: float) -> float:
        r = subprocess.run([str(self.bench), "-m", str(self.files[fmt]), "-t", str(self.threads), "-p", "0", "-n",
                            str(LLAMA_TOKENS), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
        return float(json.loads(r.stdout)[0]["avg_ts"])


def start_competitors(n: int) -> list[subprocess.Popen]:
    """n processes of two busy threads each (shell loops: no syscalls, no memory traffic)."""
    return [subprocess.Popen(["sh", "-c", "(while :; do :; done) & while :; do :; done"], start_new_session=True)
            for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        os.killpg(p.pid, 9)
        p.wait()


def main() -> None:
    from report import no_background_compiles
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["fp32", "native+a8"])
    p.add_argument("--competitors", nargs="+", type=int, default=[1, 3])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--old", type=Path, help="another checkout to measure alternately (A/B)")
    p.add_argument("--llama-bench", type=Path, help="a built llama-bench: llama.cpp's decode in each condition too")
    p.add_argument("--write", action="store_true", help="write benchmarks/contention.<cpu kind>.json")
    args = p.parse_args()
    sides = {"new": Side(HERE.parent, args.threads)}
    if args.old:
        sides["old"] = Side(args.old.resolve(), args.threads)
    if args.llama_bench:
        if not [f for f in args.formats if f in LLAMA_FILES]:
            p.error(f"--llama-bench compares only {', '.join(LLAMA_FILES)}")
        sys.path.insert(0, str(HERE))
        sides["llama.cpp"] = LlamaSide(args.llama_bench, args.threads)
    conditions = [0] + args.competitors
    got = {(side, fmt, n): [] for side in sides for fmt in args.formats for n in conditions}
    for r in range(args.rounds):
        for n in conditions:
            procs = start_competitors(n)
            time.sleep(0.3)                                   # let the scheduler settle them in
            try:
                for fmt in args.formats:
                    for side in (sides if r % 2 == 0 else reversed(list(sides))):
                        if side != "llama.cpp" or fmt in LLAMA_FILES:
                            got[side, fmt, n].append(sides[side].tok_per_s(fmt, args.seconds))
            finally:
                stop(procs)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    print("| checkout | format | competitors | tok/s (median) | of quiet (median of the rounds' ratios) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for side in sides:
        for fmt in args.formats:
            if not got[side, fmt, 0]:
                continue
            quiet = np.array(got[side, fmt, 0])
            for n in conditions:
                tps = np.array(got[side, fmt, n])
                ratio = float(np.median(tps / quiet))
                rows.append(dict(checkout=side, format=fmt, competitors=n, tok_s=float(np.median(tps)),
                                 of_quiet=ratio, runs=tps.tolist()))
                print(f"| {side} | {fmt} | {n} | {np.median(tps):.1f} | {ratio:.2f} |")
    if args.write:
        sys.path.insert(0, str(HERE))
        from report import write_json
        write_json("contention", dict(threads=args.threads, seconds=args.seconds, rounds=args.rounds,
                                      results=[r for r in rows if r["checkout"] == "new"],
                                      before=[r for r in rows if r["checkout"] == "old"],
                                      llama=[r for r in rows if r["checkout"] == "llama.cpp"]),
                   command="python benchmarks/contention.py " + " ".join(sys.argv[1:]))
    for side in sides.values():
        if isinstance(side, Side):
            side.proc.stdin.close()
            side.proc.wait()


if __name__ == "__main__":
    main()
