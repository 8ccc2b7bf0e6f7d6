#!/usr/bin/env python
"""What a float16 or int8 KV cache costs in quality, and what it buys in decode speed, on the default model.

    python benchmarks/kv_dtype.py --quality        # KLD against the float32 cache (deterministic), writes RESULTS.md
    python benchmarks/kv_dtype.py --speed          # decode tok/s at contexts 256 / 2,048 / 8,192 per kv_dtype
    python benchmarks/kv_dtype.py --speed --quick  # a smoke test of the speed part (tiny settings, nothing written)

Quality, as llama.cpp's perplexity tool measures a KV type: the text benchmarks/data/eval_text.txt in chunks of
512 tokens, each chunk a fresh sequence; every position's distribution with the rounded cache against the same
run with the float32 cache: mean and p99 of KL(p_fp32 || p_kv), top-1 agreement, the largest logit difference. Each
chunk runs two ways: in one pass (512 rows: attention in numpy on the dequantized cache) and in passes of 16
tokens (the Numba kernels reading the stored format, the fused block writing it). Then the greedy output of the
reference fixtures' prompts with each format against the float32 cache's. int8 runs with one float16
scale per position and KV head and with one per 32 values (llama.cpp's Q8_0 layout), to choose between them.

Speed: batch-1 decode steps with the cache filled to the context (random values: time does not depend on them),
the kv_dtypes measured in interleaved rounds and reported as medians, with the bytes each step reads.
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
from tinyllm import kv_cache  # noqa: E402

from quality import compare  # noqa: E402
from report import machine_info, machine_line, no_background_compiles, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
CHUNK = 512                       # tokens per evaluated sequence (llama.cpp's perplexity default)
STEP_TOKENS = 16                  # tokens per pass in the kernels' run (dispatch.FEW_TOKENS: the decode kernel)
VARIANTS = {"float16": ("float16", None), "int8, a scale per position and KV head": ("int8", None),
            "int8, a scale per 32 values (the default)": ("int8", 32)}   # label -> kv_dtype, kv_cache.INT8_GROUP
CONTEXTS = (256, 2048, 8192)


def chunk_logits(model, ids: np.ndarray, kv_dtype: str, step: int | None) -> np.ndarray:
    """Logits [T, V] of every position of one chunk with a fresh cache of kv_dtype, fed in one pass or `step`
    tokens at a time."""
    cache = model.new_cache(len(ids), kv_dtype)
    step = step or len(ids)
    return np.concatenate([model.forward(ids[i:i + step], cache) for i in range(0, len(ids), step)])


def quality(model, ids: np.ndarray) -> dict:
    chunks = [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)]
    rows, default_group = {}, kv_cache.INT8_GROUP
    for mode, step in (("one pass per chunk", None), (f"passes of {STEP_TOKENS} tokens", STEP_TOKENS)):
        ref = np.concatenate([chunk_logits(model, c, "float32", step) for c in chunks])       # [T, V]
        for label, (kv_dtype, group) in VARIANTS.items():
            kv_cache.INT8_GROUP = group
            got = np.concatenate([chunk_logits(model, c, kv_dtype, step) for c in chunks])
            rows[mode, label] = compare(ref, got) | dict(bytes_per_token=model.config.kv_bytes_per_token(kv_dtype))
            kv_cache.INT8_GROUP = default_group
            print(mode, label, rows[mode, label], flush=True)
    return rows


def fixture_greedy(model, n_new: int = 40) -> dict:
    """Greedy continuations of the reference fixtures' prompts (tests/fixtures) with each KV format against the
    float32 cache's. -> {label: (n_new, prompts whose n_new tokens are all the same, prompts, first differing
    steps)}"""
    import json
    prompts = [p["ids"] for p in json.loads((HERE.parent / "tests" / "fixtures" / "smollm2_reference.json")
                                            .read_text())["prompts"]]

    def greedy(ids, kv_dtype):
        cache, out = model.new_cache(len(ids) + n_new, kv_dtype), []
        logits = model.prefill(ids, cache)
        while len(out) < n_new:
            out.append(int(np.argmax(logits)))
            if len(out) < n_new:
                logits = model.decode_step(out[-1], cache)
        return out

    ref = [greedy(ids, "float32") for ids in prompts]
    res = {}
    for label, (kv_dtype, _) in VARIANTS.items():
        if "per position" in label:
            continue
        got = [greedy(ids, kv_dtype) for ids in prompts]
        first = [next(i for i, (a, b) in enumerate(zip(g, r)) if a != b) for g, r in zip(got, ref) if g != r]
        res[label] = (n_new, len(prompts) - len(first), len(prompts), first)
        print("greedy", label, res[label], flush=True)
    return res


def quality_section(rows: dict, n_tokens: int, command: str, seconds: float, greedy: dict | None = None) -> str:
    lines = ["## KV cache formats: quality against the float32 cache", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `{command}` on {machine_line(machine_info())} "
             f"({seconds:.0f} s; deterministic). The {n_tokens:,}-token text benchmarks/data/eval_text.txt in chunks "
             f"of {CHUNK} tokens, each a fresh sequence, fp32 weights; KL(p_fp32-cache || p_kv) over every "
             f"position. Targets (issue 19): float16 mean KLD <= 1e-4, int8 <= 2e-3.", "",
             "| path | KV format | bytes/token | mean KLD | p99 KLD | top-1 agreement | max logit error |",
             "|---|---|---|---|---|---|---|"]
    for (mode, label), r in rows.items():
        lines.append(f"| {mode} | {label} | {r['bytes_per_token']:,} | {r['kld_mean']:.2e} | {r['kld_p99']:.2e} | "
                     f"{r['top1']:.2%} | {r['max_logit_err']:.4f} |")
    per_head, per_32 = (rows[mode, label] for mode, label in rows if mode == next(iter(rows))[0]
                        and label.startswith("int8"))
    lines += ["", f"Choice for int8 (kv_cache.INT8_GROUP): one scale per 32 values has "
              f"{per_head['kld_mean'] / per_32['kld_mean']:.1f}x lower mean KLD than one per position and KV head, "
              f"for {per_32['bytes_per_token'] / per_head['bytes_per_token'] - 1:.0%} more bytes per token; the "
              f"scales are float16, as in llama.cpp's Q8_0."]
    for label, (n_new, same, total, first) in (greedy or {}).items():
        lines.append(f"Greedy output of the {total} reference fixture prompts (tests/fixtures, {n_new} tokens each) "
                     f"with {label}: {same} of {total} identical to the float32 cache's"
                     + (f" (the others first differ at steps {', '.join(map(str, first))})." if first else "."))
    return "\n".join(lines)


# --- speed ---------------------------------------------------------------------------------------------------------
def filled_cache(model, S: int, kv_dtype: str, rng):
    """A cache of kv_dtype holding S positions of random K/V (stored, so rounded as real ones are)."""
    cache = model.new_cache(S + 1, kv_dtype)
    L, _, KVH, Dh = cache.k.shape
    for layer in range(L):                                          # a layer at a time: no [L, S, ...] float32 copy
        cache.k[layer, :S] = rng.standard_normal((S, KVH, Dh), dtype=np.float32) * 0.5
        cache.v[layer, :S] = rng.standard_normal((S, KVH, Dh), dtype=np.float32) * 0.5
    cache.length = S
    return cache


def speed(model, contexts, rounds: int, steps: int) -> tuple[dict, dict]:
    """Median seconds per decode step for each (context, kv_dtype), the kv_dtypes interleaved round by round; and
    of one layer's attention call alone (the kernel reading the stored format), to tell compute from bandwidth."""
    rng = np.random.default_rng(0)
    times, attention = {}, {}
    H, Dh = model.config.n_heads, model.config.head_dim
    q = rng.standard_normal((1, H, Dh), dtype=np.float32)                                     # [1, H, Dh]
    for S in contexts:
        S = min(S, model.config.context_length - 1)                 # 8,192: 8,191 cached + the new token
        caches = {d: filled_cache(model, S, d, rng) for d in kv_cache.KV_DTYPES}
        for d, c in caches.items():                                 # compile / warm every path first
            model.decode_step(1, c)
            c.truncate(S)
        for _ in range(rounds):
            for d, c in caches.items():
                for i in range(steps):
                    t0 = time.perf_counter()
                    model.decode_step(100 + i, c)
                    times.setdefault((S, d), []).append(time.perf_counter() - t0)
                    c.truncate(S)
                for layer in range(steps):                          # a different layer's K/V each call
                    k, v = c.k[layer % len(model.layers), :S + 1], c.v[layer % len(model.layers), :S + 1]
                    t0 = time.perf_counter()
                    model.compute.ops_for(1).attention(q, k, v, S)
                    attention.setdefault((S, d), []).append(time.perf_counter() - t0)
        del caches
    return ({key: float(np.median(t)) for key, t in times.items()},
            {key: float(np.median(t)) for key, t in attention.items()})


def speed_section(runs: list, command: str) -> str:
    """runs: (model, step seconds, attention seconds) per weight format, as speed() returns them."""
    lines = ["## KV cache formats: decode speed", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `{command}` on {machine_line(machine_info())}. "
             f"Batch 1, the cache filled to the context; medians over interleaved rounds. Targets (issue 19) at "
             f"2,048 tokens: float16 >= 1.1x, int8 >= 1.25x the float32 cache. `memory-bound limit`: the ratio if "
             f"a step took time in proportion to the bytes it reads (weights + K/V), the most a smaller cache can "
             f"buy at that weight format.", "",
             "| weights | context | KV format | KV MB read per step | decode tok/s | vs float32 | memory-bound limit | "
             "attention per layer, us | its KV read, GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for model, res, attention in runs:
        a8 = "+a8" if model.activations == "int8" else ""
        weights = f"{model.quant}{a8} ({model.weight_bytes / 1e6:.0f} MB)"
        for (S, d), t in res.items():
            kv_bytes = S * model.config.kv_bytes_per_token(d)
            limit = (model.weight_bytes + S * model.config.kv_bytes_per_token("float32")) / (model.weight_bytes
                                                                                             + kv_bytes)
            a = attention[S, d]
            lines.append(f"| {weights} | {S:,} | {d} | {kv_bytes / 1e6:.1f} | {1 / t:.1f} | "
                         f"{res[S, 'float32'] / t:.2f}x | {limit:.2f}x | {a * 1e6:.0f} | "
                         f"{kv_bytes / model.config.n_layers / a / 1e9:.1f} |")
    return "\n".join(lines)


def speed_rows(runs: list) -> list[dict]:
    """The speed table's figures as JSON rows (see speed_section)."""
    rows = []
    for model, res, attention in runs:
        a8 = "+a8" if model.activations == "int8" else ""
        for (S, d), t in res.items():
            kv_bytes = S * model.config.kv_bytes_per_token(d)
            f32_bytes = S * model.config.kv_bytes_per_token("float32")
            rows.append(dict(weights=f"{model.quant}{a8}", weight_mb=model.weight_bytes / 1e6, context=S, kv_format=d,
                             kv_mb=kv_bytes / 1e6, tok_s=1 / t, vs_float32=res[S, "float32"] / t,
                             limit=(model.weight_bytes + f32_bytes) / (model.weight_bytes + kv_bytes),
                             attention_us=attention[S, d] * 1e6))
    return rows


def main() -> None:
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quality", action="store_true", help="KLD of each format against the float32 cache")
    p.add_argument("--speed", action="store_true", help="decode tok/s per format at each context")
    p.add_argument("--quant", default="fp32", help="weights for the speed part (tinyllm.load's quant, +a8 for int8 "
                   "activations; several: comma-separated, e.g. fp32,native,native+a8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the speed part")
    p.add_argument("--quick", action="store_true", help="tiny settings, nothing written (a smoke test)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if not (args.quality or args.speed):
        p.error("choose --quality and/or --speed")
    tinyllm.set_threads(args.threads)
    write = not (args.quick or args.no_write)
    threads = os.environ.get("NUMBA_NUM_THREADS")
    command = " ".join([f"NUMBA_NUM_THREADS={threads}"] * bool(threads) + ["python benchmarks/kv_dtype.py"]
                       + sys.argv[1:])
    if args.quality:
        t0 = time.time()
        model = tinyllm.load()
        ids = np.array(model.tokenizer.encode((HERE / "data" / "eval_text.txt").read_text()))
        ids = ids[:2 * STEP_TOKENS + 5] if args.quick else ids
        rows = quality(model, ids)
        greedy = fixture_greedy(model, 3 if args.quick else 40)
        section = quality_section(rows, len(ids), command, time.time() - t0, greedy)
        print(section)
        if write:
            write_json("kv_quality", dict(
                rows=[dict(path=mode, kv_format=label, **r) for (mode, label), r in rows.items()],
                greedy=[dict(kv_format=label, tokens=n_new, same=same, prompts=total, first_difference=first)
                        for label, (n_new, same, total, first) in greedy.items()]), command=command)
    if args.speed:
        contexts, rounds, steps = ((64, 256), 1, 3) if args.quick else (CONTEXTS, args.rounds, 10)
        runs = []
        for spec in args.quant.split(","):
            quant, _, a8 = spec.partition("+")
            model = tinyllm.load(quant=quant, activations="int8" if a8 else "float32")
            runs.append((model, *speed(model, contexts, rounds, steps)))
            del model
        section = speed_section(runs, command)
        print(section)
        if write:
            write_json("kv_speed", dict(rows=speed_rows(runs)), command=command)


if __name__ == "__main__":
    main()
