"""How long `scripts/generate.py --prompt Hi --max-new-tokens 1` takes as a whole process, and its peak memory.

    python benchmarks/startup.py [--quant native fp32] [--runs 5] [--first-run] [--no-write]

Warm: the Numba cache already filled (run once first); the median of --runs whole processes, alternating the
formats, wall time from start to exit and the peak resident memory (the process's ru_maxrss), with Python's
bytecode cache on (PYTHONDONTWRITEBYTECODE is removed from the runs' environment). Two warm cases: the
converted model mapped from tinyllm's cache (tinyllm/converted.py; a folder of this run, filled by the first run),
and converting the GGUF file on every load (TINYLLM_CONVERTED=off). --first-run also measures a fresh install's
first run: an empty Numba cache directory (NUMBA_CACHE_DIR) and an empty converted-model cache, so every kernel
the format needs is compiled, as the stderr line "kernels compiled in X s" reports. The floor: the same
measurements of a process that only imports numpy and Numba and calls one cached parallel Numba function (FLOOR
below), what any program with Numba's compiled kernels pays before its own work. Saves
benchmarks/startup.<cpu kind>.json and regenerates RESULTS.md (report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report import machine_info, machine_line, wait_for_background_compiles, write_json  # noqa: E402

COMMAND = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--prompt", "Hi", "--max-new-tokens", "1",
           "--json"]


FLOOR = '''
import numpy as np
from numba import njit, prange

@njit(cache=True, parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s

total(np.ones(10))
'''


def floor_once(scratch: str) -> tuple:
    """One process of FLOOR (its own Numba cache in scratch) -> (wall seconds, peak MiB)."""
    script = Path(scratch) / "numba_floor.py"
    if not script.exists():
        script.write_text(FLOOR)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(scratch) / "numba-floor-cache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    _, status, rusage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"startup.py: the floor's process failed (status {status})")
    return time.perf_counter() - t0, rusage.ru_maxrss / 1024


def run_once(quant: str, env: dict) -> dict:
    """One whole process -> wall seconds, peak RSS (MiB), and what it printed on stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(COMMAND + ["--quant", quant], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"startup.py: {quant} run failed: {err.strip().splitlines()[-1:]}")
    return dict(wall_s=wall, stderr=err, stdout=out)


def peak_rss_mib(quant: str, env: dict) -> float:
    """Peak resident memory of one run, from the kernel's accounting of the child (wait4)."""
    proc = subprocess.Popen(COMMAND + ["--quant", quant], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, rusage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"startup.py: {quant} run failed (status {status})")
    return rusage.ru_maxrss / 1024                                  # Linux reports KiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", nargs="+", default=["native", "fp32"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--first-run", action="store_true", help="also a fresh install's first run (empty cache)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="tinyllm-startup-")
    env = dict(os.environ, TINYLLM_CONVERTED=scratch)               # converted models: this run's own folder
    env.pop("PYTHONDONTWRITEBYTECODE", None)    # as Python runs by default: modules compiled once, then cached
    cases = {"mapped": env, "converting": dict(env, TINYLLM_CONVERTED="off")}
    for quant in args.quant:                                        # fill both caches, and the page cache
        run_once(quant, env)
        wait_for_background_compiles()
    floor_once(scratch)                                             # fills the floor's cache
    walls, floor = {(q, case): [] for q in args.quant for case in cases}, []
    for _ in range(args.runs):
        for quant in args.quant:
            for case, case_env in cases.items():
                walls[quant, case].append(run_once(quant, case_env)["wall_s"])
        floor.append(floor_once(scratch))
    rows = []
    for quant in args.quant:
        info = run_once(quant, env)
        summary = json.loads(info["stdout"].strip().splitlines()[-1]) if info["stdout"].strip() else {}
        row = dict(quant=quant, load_s=summary.get("load_s"), jit_s=summary.get("jit_s"))
        for case, case_env in cases.items():
            runs = sorted(walls[quant, case])
            row[case] = dict(wall_s=runs[len(runs) // 2], runs=runs, peak_mib=peak_rss_mib(quant, case_env))
        if args.first_run:
            with tempfile.TemporaryDirectory() as numba_dir, tempfile.TemporaryDirectory() as converted_dir:
                first = run_once(quant, dict(env, NUMBA_CACHE_DIR=numba_dir, TINYLLM_CONVERTED=converted_dir))
                wait_for_background_compiles()                      # (its fused blocks: out of the next run's way)
            found = re.search(r"kernels compiled in ([\d.]+) s", first["stderr"])
            row.update(first_run_s=first["wall_s"], compile_s=float(found.group(1)) if found else None,
                       notice="compiling" in first["stderr"])
        rows.append(row)
        print(row, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    floor_walls = sorted(wall for wall, _ in floor)
    lines = ["## Startup: one token from a cold process", "",
             f"Measured {time.strftime('%Y-%m-%d')}, {machine_line(machine_info())}: `python benchmarks/startup.py "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}`. Each run is a whole process of "
             "`scripts/generate.py --prompt Hi --max-new-tokens 1 --quant Q` (chat template: 31 prompt tokens); "
             f"warm = Numba's cache filled, the median of {args.runs} runs (formats and cases alternating); "
             "mapped = the converted model mapped from tinyllm's cache (filled by a first run), converting = "
             "`TINYLLM_CONVERTED=off`, the GGUF file converted on every load; peak = the process's peak resident "
             "memory (the mapped weights' pages and the shared libraries' count in it).", "",
             "| weights | warm, mapped: exit after | runs (s) | peak MiB | warm, converting: exit after | runs (s) "
             "| peak MiB |" + (" first run: exit after | compiling |" if args.first_run else ""),
             "|---|---:|---|---:|---:|---|---:|" + ("---:|---:|" if args.first_run else "")]
    for r in rows:
        line = f"| {r['quant']} |"
        for case in cases:
            line += (f" {r[case]['wall_s']:.2f} s | {', '.join(f'{w:.2f}' for w in r[case]['runs'])} | "
                     f"{r[case]['peak_mib']:.0f} |")
        if args.first_run:
            line += f" {r['first_run_s']:.1f} s | {r['compile_s']} s |"
        lines.append(line)
    lines += ["", f"The floor (numpy and Numba imported, one cached parallel Numba function called, in a process of "
              f"its own, taking turns with the runs above): exit after {floor_walls[len(floor_walls) // 2]:.2f} s "
              f"({', '.join(f'{w:.2f}' for w in floor_walls)}), peak {max(peak for _, peak in floor):.0f} MiB."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_json("startup", dict(rows=rows, runs=args.runs, floor=dict(
            wall_s=floor_walls[len(floor_walls) // 2], runs=floor_walls, peak_mib=max(peak for _, peak in floor))),
            command=f"python benchmarks/startup.py {' '.join(sys.argv[1:] if argv is None else argv)}".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
