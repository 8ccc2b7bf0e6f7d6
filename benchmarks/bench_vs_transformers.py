"""Prefill and decode speed of tinyllm vs transformers (torch fp32) on the default model, same thread count.

    python benchmarks/bench_vs_transformers.py [--threads 2] [--runs 5] [--prompt-tokens 128] [--new-tokens 64]

Both engines run the same greedy loop, timed the same way:
- prefill: one forward over the prompt that fills the KV cache (tinyllm `model.prefill`; transformers
  `model(ids, use_cache=True)`), plus the argmax of the last row;
- decode: `--new-tokens` steps, each feeding one token and reading the cache (tinyllm `model.decode_step`;
  transformers `model([[tok]], cache)`), plus the argmax; each step is timed.
Thread pools are capped for the whole process before anything runs: torch.set_num_threads,
threadpoolctl.threadpool_limits (BLAS/OpenMP) and numba.set_num_threads. One warm-up run per engine, then `--runs`
runs alternating between the engines; medians (and min-max) are printed, with the 1-minute load average
(the machine is shared: compare figures only from quiet runs). The prompt is the first tokens of the long
story prompt in the reference fixtures.
Needs the `reference` extra (torch, transformers, gguf, accelerate). `--write` also saves the figures as
benchmarks/vs_transformers.<cpu kind>.json and regenerates RESULTS.md (report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))


def cpu_model() -> str:
    """The CPU's model name from `lscpu` (falls back to platform.processor())."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def prompt_ids(n: int) -> list[int]:
    """The first n token ids of the fixtures' long plain-English prompt (418 tokens)."""
    doc = json.loads((REPO / "tests" / "fixtures" / "smollm2_reference.json").read_text(encoding="utf-8"))
    ids = next(p["ids"] for p in doc["prompts"] if p["name"] == "plain_long_story")
    if n > len(ids):
        raise SystemExit(f"--prompt-tokens must be at most {len(ids)}")
    return ids[:n]


def run_tinyllm(model, ids: list[int], n_new: int) -> tuple[float, list[float], list[int]]:
    """One greedy run: (prefill seconds, per-step decode seconds, generated ids)."""
    cache = model.new_cache(len(ids) + n_new + 1)
    t0 = time.perf_counter()
    row = model.prefill(ids, cache)  # [V]
    tok = int(np.argmax(row))
    prefill_s = time.perf_counter() - t0
    steps, out = [], [tok]
    for _ in range(n_new):
        t0 = time.perf_counter()
        row = model.decode_step(tok, cache)  # [V]
        tok = int(np.argmax(row))
        steps.append(time.perf_counter() - t0)
        out.append(tok)
    return prefill_s, steps, out


def run_transformers(model, ids: list[int], n_new: int) -> tuple[float, list[float], list[int]]:
    """One greedy run with the HF KV cache: (prefill seconds, per-step decode seconds, generated ids)."""
    import reference

    t0 = time.perf_counter()
    logits, cache = reference.reference_forward(model, ids)  # [T, V]
    tok = int(logits[-1].argmax())
    prefill_s = time.perf_counter() - t0
    steps, out = [], [tok]
    for _ in range(n_new):
        t0 = time.perf_counter()
        logits, cache = reference.reference_forward(model, [tok], cache)  # [1, V]
        tok = int(logits[-1].argmax())
        steps.append(time.perf_counter() - t0)
        out.append(tok)
    return prefill_s, steps, out


def summarize(samples: list[tuple[float, list[float], list[int]]], n_prompt: int) -> dict:
    """Medians (and ranges) over timed runs of prefill tok/s, decode tok/s and per-step time."""
    prefill = [n_prompt / p_s for p_s, _, _ in samples]
    decode = [len(steps) / sum(steps) for _, steps, _ in samples]
    itl = [float(np.median(steps)) for _, steps, _ in samples]
    return {"prefill": float(np.median(prefill)), "prefill_range": (min(prefill), max(prefill)),
            "decode": float(np.median(decode)), "decode_range": (min(decode), max(decode)),
            "itl_ms": 1e3 * float(np.median(itl)), "tokens": samples[-1][2]}


def main() -> None:
    from report import no_background_compiles
    no_background_compiles()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the default model, fetched if missing)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = ap.parse_args()

    import numba
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    import reference
    import tinyllm
    from tinyllm import hub

    # One cap for every pool in the process, set before either model runs.
    limiter = threadpool_limits(limits=args.threads)  # noqa: F841  (kept alive until exit)
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))

    path = Path(args.gguf) if args.gguf else hub.ensure_default_model()
    ids = prompt_ids(args.prompt_tokens)

    load_before = os.getloadavg()[0]
    tiny = tinyllm.load(path)
    hf = reference.reference_model(path, threads=args.threads)
    engines = (("tinyllm (fp32, numba)", run_tinyllm, tiny), ("transformers (torch fp32)", run_transformers, hf))
    samples: dict[str, list] = {name: [] for name, _, _ in engines}
    for name, run, model in engines:  # warm-up: first touch of weights, allocators, JIT
        run(model, ids, args.new_tokens)
    # Alternate the engines run by run, so that load from other processes hits both alike.
    for _ in range(args.runs):
        for name, run, model in engines:
            samples[name].append(run(model, ids, args.new_tokens))
    res_tiny, res_hf = (summarize(samples[name], len(ids)) for name, _, _ in engines)

    same = sum(a == b for a, b in zip(res_tiny["tokens"], res_hf["tokens"]))
    out: list[str] = []
    out.append("")
    out.append(f"model      {path.name}, fp32 weights in both engines")
    out.append(f"machine    {cpu_model()}, {args.threads} threads (torch, BLAS/OpenMP, numba)")
    out.append(f"versions   python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}, numba {numba.__version__}")
    out.append(f"load avg   {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-min; above {args.threads} means "
               "other processes shared the cores: expect noisy figures)")
    out.append(f"workload   {len(ids)}-token prompt, {args.new_tokens} greedy decode steps; "
               f"median of {args.runs} runs after 1 warm-up")
    out.append("")
    out.append(f"{'engine':<26}{'prefill tok/s':>15}{'(min-max)':>15}{'decode tok/s':>14}{'(min-max)':>13}"
               f"{'step ms':>9}")
    for name, r in (("tinyllm (fp32, numba)", res_tiny), ("transformers (torch fp32)", res_hf)):
        (p0, p1), (d0, d1) = r["prefill_range"], r["decode_range"]
        out.append(f"{name:<26}{r['prefill']:>15.1f}{f'{p0:.0f}-{p1:.0f}':>15}{r['decode']:>14.1f}"
              f"{f'{d0:.1f}-{d1:.1f}':>13}{r['itl_ms']:>9.2f}")
    out.append(f"{'ratio tinyllm/transformers':<26}{res_tiny['prefill'] / res_hf['prefill']:>15.2f}{'':>15}"
               f"{res_tiny['decode'] / res_hf['decode']:>14.2f}{'':>13}{res_tiny['itl_ms'] / res_hf['itl_ms']:>9.2f}")
    out.append("")
    out.append(f"greedy tokens identical: {same}/{len(res_tiny['tokens'])}")
    print("\n".join(out))
    if args.write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from report import write_json

        cmd = "python benchmarks/bench_vs_transformers.py " + " ".join(sys.argv[1:])
        engines = [dict(engine=name, **{k: r[k] for k in ("prefill", "prefill_range", "decode", "decode_range",
                                                          "itl_ms")})
                   for name, r in (("tinyllm (fp32, numba)", res_tiny), ("transformers (torch fp32)", res_hf))]
        write_json("vs_transformers", dict(
            engines=engines, threads=args.threads, runs=args.runs, prompt_tokens=len(ids), new_tokens=args.new_tokens,
            torch=torch.__version__, transformers=transformers.__version__, same_tokens=same,
            total_tokens=len(res_tiny["tokens"]), load_avg=[load_before, os.getloadavg()[0]]), command=cmd.strip())


if __name__ == "__main__":
    main()
