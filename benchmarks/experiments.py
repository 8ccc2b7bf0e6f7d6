"""The serving experiments of the seed text, measured on tinyllm and SmolLM2-135M (fp32 weights, 2 threads).

    python benchmarks/experiments.py            # writes the "Experiments" section of RESULTS.md and experiments.png

1. TTFT against prompt length (64 .. 4,096 tokens): where the quadratic attention term starts to show.
2. Sampling settings do not change the step: decode step time with greedy and with full sampling pipelines.
3. Prefix caching: TTFT of a request whose 500-token system prompt is cached, against the same without caching.
4. Preemption under memory pressure: the inter-token latency of a request that is preempted (its KV recomputed)
   against one that is not, on a pool too small for all of them.
5. KV bytes and concurrency of SmolLM2's grouped-query attention against the same model with full multi-head
   attention (computed with tinyllm.capacity, not measured).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tinyllm  # noqa: E402
from report import machine_info, machine_line, no_background_compiles, write_json  # noqa: E402
from tinyllm import capacity  # noqa: E402
from tinyllm.engine import Engine  # noqa: E402
from tinyllm.sampling import SamplingParams, sample  # noqa: E402

HERE = Path(__file__).resolve().parent


def ttft_by_prompt_length(model, lengths, repeats: int) -> list[dict]:
    """Prefill time (= TTFT without tokenization) of random prompts, median of `repeats`."""
    rng, rows = np.random.default_rng(0), []
    for T in lengths:
        times = []
        for _ in range(repeats):
            ids = rng.integers(100, 40_000, T)
            cache = model.new_cache(T + 1)
            t0 = time.perf_counter()
            model.prefill(ids, cache)
            times.append(time.perf_counter() - t0)
        rows.append(dict(prompt_tokens=T, ttft_ms=1e3 * float(np.median(times)),
                         ms_per_token=1e3 * float(np.median(times)) / T))
        print(f"prefill {T:5d} tokens: {rows[-1]['ttft_ms']:8.1f} ms", file=sys.stderr, flush=True)
    return rows


def sampling_cost(model, steps: int) -> list[dict]:
    """ms of a decode step and of choosing its token, for several sampling settings (interleaved rounds)."""
    settings = {"greedy": SamplingParams(),
                "temperature 0.8": SamplingParams(temperature=0.8),
                "t 0.8, top-k 50, top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
                "all stages, rep. penalty 1.2": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                                               repetition_penalty=1.2)}
    rng = np.random.default_rng(1)
    prompt = list(rng.integers(100, 40_000, 128))
    times = {name: ([], []) for name in settings}
    for _ in range(3):                                               # rounds, so drift hits every setting
        for name, params in settings.items():
            cache = model.new_cache(128 + steps + 1)
            logits, history = model.prefill(prompt, cache), list(prompt)
            for _ in range(steps):
                t0 = time.perf_counter()
                token = sample(logits, params, rng, history)
                t1 = time.perf_counter()
                logits = model.decode_step(token, cache)
                t2 = time.perf_counter()
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
                history.append(token)
    return [dict(setting=name, sample_ms=1e3 * float(np.median(s)), step_ms=1e3 * float(np.median(f)))
            for name, (s, f) in times.items()]


def prefix_caching(model, system_tokens: int, repeats: int) -> dict:
    """TTFT of a request sharing a cached system prompt, with and without the prefix cache."""
    rng = np.random.default_rng(2)
    system = list(rng.integers(100, 40_000, system_tokens))
    out = {}
    for caching in (False, True):
        ttfts = []
        for r in range(repeats):
            engine = Engine(model, kv_memory="64MiB", prefix_caching=caching)
            engine.add_request("warm", system + list(rng.integers(100, 40_000, 20)), max_tokens=1)
            list(engine.run())                                       # the system prompt is now computed (and cached)
            engine.add_request("user", system + list(rng.integers(100, 40_000, 20)), max_tokens=1)
            list(engine.run())
            ttfts.append(engine.requests["user"].metrics.ttft)
        out["with cache" if caching else "without cache"] = 1e3 * float(np.median(ttfts))
    return out


def preemption(model) -> dict:
    """Four requests whose KV cannot all fit: the newest is preempted and recomputed. -> ITL per request."""
    rng = np.random.default_rng(3)
    per_token = model.config.kv_bytes_per_token()
    engine = Engine(model, kv_memory=per_token * 16 * 14, block_size=16, max_num_seqs=4, watermark=0.0)
    for i in range(4):
        engine.add_request(f"r{i}", list(rng.integers(100, 40_000, 40)), max_tokens=60, stop_token_ids=())
    list(engine.run())
    rows = {}
    for rid, req in engine.requests.items():
        itl = np.array(req.metrics.itl) * 1e3
        rows[rid] = dict(preemptions=req.metrics.preemptions, itl_p50_ms=float(np.median(itl)),
                         itl_max_ms=float(itl.max()), itl_ms=itl.round(2).tolist(),
                         ttft_ms=1e3 * req.metrics.ttft)
    return dict(pool_blocks=engine.pool.num_blocks, preemptions=engine.scheduler.num_preemptions, requests=rows)


def gqa_vs_mha(config, memory_gib: float = 8.0, weights_bytes: float = 538e6) -> list[dict]:
    """KV bytes per token and sequences that fit in a budget, SmolLM2 as it is (3 KV heads) and with 9."""
    rows = []
    for label, kv_heads in (("GQA, 3 KV heads (SmolLM2)", config.n_kv_heads), ("MHA, 9 KV heads", config.n_heads)):
        per_token = capacity.kv_bytes_per_token(layers=config.n_layers, kv_heads=kv_heads,
                                                head_dim=config.head_dim, bytes_per_value=4)
        fits = {ctx: capacity.max_concurrent_sequences(memory_bytes=memory_gib * 2**30, usable_fraction=0.9,
                                                       weight_bytes=weights_bytes, context=ctx,
                                                       kv_bytes_per_token=per_token) for ctx in (2048, 8192)}
        rows.append(dict(attention=label, kv_bytes_per_token=per_token, fits_2048=fits[2048], fits_8192=fits[8192]))
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = res["ttft"]
    a.plot([r["prompt_tokens"] for r in t], [r["ms_per_token"] for r in t], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("prefill ms per prompt token")
    a.set_title("TTFT / prompt length: flat = linear, rising = the quadratic attention term")
    for rid, r in res["preemption"]["requests"].items():
        b.plot(r["itl_ms"], label=f"{rid} ({r['preemptions']} preemptions)")
    b.set_xlabel("output token")
    b.set_ylabel("inter-token latency, ms")
    b.set_title("a pool too small for 4 requests: preemption spikes")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(res: dict) -> str:
    lines = [f"Machine: {machine_line(res['machine'])}. Command: `python benchmarks/experiments.py` (fp32 weights, "
             f"{res['threads']} threads). Plot: `benchmarks/experiments.png`.", "",
             "### 1. TTFT against prompt length", "", "| prompt tokens | TTFT ms | ms per prompt token |",
             "| ---: | ---: | ---: |"]
    lines += [f"| {r['prompt_tokens']} | {r['ttft_ms']:.0f} | {r['ms_per_token']:.2f} |" for r in res["ttft"]]
    t = res["ttft"]
    lines += ["", f"Per prompt token, prefill costs {t[-1]['ms_per_token'] / t[0]['ms_per_token']:.2f}x as much at "
              f"{t[-1]['prompt_tokens']} tokens as at {t[0]['prompt_tokens']}: the linear part (the matmuls) is the "
              "same per token, the attention part grows with the length.", "",
              "### 2. Sampling settings do not change the step", "",
              "| sampling | choosing the token, ms | the decode step, ms |", "| --- | ---: | ---: |"]
    lines += [f"| {r['setting']} | {r['sample_ms']:.2f} | {r['step_ms']:.2f} |" for r in res["sampling"]]
    p = res["prefix"]
    lines += ["", "### 3. Prefix caching: a shared 500-token system prompt", "",
              f"TTFT of the second request (its 500-token system prompt computed by the first): "
              f"{p['without cache']:.0f} ms without the prefix cache, {p['with cache']:.0f} ms with it "
              f"({p['without cache'] / p['with cache']:.1f}x).", "",
              "### 4. Preemption under memory pressure", "",
              f"4 requests of 40 + 60 tokens on a pool of {res['preemption']['pool_blocks']} blocks of 16 (each needs "
              f"7): {res['preemption']['preemptions']} preemptions.", "",
              "| request | preemptions | TTFT ms | ITL p50 ms | ITL max ms |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {rid} | {r['preemptions']} | {r['ttft_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_max_ms']:.1f} |"
              for rid, r in res["preemption"]["requests"].items()]
    lines += ["", "### 5. Grouped-query attention against full multi-head attention (computed)", "",
              "SmolLM2's float32 KV cache; sequences that fit in 8 GiB, 90% usable, beside 538 MB of fp32 weights.", "",
              "| attention | KV bytes per token | sequences at 2,048 | at 8,192 |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['attention']} | {int(r['kv_bytes_per_token']):,} | {r['fits_2048']} | {r['fits_8192']} |"
              for r in res["gqa"]]
    return "\n".join(["## Experiments of the seed text, on tinyllm", ""] + lines)


def main(argv=None) -> None:
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print the section, write nothing")
    args = p.parse_args(argv)
    tinyllm.set_threads(args.threads)
    model = tinyllm.load()
    model.prefill([1, 2, 3], model.new_cache(4))
    res = dict(machine=machine_info(), threads=args.threads,
               ttft=ttft_by_prompt_length(model, args.lengths, args.repeats),
               sampling=sampling_cost(model, args.steps),
               prefix=prefix_caching(model, 500, args.repeats),
               preemption=preemption(model), gqa=gqa_vs_mha(model.config))
    text = report(res)
    print(text)
    if not args.no_write:
        plot(res, HERE / "experiments.png")
        write_json("experiments", res, command=" ".join(["python benchmarks/experiments.py"] + (argv or sys.argv[1:])))


if __name__ == "__main__":
    main()
