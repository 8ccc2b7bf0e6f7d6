#!/usr/bin/env python
"""The roofline report: is decode bound by the bytes it reads? Measured, in one run, on this machine.

    python benchmarks/roofline.py                 # full report (a few minutes), writes RESULTS.md section + PNGs
    python benchmarks/roofline.py --quick         # fewer points, for a smoke test

1. Measures the machine: streaming read bandwidth (a Numba kernel summing the rows of a 1 GiB array) and
   the sgemm peak (numpy's BLAS on 2048^3 and on prefill-shaped matrices).
2. For each weight format (fp32, int8, int8-block, q4_1): bytes read per decode token (weights + the KV cache
   at the current length), decode tok/s at batch 1, achieved GB/s and its share of the measured bandwidth;
   prefill tok/s and achieved GFLOP/s against the sgemm peak.
3. Sweeps: context length (the KV share of the bytes grows), threads 1 and 2, batch size 1..64 (one weight
   read serves the whole batch: tok/s per user vs in total).
Formats are measured in interleaved rounds and reported as medians, because a shared machine drifts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tinyllm  # noqa: E402
import numpy as np  # noqa: E402

from report import machine_info, machine_line, no_background_compiles, render, write_json  # noqa: E402
from tinyllm import capacity  # noqa: E402
# the roofs are measured by tinyllm/roofs.py (also for the lab); other benchmarks import them from here
from tinyllm.roofs import median_time, read_bandwidth, row_sums, sgemm_gflops  # noqa: E402,F401

HERE = Path(__file__).resolve().parent
FORMATS = ["fp32", "int8", "int8-block", "q4_1", "int8+a8", "q4_1+a8"]   # +a8: int8 activations too (quant.py)
BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"


# --- the bytes and FLOPs of a pass ---------------------------------------------------------------------------
def decode_bytes(model, S: int, batch: int = 1) -> int:
    """Bytes one decode step reads at context S: every weight once, each sequence's S + 1 cached K/V."""
    return capacity.decode_step_bytes(weight_bytes=model.weight_bytes, batch=batch, context=S + 1,
                                      kv_bytes_per_token=model.config.kv_bytes_per_token())


def decode_flops(model, S: int, batch: int = 1) -> float:
    return batch * capacity.forward_flops(model.config, tokens=1, past=S)


def prefill_flops(model, T: int) -> float:
    return capacity.forward_flops(model.config, tokens=T)


# --- measurements --------------------------------------------------------------------------------------------
def filled_cache(model, S: int, rng, extra: int = 4):
    """A cache holding S positions of random K/V: decode time depends on S, not on what the values are."""
    cache = model.new_cache(S + extra)
    if S:
        cache.k[:, :S] = rng.standard_normal(cache.k[:, :S].shape, dtype=np.float32) * 0.5
        cache.v[:, :S] = rng.standard_normal(cache.v[:, :S].shape, dtype=np.float32) * 0.5
    cache.length = S
    return cache


def paged_caches(model, S: int, batch: int, rng, extra: int = 4) -> list:
    """batch sequences of S positions of random K/V in one paged pool: the engine's batched decode path (one
    PagedAttention call per layer for the whole batch)."""
    from tinyllm.paged import PagedKVCache
    per_seq = -(-(S + extra) // 16)
    pool = PagedKVCache(model.config, block_size=16, num_blocks=batch * per_seq)
    pool.k[:] = rng.standard_normal(pool.k.shape[1:], dtype=np.float32) * 0.5      # one layer's worth, every layer
    pool.v[:] = pool.k
    seqs = [pool.new_sequence() for _ in range(batch)]
    for seq in seqs:
        seq.check_room(S)
        seq.length = S
    return seqs


def decode_step_time(model, S: int, steps: int, rng, batch: int = 1) -> float:
    """Median seconds per decode step at context S (the cache is truncated back to S after every step).
    Batch 1 runs on the contiguous cache, larger batches on a paged pool as the engine runs them."""
    caches = [filled_cache(model, S, rng)] if batch == 1 else paged_caches(model, S, batch, rng)
    tokens = rng.integers(100, 1000, size=batch)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        if batch == 1:
            model.decode_step(int(tokens[0]), caches[0])
        else:
            model.decode_batch(tokens, caches)
        if i >= 2:                                                  # two warm-up steps
            times.append(time.perf_counter() - t0)
        for c in caches:
            c.truncate(S)
    return float(np.median(times))


def step_breakdown(model, S: int, steps: int, rng) -> dict:
    """Where a batch-1 decode step's time goes: ms per step inside each function of the model's ops (linear,
    attention, ...), and "outside" = the rest: Python, numpy glue between the calls, the cache update. Each op
    call is timed by a thin wrapper, which adds about a microsecond per call to "outside"."""
    real_ops, inside = model.compute.ops_for(1), {}

    class Timed:                                                    # a decode step's ops, with a stopwatch each
        def __getattr__(self, name):
            f = getattr(real_ops, name)
            if not callable(f):
                return f

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                out = f(*args, **kwargs)
                inside[name] = inside.get(name, 0.0) + time.perf_counter() - t0
                return out
            return timed

    cache = filled_cache(model, S, rng)
    model.decode_step(1, cache)
    cache.truncate(S)
    model.compute.ops_for, model.fused_decode = lambda n_rows: Timed(), False   # op by op, each op timed
    try:
        t0 = time.perf_counter()
        for i in range(steps):
            model.decode_step(100 + i, cache)
            cache.truncate(S)
        total = (time.perf_counter() - t0) / steps
    finally:
        del model.compute.ops_for                                  # (the instance attribute: back to the method)
        model.fused_decode = True
    out = {name: t / steps * 1e3 for name, t in sorted(inside.items(), key=lambda kv: -kv[1])}
    out["outside"] = total * 1e3 - sum(out.values())
    out["total"] = total * 1e3
    out["fused"] = decode_step_time(model, S, steps, rng) * 1e3     # the same step as it runs: blocks fused
    return out


def fixed_step_ms(model, S: int, steps: int, fused: bool = True) -> float:
    """ms of a decode step of a model with the same code path and number of layers but tiny matrices (dim 64):
    what a step costs besides arithmetic and memory traffic (Python, the calls, starting the parallel kernels).
    fused=False: with each block run op by op from Python instead of as one kernels.decode_blocks call per layer."""
    import dataclasses

    from tinyllm.model import Transformer
    from tinyllm.weights import expected_shapes
    c = dataclasses.replace(model.config, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1024,
                            explicit_head_dim=None)
    rng = np.random.default_rng(0)
    tiny = Transformer(c, {name: rng.normal(0, 0.1, shape).astype(np.float32)
                           for name, shape in expected_shapes(c).items()})
    tiny.fused_decode = fused
    return decode_step_time(tiny, S, steps, rng) * 1e3


def prefill_time(model, T: int, repeats: int, rng) -> float:
    ids = rng.integers(100, 20000, size=T)
    return median_time(lambda: model.prefill(ids, model.new_cache(T)), repeats)


# --- report --------------------------------------------------------------------------------------------------
def run(args) -> dict:
    rng = np.random.default_rng(0)
    res = dict(machine=machine_info(), command=" ".join(["python", "benchmarks/roofline.py"] + sys.argv[1:]),
               date=time.strftime("%Y-%m-%d %H:%M"), threads=args.threads)
    print(f"machine: {res['machine']}", flush=True)
    res["bandwidth_gbs"] = {t: read_bandwidth(t) for t in (1, 2) if t <= os.cpu_count()}
    tinyllm.set_threads(args.threads)
    res["sgemm_gflops"] = {"2048x2048x2048": sgemm_gflops(2048, 2048, 2048),
                           "128x576x3072": sgemm_gflops(128, 576, 3072)}
    bw = res["bandwidth_gbs"][args.threads]
    print(f"read bandwidth {res['bandwidth_gbs']} GB/s, sgemm {res['sgemm_gflops']} GFLOP/s", flush=True)

    models = {}
    for fmt in FORMATS:
        t0 = time.perf_counter()
        quant, _, a8 = fmt.partition("+")
        models[fmt] = tinyllm.load(quant=None if quant == "fp32" else quant, activations="int8" if a8 else "float32")
        print(f"loaded {fmt}: {models[fmt].weight_bytes / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s "
              f"(JIT {models[fmt].jit_s:.1f} s)", flush=True)

    # headline: decode at S=args.context and prefill of args.prompt tokens, formats interleaved over rounds
    S, T = args.context, args.prompt
    rounds = {fmt: dict(decode=[], prefill=[]) for fmt in FORMATS}
    roofs = dict(bandwidth=[bw], sgemm=[res["sgemm_gflops"]["2048x2048x2048"]])
    for r in range(args.rounds):
        for fmt in FORMATS:
            rounds[fmt]["decode"].append(decode_step_time(models[fmt], S, args.steps, rng))
            rounds[fmt]["prefill"].append(prefill_time(models[fmt], T, 1, rng))
        # the roofs again after every round: the VM's speed drifts, and a roof measured only at the start can
        # sit below what the model then achieves
        roofs["bandwidth"].append(read_bandwidth(args.threads, repeats=3))
        roofs["sgemm"].append(sgemm_gflops(2048, 2048, 2048, repeats=3))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    res["roof_samples"] = roofs
    # each round's figures are set against the roofs measured right after that round, and the fractions are the
    # medians of those per-round ratios; the roofs quoted are the medians of the per-round measurements
    res["bandwidth_gbs"][args.threads] = bw = float(np.median(roofs["bandwidth"][1:]))
    res["sgemm_gflops"]["2048x2048x2048"] = float(np.median(roofs["sgemm"][1:]))
    res["kv_bytes_per_token"] = models["fp32"].config.kv_bytes_per_token()
    headline = {}
    for fmt in FORMATS:
        m, step, pre = models[fmt], float(np.median(rounds[fmt]["decode"])), float(np.median(rounds[fmt]["prefill"]))
        nbytes = decode_bytes(m, S)
        per_round = range(args.rounds)
        headline[fmt] = dict(
            weight_mb=m.weight_bytes / 1e6, bytes_per_token_mb=nbytes / 1e6, decode_tok_s=1 / step,
            decode_ms=step * 1e3, achieved_gbs=nbytes / step / 1e9,
            bw_fraction=float(np.median([nbytes / rounds[fmt]["decode"][r] / 1e9 / roofs["bandwidth"][r + 1]
                                         for r in per_round])),
            ceiling_tok_s=bw * 1e9 / nbytes, prefill_tok_s=T / pre,
            prefill_gflops=prefill_flops(m, T) / pre / 1e9,
            prefill_peak_fraction=float(np.median([prefill_flops(m, T) / rounds[fmt]["prefill"][r] / 1e9
                                                   / roofs["sgemm"][r + 1] for r in per_round])),
            prefill_intensity=prefill_flops(m, T) / m.weight_bytes,
            intensity=decode_flops(m, S) / nbytes)
        headline[fmt]["speedup_vs_fp32"] = headline[fmt]["decode_tok_s"] / (1 / np.median(rounds["fp32"]["decode"]))
    res["headline"] = headline

    # where a step's time goes, fp32 and int8
    res["breakdown"] = {fmt: step_breakdown(models[fmt], S, args.steps, rng) for fmt in ("fp32", "int8", "int8+a8")}
    res["fixed_step_ms"] = fixed_step_ms(models["fp32"], S, args.steps)
    res["fixed_step_ms_op_by_op"] = fixed_step_ms(models["fp32"], S, args.steps, fused=False)
    res["n_layers"] = models["fp32"].config.n_layers
    print(f"step breakdown: {res['breakdown']}", flush=True)

    # context sweep: the KV cache's share of the bytes grows with S
    res["context"] = {}
    for fmt in FORMATS:
        res["context"][fmt] = {s: 1 / decode_step_time(models[fmt], s, args.steps, rng) for s in args.contexts}
    print("context sweep done", flush=True)

    # threads 1 and 2
    res["threads_sweep"] = {}
    for t in sorted(res["bandwidth_gbs"]):
        tinyllm.set_threads(t)
        res["threads_sweep"][t] = {fmt: 1 / decode_step_time(models[fmt], S, args.steps, rng) for fmt in FORMATS}
    tinyllm.set_threads(args.threads)
    print("threads sweep done", flush=True)

    # batch sweep: one weight read per step serves B sequences
    res["batch"] = {}
    for fmt in args.batch_formats:
        res["batch"][fmt] = {}
        for b in args.batches:
            step = decode_step_time(models[fmt], S, max(3, args.steps // 4), rng, batch=b)
            res["batch"][fmt][b] = dict(step_ms=step * 1e3, per_user_tok_s=1 / step, total_tok_s=b / step,
                                        gflops=decode_flops(models[fmt], S, b) / step / 1e9,
                                        intensity=decode_flops(models[fmt], S, b) / decode_bytes(models[fmt], S, b))
        print(f"batch sweep {fmt} done", flush=True)
    return res


def markdown(res: dict, args) -> str:
    m, h = res["machine"], res["headline"]
    bw = res["bandwidth_gbs"][res["threads"]]
    peak = res["sgemm_gflops"]["2048x2048x2048"]
    out = [BEGIN, "## Roofline: decode is bound by the bytes it reads", "",
           f"Measured {res['date']} with `{res['command']}` on {machine_line(m)}; "
           f"{res['threads']} threads for BLAS and Numba. Default model SmolLM2-135M-Instruct.", "",
           f"- Streaming read bandwidth (Numba row sums over 1 GiB): "
           + ", ".join(f"{v:.1f} GB/s with {t} thread{'s' if t > 1 else ''}" for t, v in res["bandwidth_gbs"].items())
           + (f" (with {res['threads']}: the median of best-of-3 measurements taken after each of the "
              f"{args.rounds} rounds below)" if "roof_samples" in res else " (best of 9)"),
           f"- sgemm (numpy BLAS): " + ", ".join(f"{v:.0f} GFLOP/s at {k}" for k, v in res["sgemm_gflops"].items())]
    if "roof_samples" in res:
        out += ["- The roofs at the start and after each round (the VM drifts, so each round is set against the "
                "roofs measured right after it; the fractions below are the medians of those per-round ratios): "
                "bandwidth " + ", ".join(f"{v:.1f}" for v in res["roof_samples"]["bandwidth"]) + " GB/s; sgemm "
                + ", ".join(f"{v:.0f}" for v in res["roof_samples"]["sgemm"]) + " GFLOP/s"]
    out += [
           "", f"Batch 1, context {args.context} tokens (decode: median step over {args.rounds} interleaved rounds of "
           f"{args.steps} steps; prefill: {args.prompt} tokens):", "",
           "| format | weights MB | bytes/token MB | decode tok/s | vs fp32 | achieved GB/s | of bandwidth | "
           "ceiling tok/s | prefill tok/s | prefill GFLOP/s | of sgemm peak |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fmt, r in h.items():
        out.append(f"| {fmt} | {r['weight_mb']:.0f} | {r['bytes_per_token_mb']:.1f} | {r['decode_tok_s']:.1f} | "
                   f"{r['speedup_vs_fp32']:.2f}x | {r['achieved_gbs']:.1f} | {r['bw_fraction']:.0%} | "
                   f"{r['ceiling_tok_s']:.0f} | {r['prefill_tok_s']:.0f} | {r['prefill_gflops']:.0f} | "
                   f"{r['prefill_peak_fraction']:.0%} |")
    out += ["", f"Ceiling = measured bandwidth ({bw:.1f} GB/s) / bytes per token. `+a8`: the same weights with "
            "`activations=\"int8\"`: each linear's input rounded to int8 blocks and multiplied in integers (AVX-512 "
            "VNNI, llama.cpp's scheme; benchmarks/quality.py gives its cost in accuracy).", ""]
    if "breakdown" in res:
        bd = res["breakdown"]
        names = [n for n in bd["fp32"] if n not in ("outside", "total", "fused")]
        out += [f"Where a decode step's time goes (batch 1, context {args.context}, ms per step). The step runs op "
                "by op from Python here, each call of the model's ops timed; `outside` = everything between them: "
                "Python, numpy glue, the cache update. `fused`: the same step as it normally runs, each block one "
                "compiled call (kernels.decode_blocks), so most of `outside` disappears:",
                "", "| format | " + " | ".join(names) + " | outside | total op by op | outside share | fused |",
                "|---|" + "---|" * (len(names) + 4)]
        for fmt, r in bd.items():
            out.append(f"| {fmt} | " + " | ".join(f"{r.get(n, 0.0):.2f}" for n in names)
                       + f" | {r['outside']:.2f} | {r['total']:.2f} | {r['outside'] / r['total']:.0%} | "
                         f"{r.get('fused', float('nan')):.2f} |")
        out += [""]
    if "fixed_step_ms" in res:
        a8 = res['breakdown'].get('int8+a8', res['breakdown']['int8'])
        out += [f"The fixed cost of a step: the same code path and {res.get('n_layers', 30)} layers with tiny "
                f"matrices (dim 64) take {res['fixed_step_ms']:.2f} ms per decode step "
                f"({res.get('fixed_step_ms_op_by_op', float('nan')):.2f} ms op by op). That is Python, the calls "
                "and the start of each parallel kernel, paid by every step whatever the weight format: "
                f"{res['fixed_step_ms'] / a8.get('fused', a8['total']):.0%} of an int8+a8 step here.", ""]
    out += [
            "Decode tok/s against context length (batch 1; every token of context adds "
            f"{res['kv_bytes_per_token'] / 1e3:.1f} kB of float32 K and V to each step's read):", "",
            "| format | " + " | ".join(f"S={s}" for s in args.contexts) + " |",
            "|---|" + "---|" * len(args.contexts)]
    for fmt, row in res["context"].items():
        out.append(f"| {fmt} | " + " | ".join(f"{row[s]:.1f}" for s in args.contexts) + " |")
    out += ["", f"Decode tok/s with 1 and 2 threads (context {args.context}):", "",
            "| threads | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
    for t, row in res["threads_sweep"].items():
        out.append(f"| {t} | " + " | ".join(f"{row[f]:.1f}" for f in FORMATS) + " |")
    for fmt, rows in res["batch"].items():
        out += ["", f"Batched decode, {fmt} weights, context {args.context} each, on a paged KV cache as the engine runs "
                "it (one weight read per step serves the batch):", "", "| batch | step ms (ITL per user) | tok/s per user | tok/s total | GFLOP/s |",
                "|---|---|---|---|---|"]
        for b, r in rows.items():
            out.append(f"| {b} | {r['step_ms']:.1f} | {r['per_user_tok_s']:.1f} | {r['total_tok_s']:.0f} | "
                       f"{r['gflops']:.0f} |")
    out += ["", "Plots: `benchmarks/roofline.png` (arithmetic intensity vs GFLOP/s under the bandwidth and compute "
            "roofs), `benchmarks/decode_vs_bytes.png` (decode tok/s vs bytes per token).", ""]

    def verdict(value, target, fmt, unit=""):
        return f"{value:{fmt}}{unit} ({'met' if value >= target else 'NOT met'})"
    out += ["### Targets (issue 3), ratios from this run", "",
            f"- int8 decode >= 3.0x fp32: {verdict(h['int8']['speedup_vs_fp32'], 3.0, '.2f', 'x')}; "
            f"with int8 activations {verdict(h['int8+a8']['speedup_vs_fp32'], 3.0, '.2f', 'x')}",
            f"- 4-bit (q4_1) decode >= 4.0x fp32: {verdict(h['q4_1']['speedup_vs_fp32'], 4.0, '.2f', 'x')}; "
            f"with int8 activations {verdict(h['q4_1+a8']['speedup_vs_fp32'], 4.0, '.2f', 'x')}",
            f"- fp32 decode >= 80% of the measured read bandwidth: {verdict(h['fp32']['bw_fraction'], 0.8, '.1%')}",
            f"- int8 decode >= 70% of the measured read bandwidth: {verdict(h['int8']['bw_fraction'], 0.7, '.1%')}; "
            f"with int8 activations {verdict(h['int8+a8']['bw_fraction'], 0.7, '.1%')}",
            f"- fp32 prefill >= 80% of the measured sgemm peak: "
            f"{verdict(h['fp32']['prefill_peak_fraction'], 0.8, '.1%')}"]
    if "roof_samples" in res:                                       # the strictest reading, for comparison
        top_bw, top_peak = max(res["roof_samples"]["bandwidth"]), max(res["roof_samples"]["sgemm"])
        out += ["", "Against the highest roofs measured anywhere in the run instead (bandwidth "
                f"{top_bw:.1f} GB/s, sgemm {top_peak:.0f} GFLOP/s; median figures of the table): fp32 decode "
                f"{h['fp32']['achieved_gbs'] / top_bw:.1%}, int8 decode {h['int8']['achieved_gbs'] / top_bw:.1%}, "
                f"int8+a8 {h['int8+a8']['achieved_gbs'] / top_bw:.1%} of bandwidth; fp32 prefill {h['fp32']['prefill_gflops'] / top_peak:.1%} of sgemm."]
    out += [END]
    return "\n".join(out)


def plots(res: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plots", flush=True)
        return
    bw = res["bandwidth_gbs"][res["threads"]]
    peak = res["sgemm_gflops"]["2048x2048x2048"]
    fig, ax = plt.subplots(figsize=(7, 5))
    ai = np.logspace(-1, 3, 200)
    ax.loglog(ai, np.minimum(peak, bw * ai), "k-", label=f"roof: min({peak:.0f} GFLOP/s, {bw:.0f} GB/s x FLOP/byte)")
    for fmt, r in res["headline"].items():
        ax.loglog(r["intensity"], r["achieved_gbs"] * r["intensity"], "o", label=f"decode {fmt}, batch 1")
    for fmt, rows in res["batch"].items():
        xs = [r["intensity"] for r in rows.values()]
        ys = [r["gflops"] for r in rows.values()]
        ax.loglog(xs, ys, ".--", label=f"decode {fmt}, batch " + ",".join(str(b) for b in rows))
    for fmt, r in res["headline"].items():
        ax.loglog(r["prefill_intensity"], r["prefill_gflops"], "s", mfc="none", label=f"prefill {fmt}, 128 tokens")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("tinyllm on SmolLM2-135M: decode (left) is under the bandwidth roof,\nprefill (right) under the compute roof", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "roofline.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    mb = np.array([r["bytes_per_token_mb"] for r in res["headline"].values()])
    ax.plot(mb, [r["decode_tok_s"] for r in res["headline"].values()], "o")
    points = sorted(res["headline"].items(), key=lambda kv: kv[1]["decode_tok_s"])
    tops = max(r["decode_tok_s"] for _, r in points)
    label_y = -np.inf
    for fmt, r in points:              # labels left of their points, pushed apart where formats read alike
        label_y = max(r["decode_tok_s"], label_y + 0.08 * tops)
        ax.annotate(fmt, (r["bytes_per_token_mb"], r["decode_tok_s"]), (r["bytes_per_token_mb"] - 15, label_y),
                    ha="right", va="center", fontsize=9, arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6))
    ax.set_xlim(left=0)
    xs = np.linspace(mb.min() * 0.8, mb.max() * 1.1, 100)
    ax.plot(xs, bw * 1e3 / xs, "k--", label=f"ceiling: {bw:.0f} GB/s / bytes per token")
    ax.set_xlabel("MB read per decode token")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "decode_vs_bytes.png", dpi=120)


def main() -> None:
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer points (smoke test; do not publish)")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and the plots alone")
    p.add_argument("--render", action="store_true", help="regenerate RESULTS.md from the JSON files (report.py)")
    args = p.parse_args()
    args.contexts = [0, 256, 512, 1024, 2048]
    args.batches = [1, 2, 4, 8, 16, 32, 64]
    args.batch_formats = ["fp32", "int8", "q4_1"]
    if args.quick:
        args.steps, args.rounds, args.contexts, args.batches = 6, 1, [0, 512], [1, 4]
        args.batch_formats = ["fp32"]
    if args.render:                                               # the page regenerated from the JSON files
        render()
        return
    res = run(args)
    section = markdown(res, args)
    print(section)
    if not args.no_write:
        res.update(context_tokens=args.context, prompt_tokens=args.prompt)
        write_json("roofline", res)
        plots(res)


if __name__ == "__main__":
    main()
