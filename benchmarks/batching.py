#!/usr/bin/env python
"""The batching lab: why continuous batching wins, and why KV memory, not compute, caps the batch. Measured.

    python benchmarks/batching.py                  # all three parts (minutes), writes the RESULTS.md section
    python benchmarks/batching.py --quick          # smaller workloads, for a smoke test (writes nothing)

1. The seed's picture on the real engine: 12 requests of mixed output lengths, all queued at t=0, 4 slots,
   policy "static" (a batch runs until its longest member finishes) vs "continuous" (a finished request's slot
   is refilled at the next step). ASCII slot timelines, and a PNG when matplotlib is installed.
2. A Poisson-arrival workload with widely mixed output lengths (fixed seed), both policies: completion of the
   last request, mean completion, TTFT / ITL percentiles, throughput, KV utilisation, paged waste. Prompts
   are kept short (8..32 tokens): prefill is compute-bound on a CPU and costs both policies the same, so long
   prompts would hide the decode scheduling in which the two policies differ.
3. Batch-size sweep 1..64 at context 256: one decode step over the paged cache (model.decode_batch, the engine's
   step function) -> ITL per user and total tok/s; and the batch at which a KV memory budget stops the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tinyllm  # noqa: E402
import numpy as np  # noqa: E402

from report import machine_info, machine_line, no_background_compiles, render, write_json  # noqa: E402
from tinyllm.engine import Engine  # noqa: E402
from tinyllm.paged import PagedKVCache, parse_bytes  # noqa: E402
from roofline import decode_bytes, decode_flops, read_bandwidth, sgemm_gflops  # noqa: E402
from workload import make_workload  # noqa: E402

HERE = Path(__file__).resolve().parent
# Output-length spreads for the Poisson comparison: lognormal, clipped to [lo, hi]. sigma is the spread of
# log(length): the 90th percentile is 10x the 10th at sigma 0.9, 28x at sigma 1.3.
WORKLOADS = {"moderate": dict(sigma=0.9, output_len=(4, 128)),
             "heavy-tailed": dict(sigma=1.3, output_len=(2, 256))}


# --- driving the engine with arrivals in wall-clock time --------------------------------------------------------
def serve(model, reqs, policy: str, max_num_seqs: int, kv_memory: str, block_size: int = 16,
          long_prefill_tokens: int | None = None) -> Engine:
    """Feed requests at their arrival times (a real clock), step until all are done. -> the engine (metrics)."""
    engine = Engine(model, kv_memory=kv_memory, max_num_seqs=max_num_seqs, policy=policy, block_size=block_size,
                    long_prefill_tokens=long_prefill_tokens)
    pending, t0 = sorted(reqs, key=lambda r: r.arrival_s), time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt_ids, max_tokens=r.output_tokens, stop_token_ids=[],
                               arrival_time=t0 + r.arrival_s)
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - t0)))
    return engine


def summary(engine: Engine, context: int) -> dict:
    m = engine.metrics()
    t0 = min(r.metrics.arrival for r in engine.requests.values())
    ends = [r.metrics.finished - t0 for r in engine.requests.values()]
    # a contiguous cache reserved at the model's full context for every running request (what HF generate or a
    # naive server would do), against the positions actually stored
    ctx_waste = [1 - s.stored_tokens / (s.running * context) for s in engine.steps if s.running]
    return dict(last_completion_s=max(ends), mean_completion_s=float(np.mean(ends)), throughput=m.throughput,
                ttft_p50_s=m.ttft_p50, ttft_p95_s=m.ttft_p95, ttft_p99_s=m.ttft_p99, itl_p50_s=m.itl_p50,
                itl_p95_s=m.itl_p95, itl_p99_s=m.itl_p99, tpot_s=m.tpot_mean, queue_s=m.queue_time_mean,
                kv_util_mean=m.kv_utilisation_mean, kv_util_peak=m.kv_utilisation_peak,
                paged_waste=m.paged_waste_mean, contiguous_waste_request=m.contiguous_waste_mean,
                contiguous_waste_context=float(np.mean(ctx_waste)), preemptions=m.preemptions,
                steps=len(engine.steps), tokens=m.generated_tokens)


def compare(model, reqs, slots: int, rounds: int, kv_memory: str, context: int):
    """Both policies on the same workload, in alternating rounds (a shared machine drifts and stalls). For each
    policy its best round (highest throughput) is reported. -> ({policy: summary}, {policy: [tok/s]}, engines)"""
    runs = {"static": [], "continuous": []}
    for _ in range(rounds):
        for policy in runs:
            engine = serve(model, reqs, policy, slots, kv_memory)
            runs[policy].append((summary(engine, context), engine))
            print(f"  {policy}: {runs[policy][-1][0]['throughput']:.1f} tok/s, last done "
                  f"{runs[policy][-1][0]['last_completion_s']:.1f} s", flush=True)
    chosen = {p: max(r, key=lambda x: x[0]["throughput"]) for p, r in runs.items()}
    return ({p: c[0] for p, c in chosen.items()}, {p: [x[0]["throughput"] for x in r] for p, r in runs.items()},
            {p: c[1] for p, c in chosen.items()})


def timeline(engine: Engine, slots: int, names: dict, width: int = 100) -> str:
    """One row per slot, one column per step (or per group of steps): the letter of the request in the slot."""
    steps = engine.steps
    group = max(1, -(-len(steps) // width))
    rows = []
    for slot in range(slots):
        cells = [names.get(steps[i].slots.get(slot), ".") for i in range(0, len(steps), group)]
        rows.append(f"slot {slot} |{''.join(cells)}|")
    note = f"1 column = {group} step{'s' if group > 1 else ''}; {len(steps)} steps, " \
           f"{steps[-1].end - steps[0].start:.1f} s"
    return "\n".join(rows + [note])


def plot_timelines(engines: dict, slots: int, names: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(engines), 1, figsize=(10, 1.2 + 0.6 * slots * len(engines)), sharex=True)
    colors = plt.get_cmap("tab20").colors
    for ax, (policy, engine) in zip(axes, engines.items()):
        t0 = engine.steps[0].start
        for s in engine.steps:
            for slot, rid in s.slots.items():
                i = list(names).index(rid)
                ax.broken_barh([(s.start - t0, s.end - s.start)], (slot - 0.4, 0.8), color=colors[i % 20])
        for r in engine.requests.values():                      # label each request at its first step
            first = next((s for s in engine.steps if r.request_id in s.slots.values()), None)
            if first is not None:
                slot = next(k for k, v in first.slots.items() if v == r.request_id)
                ax.text(first.start - t0, slot, names[r.request_id], va="center", fontsize=8)
        ax.set_yticks(range(slots))
        ax.set_yticklabels([f"slot {k}" for k in range(slots)])
        ax.set_title(f"{policy}: last request done at {engine.steps[-1].end - t0:.1f} s")
    axes[-1].set_xlabel("seconds (real engine, SmolLM2-135M fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# --- batch-size sweep ---------------------------------------------------------------------------------------------
def sweep(model, batches, context: int, steps: int, rounds: int = 3, after_round=None) -> dict:
    """Median decode step time for B sequences each holding `context` positions of (random) K/V. The batch
    sizes take turns over `rounds` rounds (a shared machine drifts within minutes), and each batch size reports
    the median of its rounds' medians. after_round: called after each round (to sample the machine's roofs)."""
    setups = {}
    for B in batches:
        pool = PagedKVCache(model.config, block_size=16, num_blocks=B * (-(-(context + 2) // 16)))
        rng = np.random.default_rng(0)
        pool.k[:] = rng.normal(0, 1, pool.k.shape[1:]).astype(np.float32)  # timing only: any values do
        pool.v[:] = pool.k
        seqs = [pool.new_sequence() for _ in range(B)]
        for s in seqs:                                            # pretend a prompt of `context` tokens ran
            s.check_room(context + 1)
            s.length = context
        setups[B] = (seqs, [int(t) for t in rng.integers(100, 40000, B)])
    medians = {B: [] for B in batches}
    for _ in range(rounds):
        for B, (seqs, tokens) in setups.items():
            times = []
            for i in range(steps + 1):                            # the first step warms up
                t = time.perf_counter()
                model.decode_batch(tokens, seqs)
                if i:
                    times.append(time.perf_counter() - t)
                for s in seqs:
                    s.truncate(context)                           # every step at the same context
            medians[B].append(float(np.median(times)))
        if after_round is not None:
            after_round()
    out = {}
    for B in batches:
        step = float(np.median(medians[B]))
        out[B] = dict(step_ms=step * 1e3, per_user_tok_s=1 / step, total_tok_s=B / step,
                      rounds_ms=[m * 1e3 for m in medians[B]])
        print(f"  batch {B:3d}: {step * 1e3:7.1f} ms/step, {B / step:7.1f} tok/s total "
              f"(rounds: {', '.join(f'{m * 1e3:.1f}' for m in medians[B])} ms)", flush=True)
    return out


def main(argv=None) -> int:
    no_background_compiles()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads; prints, writes nothing")
    ap.add_argument("--kv-memory", default="512MiB", help="KV pool of the engine and the budget of the sweep")
    ap.add_argument("--context", type=int, default=256, help="context of every sequence in the sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per policy (best reported)")
    ap.add_argument("--threads", type=int, default=None, help="threads for BLAS and Numba (default: all cores)")
    ap.add_argument("--render", action="store_true", help="regenerate RESULTS.md from the JSON files (report.py)")
    args = ap.parse_args(argv)
    if args.render:                                               # the page regenerated from the JSON files
        render()
        return 0
    if args.threads is not None:
        tinyllm.set_threads(args.threads)
    q = args.quick
    model = tinyllm.load()                                        # fp32 weights (dequantized from the file)
    ctx = model.config.context_length
    res = dict(machine=machine_info(), command=" ".join(["python", "benchmarks/batching.py"] + (argv or sys.argv[1:])),
               date=time.strftime("%Y-%m-%d %H:%M"), kv_memory=args.kv_memory,
               kv_bytes_per_token=model.config.kv_bytes_per_token(), load_avg_before=os.getloadavg())

    # 1. the seed's picture: 12 requests at t=0, 4 slots
    rounds = 1 if q else args.rounds
    print("1. 12 requests, 4 slots, static vs continuous", flush=True)
    pic = make_workload(model.tokenizer, n=6 if q else 12, rate=None, prompt_len=(8, 24), output="lognormal",
                        output_len=(4, 24 if q else 64), seed=args.seed)
    names = {r.request_id: chr(ord("A") + i) for i, r in enumerate(pic)}
    res["picture"], res["picture_rounds"], engines = compare(model, pic, 4, rounds, args.kv_memory, ctx)
    res["picture_lengths"] = {names[r.request_id]: r.output_tokens for r in pic}
    res["timelines"] = {p: timeline(e, 4, names) for p, e in engines.items()}
    for p in engines:
        print(f"{p}:\n{res['timelines'][p]}", flush=True)
    png = HERE / "batching_timeline.png"
    res["png"] = None if q else (png.name if plot_timelines(engines, 4, names, png) else None)

    # 2. Poisson arrivals, two spreads of output length, at 4 and 8 slots
    n, rate = (8, 4.0) if q else (48, 8.0)
    res["poisson"] = {}
    for k, (name, spec) in enumerate(WORKLOADS.items()):
        wl = make_workload(model.tokenizer, n=n, rate=rate, prompt_len=(8, 32), output="lognormal",
                           output_len=(spec["output_len"][0], 32) if q else spec["output_len"], sigma=spec["sigma"],
                           seed=args.seed + 1)
        res["poisson"][name] = dict(n=n, rate=rate, **spec, output_tokens=[r.output_tokens for r in wl], by_slots={})
        for slots in (4, 8):
            print(f"2. Poisson workload ({name}), {slots} slots, static vs continuous", flush=True)
            summ, thr, _ = compare(model, wl, slots, rounds, args.kv_memory, ctx)
            res["poisson"][name]["by_slots"][slots] = dict(results=summ, rounds=thr)
        if q:
            break

    # 4 (run here, shown last). KV waste with chat-length prompts, per block size
    print("4. KV waste with prompts of 128..512 tokens, by block size", flush=True)
    wl = make_workload(model.tokenizer, n=6 if q else 24, rate=rate, prompt_len=(128, 512), output="lognormal",
                       output_len=(4, 32 if q else 128), seed=args.seed + 2)
    res["waste"] = dict(n=len(wl), by_block={})
    for bs in ((16,) if q else (8, 16, 32)):
        engine = serve(model, wl, "continuous", 8, args.kv_memory, block_size=bs)
        r = summary(engine, ctx)
        res["waste"]["by_block"][bs] = dict(paged=r["paged_waste"], contiguous_request=r["contiguous_waste_request"],
                                            contiguous_context=r["contiguous_waste_context"],
                                            throughput=r["throughput"])
        print(f"  block {bs}: paged waste {r['paged_waste']:.1%}", flush=True)
        if bs == 16:
            res["prefill_cap"] = {"512 (the step budget)": r}

    # 5 (shown last). The prefill chunk cap against the ITL tail, same workload, blocks of 16
    print("5. prefill chunk cap per request per step vs ITL tail", flush=True)
    for cap in (() if q else (128, 32)):
        engine = serve(model, wl, "continuous", 8, args.kv_memory, long_prefill_tokens=cap)
        res["prefill_cap"][str(cap)] = summary(engine, ctx)
        print(f"  cap {cap}: ITL p99 {res['prefill_cap'][str(cap)]['itl_p99_s'] * 1e3:.0f} ms", flush=True)

    # 3. batch sweep at a fixed context, and where the KV budget stops the batch
    print(f"3. batch sweep at context {args.context}", flush=True)
    batches = [1, 2, 4, 8] if q else [1, 2, 4, 8, 16, 32, 64]
    res["sweep_steps"], res["context"] = 3 if q else 5, args.context
    res["sweep_rounds"] = 1 if q else 3
    # the machine's roofs, sampled after every round of the sweep (they drift as much as the sweep does)
    threads = args.threads or os.cpu_count()
    roofs = dict(bandwidth=[], sgemm=[])

    def sample_roofs():
        roofs["bandwidth"].append(read_bandwidth(threads, repeats=3))
        roofs["sgemm"].append(sgemm_gflops(2048, 2048, 2048, repeats=3))
    res["sweep"] = sweep(model, batches, args.context, res["sweep_steps"], res["sweep_rounds"], sample_roofs)
    res["roof_samples"] = roofs
    block_bytes = PagedKVCache(model.config, block_size=16, num_blocks=1).block_bytes
    per_seq_blocks = -(-(args.context + 1) // 16)
    res["kv_batch_limit"] = parse_bytes(args.kv_memory) // block_bytes // per_seq_blocks
    res["kv_batch_limit_by_dtype"] = kv_limits(model.config, res["kv_memory"], args.context)
    # the roofline's limit on the batch ratio, from this machine's roofs measured now: a step takes at least
    # max(bytes / bandwidth, FLOPs / sgemm peak); batch 1 is bound by bytes, a large batch by FLOPs
    res["bandwidth_gbs"] = float(np.median(roofs["bandwidth"]))
    res["sgemm_gflops"] = float(np.median(roofs["sgemm"]))
    res["roof_step_ms"] = {b: 1e3 * max(decode_bytes(model, args.context, b) / (res["bandwidth_gbs"] * 1e9),
                                        decode_flops(model, args.context, b) / (res["sgemm_gflops"] * 1e9))
                           for b in batches}
    res["per_seq_kv_mib"] = per_seq_blocks * block_bytes / 2**20
    print(json.dumps({k: v for k, v in res.items() if k != "timelines"}, indent=1, default=str))
    res["load_avg_after"] = os.getloadavg()
    if q:                                                         # smoke test: show the section, write nothing
        print(markdown(res))
        return 0
    write_json("batching", res)
    return 0


def kv_limits(config, kv_memory: str, context: int) -> dict:
    """Sequences of `context` tokens whose K/V fit in kv_memory (blocks of 16) for each kv_dtype (kv_cache.py)."""
    blocks_per_seq = -(-(context + 1) // 16)
    return {d: parse_bytes(kv_memory) // (16 * config.kv_bytes_per_token(d)) // blocks_per_seq
            for d in ("float32", "float16", "int8")}


def markdown(res: dict) -> str:
    ms = 1e3
    sw, pic, roof = res["sweep"], res["picture"], res["roof_step_ms"]
    b1 = sw[1]["total_tok_s"]
    b32 = sw.get(32, {}).get("total_tok_s")
    ratio_pic = pic["continuous"]["throughput"] / pic["static"]["throughput"]
    ratios = {(name, k): v["results"]["continuous"]["throughput"] / v["results"]["static"]["throughput"]
              for name, w in res["poisson"].items() for k, v in w["by_slots"].items()}
    waste = res["waste"]["by_block"]
    bt = 32 if 32 in roof else max(roof)                            # the batch the target names (smaller in --quick)

    def table(rs: dict) -> list[str]:
        out = ["| policy | last done s | mean completion s | tok/s | TTFT p50 / p95 / p99 ms | "
               "ITL p50 / p95 / p99 ms | TPOT ms | KV util mean / peak | preemptions | steps |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in rs.items():
            out.append(f"| {p} | {r['last_completion_s']:.1f} | {r['mean_completion_s']:.1f} | {r['throughput']:.1f} | "
                       f"{r['ttft_p50_s'] * ms:.0f} / {r['ttft_p95_s'] * ms:.0f} / {r['ttft_p99_s'] * ms:.0f} | "
                       f"{r['itl_p50_s'] * ms:.0f} / {r['itl_p95_s'] * ms:.0f} / {r['itl_p99_s'] * ms:.0f} | "
                       f"{r['tpot_s'] * ms:.0f} | {r['kv_util_mean']:.1%} / {r['kv_util_peak']:.1%} | "
                       f"{r['preemptions']} | {r['steps']} |")
        return out

    best = max(sw, key=lambda b: sw[b]["total_tok_s"])
    still_growing = best == max(sw)
    lines = ["## Batching: static vs continuous, and what stops the batch", "",
             f"Measured {res['date']} with `{res['command']}` on {machine_line(res['machine'])}. "
             f"SmolLM2-135M-Instruct, fp32 weights, engine on a paged KV cache of {res['kv_memory']} "
             f"(blocks of 16 positions unless said otherwise, {res['kv_bytes_per_token']:,} bytes of K+V per token). "
             "The machine is shared with other developers' jobs (1-minute load average "
             f"{res['load_avg_before'][0]:.1f} at the start, {res['load_avg_after'][0]:.1f} at the end, on 2 cores),"
             " so absolute times are noisy: each static/continuous comparison alternates the policies over "
             f"{len(res['picture_rounds']['static'])} round(s) and shows each policy's best round.", "",
             f"### 1. The seed's picture: {len(res['picture_lengths'])} requests at t=0, 4 slots", "",
             "Output lengths: " + ", ".join(f"{k} {v}" for k, v in res["picture_lengths"].items()), ""]
    lines += table(pic)
    lines += ["", "Throughput in each round (tok/s): " + "; ".join(
        f"{p} " + ", ".join(f"{x:.1f}" for x in v) for p, v in res["picture_rounds"].items())]
    for p in ("static", "continuous"):
        lines += ["", f"{p} (letters = requests, `.` = idle slot):", "```", res["timelines"][p], "```"]
    if res.get("png"):
        lines += ["", f"![slot timelines]({res['png']})"]
    for name, w in res["poisson"].items():
        outs = sorted(w["output_tokens"])
        lines += ["", f"### 2. Poisson arrivals, {name} output lengths ({w['n']} requests, {w['rate']}/s, prompts "
                  f"8..32 tokens, output lengths lognormal with sigma {w['sigma']} clipped to "
                  f"{w['output_len'][0]}..{w['output_len'][1]}: drawn {outs[0]}..{outs[-1]}, median "
                  f"{outs[len(outs) // 2]})", ""]
        for k, v in w["by_slots"].items():
            lines += [f"{k} slots (continuous / static throughput: **{ratios[name, k]:.2f}x**; tok/s in each round: "
                      + "; ".join(f"{p} " + ", ".join(f"{x:.1f}" for x in r) for p, r in v["rounds"].items())
                      + ")", ""]
            lines += table(v["results"]) + [""]
    lines += [f"### 3. Batch size at context {res['context']} (decode step over the paged cache: the batch sizes "
              f"take turns over {res.get('sweep_rounds', 1)} rounds of {res['sweep_steps']} steps; median of the "
              "rounds' medians)", "",
              f"Roof: the least time a step can take on this machine, max(bytes read / {res['bandwidth_gbs']:.1f} "
              f"GB/s, FLOPs / {res['sgemm_gflops']:.0f} GFLOP/s), with the read bandwidth and the sgemm peak "
              "measured in this run (benchmarks/roofline.py's methods): the medians of samples taken after each "
              "round of the sweep"
              + (" (bandwidth " + ", ".join(f"{v:.1f}" for v in res["roof_samples"]["bandwidth"]) + " GB/s; sgemm "
                 + ", ".join(f"{v:.0f}" for v in res["roof_samples"]["sgemm"]) + " GFLOP/s)."
                 if "roof_samples" in res else "."), "",
              "| batch | ITL per user (= step) ms | tok/s per user | total tok/s | vs batch 1 | roof step ms | "
              "roof total tok/s | roof vs roof batch 1 |", "|---|---|---|---|---|---|---|---|"]
    for b, r in sw.items():
        lines.append(f"| {b} | {r['step_ms']:.1f} | {r['per_user_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                     f"{r['total_tok_s'] / b1:.1f}x | {roof[b]:.1f} | {b / roof[b] * 1e3:.0f} | "
                     f"{roof[1] * b / roof[b]:.1f}x |")
    smaller_kv = ", ".join(f"{n} with {d} K/V" for d, n in res["kv_batch_limit_by_dtype"].items() if d != "float32")
    lines += ["", f"KV budget {res['kv_memory']}: each sequence at context {res['context']} holds "
              f"{res['per_seq_kv_mib']:.1f} MiB of K/V, so at most **{res['kv_batch_limit']}** sequences fit "
              f"({smaller_kv}: `kv_dtype=`); "
              + (f"total tok/s still grew at the largest batch measured ({best}). " if still_growing else
                 f"compute stopped paying at about batch {best} (highest total tok/s measured). ")
              + ("With this budget, memory stops the batch before compute does."
                 if res["kv_batch_limit"] < best else
                 "With this budget compute saturates first; a smaller budget (or longer contexts) makes memory "
                 "the limit."),
              "", f"### 4. KV memory waste with chat-length prompts ({res['waste']['n']} Poisson requests, prompts "
              "128..512 tokens, continuous, 8 slots)", "",
              "Empty positions in what is allocated, mean over steps. Paged: only the partial last block of each "
              "sequence is empty, at most block_size - 1 positions, so the share falls as sequences grow and "
              "rises with the block size.", "",
              "| block size | paged (partial last blocks) | contiguous, reserved per request for prompt + max_tokens "
              "| contiguous, reserved at the model's context | tok/s |", "|---|---|---|---|---|"]
    for bs, r in waste.items():
        lines.append(f"| {bs} | {r['paged']:.1%} | {r['contiguous_request']:.1%} | {r['contiguous_context']:.1%} | "
                     f"{r['throughput']:.1f} |")
    short = res["poisson"]["moderate"]["by_slots"][8]["results"]["continuous"]
    lines += ["", f"With the short prompts of part 2 (moderate, 8 slots) the same 16-position blocks waste "
              f"{short['paged_waste']:.1%} (a per-request reservation {short['contiguous_waste_request']:.1%}): "
              "sequences of a few dozen tokens leave a large share of their last block empty."]
    lines += ["", "### 5. Prefill chunk cap against the ITL tail (the same chat-length workload, blocks of 16)", "",
              "A prompt chunk shares its step with the running requests' decode tokens, so the bigger the chunk, "
              "the longer those users wait for their next token. `long_prefill_tokens` caps the prompt tokens "
              "one request may run per step (vLLM's long_prefill_token_threshold): a lower ITL tail, paid for with "
              "a later first token for the new request.", "",
              "| prompt tokens per request per step | ITL p50 / p95 / p99 ms | TTFT p50 / p95 ms | tok/s |",
              "|---|---|---|---|"]
    for cap, r in res["prefill_cap"].items():
        lines.append(f"| {cap} | {r['itl_p50_s'] * ms:.0f} / {r['itl_p95_s'] * ms:.0f} / {r['itl_p99_s'] * ms:.0f} | "
                     f"{r['ttft_p50_s'] * ms:.0f} / {r['ttft_p95_s'] * ms:.0f} | {r['throughput']:.1f} |")
    lines += ["", "### Reading the ratios", "",
              "Continuous batching wins throughput only as far as a fuller step costs less per token than an "
              "emptier one: static batching's idle slots are free when a step's cost grows with the rows it "
              "carries. Measured here, per token of a decode step: "
              + ", ".join(f"batch {b} {sw[b]['step_ms'] / b:.1f} ms" for b in sw) + ". "
              "The wider the spread of output lengths, the more slot-steps static batching leaves idle, and the "
              "larger continuous batching's win. Its ITL tail is higher because new prompts are prefilled inside "
              "the decode steps of running requests (chunked prefill, 512-token budget); part 5 measures the knob "
              "that trades that tail against the new request's TTFT.",
              "", f"A CPU reaches its compute roof at a small batch: fp32 weights give each row 2 FLOPs per 4 bytes "
              f"read, and this machine does {res['sgemm_gflops'] / res['bandwidth_gbs']:.1f} FLOPs in the time it "
              f"reads one byte, so from about {2 * res['sgemm_gflops'] / res['bandwidth_gbs']:.0f} rows on a step is "
              "bound by arithmetic, not by the weight read. "
              f"By the roofs measured in this run, batch {bt} can be at most {roof[1] * bt / roof[bt]:.1f}x batch 1 "
              "here (a GPU, with a few hundred FLOPs per byte, keeps gaining up to much larger batches).",
              "", "### Targets", "",
              f"- batch-32 aggregate decode >= 10x batch-1 (fp32): "
              + (f"{b32 / b1:.1f}x: {'met' if b32 / b1 >= 10 else 'NOT met'} (roofline limit on this machine: "
                 f"{roof[1] * 32 / roof[32]:.1f}x)" if b32 else "not measured"),
              "- continuous >= 1.5x static throughput on widely mixed output lengths (Poisson workloads): "
              + ", ".join(f"{r:.2f}x {name} at {k} slots ({'met' if r >= 1.5 else 'NOT met'})"
                          for (name, k), r in ratios.items())
              + f"; {ratio_pic:.2f}x on the {len(res['picture_lengths'])}-request picture",
              "- paged KV waste < 4% of allocated KV: "
              + ", ".join(f"{r['paged']:.1%} with blocks of {bs} ({'met' if r['paged'] < 0.04 else 'NOT met'})"
                          for bs, r in waste.items())
              + f" on chat-length prompts, against {waste.get(16, next(iter(waste.values())))['contiguous_request']:.1%}"
              " for a per-request max-length reservation; "
              f"{short['paged_waste']:.1%} on the short prompts of part 2"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
