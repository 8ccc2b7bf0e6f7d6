"""TTFT and peak memory of a prefill against prompt length (64 .. 8,192 tokens): chunked prefill with the tiled
attention kernel (model.prefill) against the one-pass path it replaced (BLAS linears and numpy attention over the
whole [heads, T, S] score matrix, still what a pass of more than 128 rows runs).

    python benchmarks/long_prompts.py [--lengths 64 128 ... 8192] [--quant fp32 native] [--one-pass-max 2048]

TTFT here is the prefill alone (random token ids, no tokenization), the median of --repeats runs (one run past
2,048 tokens). Peak extra memory: the rise of the process's peak resident memory during the prefill (Linux:
/proc/self/clear_refs resets the peak), the cache's own pages made resident before it starts. Writes a table
into RESULTS.md ("Long prompts") and long_prompts.png.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS (threads.py)

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import tinyllm  # noqa: E402
from report import machine_info, machine_line, no_background_compiles, write_json  # noqa: E402


_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model, T: int, one_pass: bool, repeats: int) -> dict:
    """Median prefill seconds of T random tokens, and the peak extra memory of the last run (MiB)."""
    rng = np.random.default_rng(T)
    times, extra = [], 0.0
    for _ in range(repeats):
        ids = rng.integers(100, 40_000, T)
        cache = model.new_cache(T)
        cache.k[:], cache.v[:] = 0.0, 0.0                           # the cache's pages resident before, not during
        _LIBC.malloc_trim(0)             # freed memory back to the system: reused pages would hide a rise
        Path("/proc/self/clear_refs").write_text("5")               # the peak resident memory starts again here
        before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        if one_pass:
            model.forward(ids, cache=cache, last_only=True)          # the whole prompt as one pass
        else:
            model.prefill(ids, cache)                                # in chunks of PREFILL_CHUNK tokens
        times.append(time.perf_counter() - t0)
        extra = (_status_kib("VmHWM") - before) / 1024
        del cache
    return dict(ttft_ms=1e3 * float(np.median(times)), peak_extra_mib=extra)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for (quant, way), style in zip(sorted({(r["quant"], r["way"]) for r in rows}), ["o-", "s--", "^-", "v--"]):
        pts = [r for r in rows if (r["quant"], r["way"]) == (quant, way)]
        T = [r["prompt_tokens"] for r in pts]
        ax[0].loglog(T, [r["ttft_ms"] / 1e3 for r in pts], style, label=f"{quant}, {way}")
        ax[1].semilogx(T, [r["peak_extra_mib"] for r in pts], style, label=f"{quant}, {way}")
    ax[0].set(xlabel="prompt tokens", ylabel="TTFT (s)", title="Time to first token")
    ax[1].set(xlabel="prompt tokens", ylabel="MiB", title="Peak extra memory of the prefill")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    no_background_compiles()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--quant", nargs="+", default=["fp32", "native"])
    ap.add_argument("--one-pass-max", type=int, default=2048, help="longest prompt measured the one-pass way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    tinyllm.set_threads(args.threads)
    rows = []
    for quant in args.quant:
        model = tinyllm.load(quant=None if quant == "fp32" else quant,
                             activations="int8" if quant not in ("fp32",) else "float32")
        model.prefill([1, 2, 3], model.new_cache(4))
        for T in args.lengths:
            for way in ("chunked", "one pass"):
                if way == "one pass" and T > args.one_pass_max:
                    continue
                r = measure(model, T, way == "one pass", args.repeats if T <= 2048 else 1)
                rows.append(dict(quant=quant + ("+a8" if quant != "fp32" else ""), way=way, prompt_tokens=T, **r))
                print(f"{rows[-1]['quant']:10s} {way:9s} {T:5d} tokens: TTFT {r['ttft_ms']:9.1f} ms, "
                      f"{T / r['ttft_ms'] * 1e3:6.0f} tok/s, peak extra {r['peak_extra_mib']:7.1f} MiB", flush=True)
        del model
    lines = ["## Long prompts: TTFT and memory against prompt length", "",
             f"Measured {time.strftime('%Y-%m-%d')}, {machine_line(machine_info())}, {args.threads} threads: "
             f"`python benchmarks/long_prompts.py {' '.join(sys.argv[1:] if argv is None else argv)}`. TTFT = the "
             "prefill of random token ids (median of 3 runs up to 2,048 tokens, one run beyond); peak extra = the "
             "rise of peak resident memory during it (the KV cache resident before it starts). `chunked`: model.prefill (chunks of "
             "128 tokens, tiled attention); `one pass`: the whole prompt as one pass (BLAS linears, numpy attention "
             "over the whole score matrix).", "",
             "| weights | prefill | prompt tokens | TTFT ms | tok/s | peak extra MiB |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['quant']} | {r['way']} | {r['prompt_tokens']:,} | {r['ttft_ms']:,.0f} | "
              f"{r['prompt_tokens'] / r['ttft_ms'] * 1e3:,.0f} | {r['peak_extra_mib']:,.1f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        plot(rows, HERE / "long_prompts.png")
        write_json("long_prompts", dict(rows=rows, threads=args.threads), command=" ".join(
            ["python benchmarks/long_prompts.py"] + (sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
