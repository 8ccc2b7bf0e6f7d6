#!/usr/bin/env python
"""Serving arithmetic from the command line: KV cache size, concurrency, decode step time, request latency,
spend, and static vs continuous batching (tinyllm/capacity.py), plus a calibration against this machine.

    python scripts/capacity.py kv --preset 7b --context 4096 32768
    python scripts/capacity.py concurrency --preset 7b --kv-heads 8 --context 1000
    python scripts/capacity.py step --preset 7b --context 1000 --batch 1 8 32 64
    python scripts/capacity.py latency --preset 7b --request 2000:500 500:2000
    python scripts/capacity.py spend --requests-per-day 1e6 --input 3000 --output 500 --price-in 1 --price-out 4
    python scripts/capacity.py batching --slots 4 --requests 10 4 6 24 14 20 18
    python scripts/capacity.py kv --preset smollm2          # this project's model, from its GGUF's metadata
    python scripts/capacity.py --calibrate                  # measure this machine; predicted vs measured steps
    python scripts/capacity.py --calibrate --roofs-only     # just the bandwidth and sgemm peak (cached for the lab)

Shapes: --preset 7b / 70b (illustrative fp16 shapes), smollm2 (the default model), or --model PATH (a .gguf or
Hugging Face directory: only its config is read), each field overridable by a flag (--layers, --kv-heads, ...).
Hardware defaults to a hypothetical accelerator (2 TB/s, 200 TFLOP/s, 80 GiB); sizes take SI or binary
suffixes: 14GB = 14e9 bytes, 80GiB = 80 x 2^30, 2TB (per second) = 2e12, 200T (FLOP/s) = 2e14.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm import capacity  # noqa: E402
from tinyllm.capacity import GiB, ModelShape, SimRequest  # noqa: E402

# the seed's batching picture: A-D in the first batch (D long), E-G waiting
DEFAULT_REQUESTS = ["10", "4", "6", "24", "14", "20", "18"]


# --- arguments ------------------------------------------------------------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit code 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def amount(text: str) -> float:
    """'14GB' -> 14e9, '80GiB' -> 80 * 2**30, '200T' -> 2e14, '2e12' -> 2e12 ('/s' and 'FLOP' are ignored)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kKMGTP]?)(i?)(?:B|FLOPS?)?(?:/s)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as an amount; write e.g. 14GB, 80GiB, 2TB, 200T "
                                         f"or 2e12")
    number, prefix, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    return number * (1024 if binary else 1000) ** " KMGTP".index(prefix or " ")


def fail(message: str) -> None:
    """One line on stderr, exit code 2: what is wrong and what to write instead."""
    print(f"capacity.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def rate(value: float, unit: str) -> str:
    """2e12, 'B/s' -> '2 TB/s'; 4.7e10 -> '47 GB/s'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def positive_int(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def file_shape(path: Path, fmt: str) -> ModelShape:
    """A checkpoint's shape from its config alone (no weights loaded). fmt: 'fp32' (tinyllm's float32 weights)
    or 'native' (the bytes the GGUF file stores its tensors in)."""
    from tinyllm.gguf import GGUFError, GGUFFile
    from tinyllm.weights import CheckpointError, gguf_config, hf_config
    try:
        if path.is_dir():
            if fmt == "native":
                raise CheckpointError(f"{path}: --format native needs a GGUF file")
            config = hf_config(json.loads((path / "config.json").read_text()), str(path))
            return ModelShape.from_config(config)
        gg = GGUFFile(path)
        config = gguf_config(gg)
        stored = sum(t.nbytes for t in gg.tensors.values())
        return ModelShape.from_config(config, weight_bytes=stored if fmt == "native" else None)
    except (GGUFError, CheckpointError, OSError, ValueError) as e:
        fail(str(e))


def model_shape(args) -> ModelShape:
    if args.model or args.preset == "smollm2":
        if args.model:
            path = Path(args.model)
        else:
            from tinyllm import hub
            path = hub.ensure_default_model()
        shape = file_shape(path, args.format)
    else:
        shape = capacity.SHAPES[args.preset]
    if args.kv_dtype and args.kv_bytes:
        fail("give --kv-bytes or --kv-dtype, not both")
    kv_bytes = args.kv_bytes
    if args.kv_dtype:
        kv_bytes = capacity.kv_dtype_bytes(args.kv_dtype, args.head_dim or shape.head_dim)
    changes = dict(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, params=args.params,
                   weight_bytes=args.weights, kv_bytes_per_value=kv_bytes)
    changed = [f"{k}={v:g}" for k, v in changes.items() if v is not None]
    name = f"{shape.name}, changed: {', '.join(changed)}" if changed else shape.name
    return shape.replace(name=name, **changes)


def describe(shape: ModelShape, args) -> str:
    ridge = capacity.ridge_point(peak_flops=args.peak_flops, bandwidth=args.bandwidth)
    return (f"model: {shape.name}: {shape.layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim}, "
            f"{shape.params:.4g} params, weights {shape.weight_bytes / 1e9:.4g} GB "
            f"({shape.weight_bytes / GiB:.4g} GiB), "
            f"KV {shape.kv_bytes_per_value:g} B per value\nhardware: {rate(args.bandwidth, 'B/s')}, "
            f"{rate(args.peak_flops, 'FLOP/s')} (ridge {ridge:.3g} FLOP/byte), {args.memory / GiB:.4g} GiB, "
            f"{args.usable:.0%} usable")


# --- the calculators ------------------------------------------------------------------------------------------
def cmd_kv(args, shape: ModelShape) -> None:
    per_token = shape.kv_bytes_per_token
    print(f"KV per token: 2 x {shape.layers} x {shape.kv_heads} x {shape.head_dim} x {shape.kv_bytes_per_value:g} B "
          f"= {per_token:,.0f} B ({per_token / 1024:,.1f} KiB)")
    for context in args.context:
        seq = context * per_token
        print(f"  {context:>9,} tokens: {seq / GiB:10.3f} GiB  ({seq / 1e9:.3f} GB)")


def cmd_concurrency(args, shape: ModelShape) -> None:
    free = args.memory * args.usable - shape.weight_bytes
    print(f"free for KV: {args.memory / GiB:g} GiB x {args.usable:g} - {shape.weight_bytes / GiB:.3g} GiB of weights "
          f"= {free / GiB:.2f} GiB")
    for context in args.context:
        n = capacity.max_concurrent_sequences(memory_bytes=args.memory, usable_fraction=args.usable,
                                              weight_bytes=shape.weight_bytes, context=context,
                                              kv_bytes_per_token=shape.kv_bytes_per_token)
        print(f"  {context:>9,} tokens each ({context * shape.kv_bytes_per_token / GiB:.3f} GiB): {n:,} sequences")
    print("the same memory with each tinyllm KV cache format (--kv-dtype):")
    for context in args.context:
        fits = capacity.sequences_by_kv_dtype(shape, memory_bytes=args.memory, usable_fraction=args.usable,
                                              context=context)
        print(f"  {context:>9,} tokens each: " + ", ".join(
            f"{d} {r['sequences']:,}" + (f" ({r['vs_float32']:.2f}x)" if r["vs_float32"] and d != "float32" else "")
            for d, r in fits.items()))


def cmd_step(args, shape: ModelShape) -> None:
    print(f"decode step at {args.context[0]:,} tokens of context per sequence:")
    print(f"  {'batch':>5}  {'ITL ms':>8}  {'tok/s per user':>14}  {'tok/s total':>11}  {'FLOP/byte':>9}  bound")
    for batch in args.batch:
        kw = dict(weight_bytes=shape.weight_bytes, batch=batch, context=args.context[0],
                  kv_bytes_per_token=shape.kv_bytes_per_token)
        nbytes, flops = capacity.decode_step_bytes(**kw), capacity.decode_flops(params=shape.params, batch=batch)
        t = capacity.decode_step_time(**kw, bandwidth=args.bandwidth, params=shape.params, peak_flops=args.peak_flops)
        bound = "memory" if nbytes / args.bandwidth >= flops / args.peak_flops else "compute"
        print(f"  {batch:>5}  {t * 1e3:8.2f}  {1 / t:14.1f}  {batch / t:11,.0f}  {flops / nbytes:9.2f}  {bound}")


def cmd_latency(args, shape: ModelShape) -> None:
    results = []
    for spec in args.request:
        try:
            n_in, n_out = (int(x) for x in spec.split(":"))
            lat = capacity.request_latency(prompt_tokens=n_in, output_tokens=n_out, weight_bytes=shape.weight_bytes,
                                           params=shape.params, kv_bytes_per_token=shape.kv_bytes_per_token,
                                           bandwidth=args.bandwidth, peak_flops=args.peak_flops, batch=args.batch[0],
                                           growing_context=args.growing_context)
        except ValueError:
            fail(f"--request {spec!r}: write PROMPT:OUTPUT token counts, e.g. 2000:500")
        results.append(lat.total)
        print(f"  {n_in:>7,} in / {n_out:>7,} out: TTFT {lat.ttft * 1e3:8.1f} ms + ({n_out:,} - 1) x ITL "
              f"{lat.itl * 1e3:.2f} ms = {lat.total:.2f} s")
    if len(results) > 1:
        print(f"  the slowest takes {max(results) / min(results):.1f}x as long as the fastest")


def cmd_spend(args) -> None:
    s = capacity.token_spend(requests_per_day=args.requests_per_day, input_tokens=args.input,
                             output_tokens=args.output, price_in_per_million=args.price_in,
                             price_out_per_million=args.price_out)
    n_in, n_out = args.requests_per_day * args.input, args.requests_per_day * args.output
    print(f"input : {n_in:.3g} tokens/day x ${args.price_in:g} per million = ${s.input_per_day:,.2f}/day")
    print(f"output: {n_out:.3g} tokens/day x ${args.price_out:g} per million = ${s.output_per_day:,.2f}/day")
    print(f"total ${s.total_per_day:,.2f}/day; output is {s.output_share_of_spend:.0%} of the spend and "
          f"{s.output_share_of_tokens:.0%} of the tokens")


def parse_requests(specs: list[str]) -> list[SimRequest]:
    """'OUT', 'PROMPT:OUT' or 'PROMPT:OUT@ARRIVAL' each, named A, B, C, ..."""
    if len(specs) > 26:
        fail(f"at most 26 requests (one letter each), got {len(specs)}")
    reqs = []
    for name, spec in zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", specs):
        m = re.fullmatch(r"(?:(\d+):)?(\d+)(?:@(\d+))?", spec)
        if not m or int(m.group(2)) < 1 or (m.group(1) is not None and int(m.group(1)) < 1):
            fail(f"request {spec!r}: write OUTPUT, PROMPT:OUTPUT or PROMPT:OUTPUT@ARRIVAL "
                     f"(positive token counts, arrival in steps)")
        reqs.append(SimRequest(name, int(m.group(2)), int(m.group(1) or 1), int(m.group(3) or 0)))
    return reqs


def cmd_batching(args) -> None:
    reqs = parse_requests(args.requests)
    print("requests: " + ", ".join(f"{r.name} = {r.prompt_tokens} prompt + {r.output_tokens} output tokens"
                                   + (f" at step {r.arrival}" if r.arrival else "") for r in reqs))
    print("one character per step: the request's letter (lower case: a step of its prompt only), '.' idle\n")
    runs = {p: capacity.simulate_batching(reqs, slots=args.slots, policy=p, max_num_batched_tokens=args.budget)
            for p in ("static", "continuous")}
    for run in runs.values():
        print(run.render() + "\n")
    s, c = runs["static"], runs["continuous"]
    mean = {p: sum(r.latency.values()) / len(r.latency) for p, r in runs.items()}
    print(f"continuous vs static: everything done at step {max(c.finished.values())} vs {max(s.finished.values())}, "
          f"mean completion {mean['continuous']:.1f} vs {mean['static']:.1f} steps")


# --- calibration: the roofline against this machine -----------------------------------------------------------
def cmd_calibrate(args) -> None:
    """Measure the roofs, then predict and measure tinyllm's decode steps and prefills (a benchmark: run it on a
    quiet machine). The compute roof is numpy's float32 sgemm; a decode step with int8 activations multiplies in
    integers, which that roof does not bound, so its prediction is the memory time alone."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    import tinyllm
    import roofline                                               # the measuring helpers of the roofline report
    from tinyllm.roofs import measure_roofs, save_calibration     # here: they import Numba, the calculators do not

    try:
        tinyllm.set_threads(args.threads)
        roofs = measure_roofs(args.threads, repeats=args.repeats, mib=args.bandwidth_mib,
                              source="scripts/capacity.py --calibrate")
    except ValueError as e:                                       # more threads than cores or NUMBA_NUM_THREADS
        fail(f"--threads {args.threads}: {e}")
    bandwidth, peak = roofs.bandwidth, roofs.peak_flops
    print(f"this machine, {args.threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s, sgemm 2048^3 "
          f"{peak / 1e9:.0f} GFLOP/s (ridge {peak / bandwidth:.1f} FLOP/byte)")
    print(f"saved to {save_calibration(roofs)} (the lab's 'this server' preset predicts with it)")
    if args.roofs_only:
        return
    rng = np.random.default_rng(0)
    for fmt in args.formats:
        quant, _, a8 = fmt.partition("+")
        try:
            model = tinyllm.load(args.model, quant=None if quant == "fp32" else quant,
                                 activations="int8" if a8 else "float32")
        except ValueError as e:
            fail(f"format {fmt!r}: {e}")
        c = model.config
        print(f"\n{fmt}: {model.weight_bytes / 1e6:.1f} MB of weights, {c.kv_bytes_per_token():,} B of KV per token")
        print(f"  {'phase':<8}{'context':>8}{'batch':>6}{'tokens':>7}{'MB read':>9}{'GFLOP':>8}{'bytes/bw ms':>12}"
              f"{'FLOP/peak ms':>13}{'predicted':>10}{'measured':>9}{'ratio':>7}")
        decode_points, verdicts = [], []

        def report(phase, S, B, T, nbytes, flops, compute_peak, measured):
            memory_s, compute_s = nbytes / bandwidth, flops / compute_peak
            predicted = memory_s if a8 and phase == "decode" else max(memory_s, compute_s)
            print(f"  {phase:<8}{S:>8}{B:>6}{T:>7}{nbytes / 1e6:9.1f}{flops / 1e9:8.2f}{memory_s * 1e3:12.2f}"
                  f"{compute_s * 1e3:13.2f}{predicted * 1e3:10.2f}{measured * 1e3:9.2f}{measured / predicted:7.2f}")
            if fmt == "fp32" and B == 1:
                verdicts.append(f"{phase} at {S if phase == 'decode' else T}: {measured / predicted - 1:+.0%}")
            return predicted

        for S in args.contexts:
            for B in args.batches:
                measured = roofline.decode_step_time(model, S, args.steps, rng, batch=B)
                predicted = report("decode", S, B, 1, roofline.decode_bytes(model, S, B),
                                   roofline.decode_flops(model, S, B), peak, measured)
                if B == 1:                                          # the fixed cost: batch-1 steps
                    decode_points.append((predicted, measured))
        for T in args.prompts:
            shaped_peak = roofline.sgemm_gflops(T, c.dim, c.ffn_dim, repeats=args.repeats) * 1e9
            measured = roofline.prefill_time(model, T, args.repeats, rng)
            report("prefill", 0, 1, T, model.weight_bytes + T * c.kv_bytes_per_token(),
                   roofline.prefill_flops(model, T), shaped_peak, measured)
            print(f"  (prefill's compute roof: sgemm at its shape {T}x{c.dim}x{c.ffn_dim}, "
                  f"{shaped_peak / 1e9:.0f} GFLOP/s)")
        if verdicts:
            print("  fp32 batch 1, measured vs predicted (target: within 20%): " + "; ".join(verdicts))
        print("  " + fixed_cost(decode_points))


def fixed_cost(points: list[tuple[float, float]]) -> str:
    """What a batch-1 decode step pays beyond reading its bytes at the measured bandwidth (Python, calls, starting
    parallel kernels, the parts that do not stream): measured - roofline per point, their mean. A slope is not fitted:
    batch-1 points differ little in bytes, and the batch-8 points are bound by something else (their arithmetic
    runs far from the sgemm peak), so a line through all of them has no meaning (a least-squares fit over both gave
    negative fixed costs)."""
    import numpy as np
    pred, meas = np.array(points).T                                 # [N] seconds each
    extra = (meas - pred) * 1e3
    return (f"fixed per-step cost {extra.mean():.2f} ms (batch-1 steps: measured - bytes/bandwidth = "
            f"{', '.join(f'{e:.2f}' for e in extra)} ms)")


# --- main -----------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["calibrate" if a == "--calibrate" else a for a in argv]
    shape_flags = OneLineParser(add_help=False)
    g = shape_flags.add_argument_group("model shape")
    g.add_argument("--preset", choices=["7b", "70b", "smollm2"], default="7b",
                   help="7b / 70b: illustrative fp16 shapes; smollm2: the default model's config (default: 7b)")
    g.add_argument("--model", help="a .gguf file or Hugging Face directory: its config (weights are not loaded)")
    g.add_argument("--format", choices=["fp32", "native"], default="fp32",
                   help="with smollm2/--model: tinyllm's float32 weights or the file's own stored bytes")
    g.add_argument("--layers", type=positive_int)
    g.add_argument("--kv-heads", type=positive_int)
    g.add_argument("--head-dim", type=positive_int)
    g.add_argument("--params", type=amount, help="parameter count, e.g. 7e9 or 7G")
    g.add_argument("--weights", type=amount, help="weight bytes, e.g. 14GB or 14GiB")
    g.add_argument("--kv-bytes", type=float, help="bytes per cached K/V value (2 = fp16, 1 = int8)")
    g.add_argument("--kv-dtype", choices=["float32", "float16", "int8"],
                   help="bytes per K/V value of a tinyllm cache format (int8: 1 + a float16 scale per 32 values)")
    h = shape_flags.add_argument_group("hardware")
    h.add_argument("--bandwidth", type=amount, default=2e12, help="memory bandwidth, bytes/s (default 2TB)")
    h.add_argument("--peak-flops", type=amount, default=2e14, help="peak compute, FLOP/s (default 200T)")
    h.add_argument("--memory", type=amount, default=80 * GiB, help="device memory (default 80GiB)")
    h.add_argument("--usable", type=float, default=0.9, help="share of memory for weights + KV (default 0.9)")

    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p = sub.add_parser("kv", parents=[shape_flags], help="KV cache bytes per token and per sequence")
    p.add_argument("--context", type=positive_int, nargs="+", default=[4096, 32768])
    p = sub.add_parser("concurrency", parents=[shape_flags], help="sequences that fit beside the weights")
    p.add_argument("--context", type=positive_int, nargs="+", default=[1000, 4096])
    p = sub.add_parser("step", parents=[shape_flags], help="decode step time (roofline) against batch size")
    p.add_argument("--context", type=positive_int, nargs=1, default=[1000])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32, 64])
    p = sub.add_parser("latency", parents=[shape_flags], help="TTFT + (n_out - 1) x ITL per request")
    p.add_argument("--request", nargs="+", default=["2000:500", "500:2000"], help="PROMPT:OUTPUT token counts")
    p.add_argument("--batch", type=positive_int, nargs=1, default=[1])
    p.add_argument("--growing-context", action="store_true",
                   help="each step reads the cache as it has grown (default: the prompt's cache, as the seed does)")
    p = sub.add_parser("spend", help="daily token spend at per-million prices")
    p.add_argument("--requests-per-day", type=amount, default=1e6)
    p.add_argument("--input", type=amount, default=3000, help="input tokens per request")
    p.add_argument("--output", type=amount, default=500, help="output tokens per request")
    p.add_argument("--price-in", type=float, default=1.0, help="$ per million input tokens")
    p.add_argument("--price-out", type=float, default=4.0, help="$ per million output tokens")
    p = sub.add_parser("batching", help="static vs continuous batching on tinyllm's scheduler (slot timelines)")
    p.add_argument("--requests", nargs="+", default=DEFAULT_REQUESTS,
                   help="OUTPUT, PROMPT:OUTPUT or PROMPT:OUTPUT@ARRIVAL per request (tokens; arrival in steps)")
    p.add_argument("--slots", type=positive_int, default=4)
    p.add_argument("--budget", type=positive_int, default=512, help="tokens per step (longer prompts are chunked)")
    p = sub.add_parser("calibrate", help="measure this machine; predicted vs measured decode and prefill (a benchmark)")
    p.add_argument("--model", help="a .gguf file or Hugging Face directory (default: the default model)")
    p.add_argument("--formats", nargs="+", default=["fp32", "int8+a8", "q4_1+a8"],
                   help="fp32, int8, int8-block, q4_1, native; +a8 = int8 activations too")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--prompts", type=positive_int, nargs="+", default=[128, 512])
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per measurement (median)")
    p.add_argument("--repeats", type=positive_int, default=5, help="repeats of the roofs and of each prefill")
    p.add_argument("--bandwidth-mib", type=positive_int, default=1024, help="size of the bandwidth test array")
    p.add_argument("--threads", type=positive_int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--roofs-only", action="store_true", help="measure and cache the bandwidth and sgemm peak only "
                                                             "(seconds), not the model's steps (minutes)")
    args = parser.parse_args(argv)

    if args.command == "spend":
        return cmd_spend(args)
    if args.command == "batching":
        return cmd_batching(args)
    if args.command == "calibrate":
        return cmd_calibrate(args)
    if not 0 < args.usable <= 1:
        parser.error(f"--usable must be in (0, 1], got {args.usable}")
    shape = model_shape(args)
    print(describe(shape, args))
    {"kv": cmd_kv, "concurrency": cmd_concurrency, "step": cmd_step, "latency": cmd_latency}[args.command](args, shape)


if __name__ == "__main__":
    main()
