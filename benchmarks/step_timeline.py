"""Where one decode step's time goes: the kernels, the glue inside the blocks, and Python around them.

    python benchmarks/step_timeline.py [--formats fp32 native+a8] [--contexts 0 256] [--rounds 5] [--no-write]

A decode step (batch 1, `model.decode_step` at a fixed context, as ab_decode.py measures it) is timed whole, and
then in pieces:
  blocks      the 30 fused block calls (kernels/block.py's decode_blocks; for quantized weights the
              threaded block, one parallel region per layer) with their arguments built in advance: the step
              without Python's bookkeeping, the embedding row and the head
  kernels     the step's kernels alone, in the step's order (per layer wqkv, attention, wo, w_in, w_out; then the
              head), all from one compiled loop: no Python and none of a block's own work between them
  wqkv .. head
              each kernel's share: the kernels' time minus their time with that kernel left out. A kernel timed
              alone would mislead: 30 layers of a small matrix (or of K/V) fit in the 32 MB L3 cache and would be
              read from it, where in a step the other weights have pushed them out
  cached      the blocks again with every layer given the first layer's weights, which then stay in the CPU's
              caches: the blocks' arithmetic with next to nothing to read from memory. Near the plain read of the
              layers' bytes (or above it), a step is bound by arithmetic as much as by memory, and cannot come near
              reading alone
  plain read  the same bytes (every weight matrix, the head and the cached K/V, in a step's order, each as its own
              parallel region split between the threads, as the kernels split them) summed by the plainest streaming
              loop, roofline.py's: what reading alone costs in this pattern, timed alternately with the step, so that
              both see the same machine
From these: `glue` = blocks - the layer kernels (what a block does between its kernels: RMSNorm, RoPE and the
cache write, SwiGLU, the residual adds, its allocations, and the 30 calls from Python; negative when the threaded
block, which starts one parallel region per layer, beats the kernels' own ~5 regions), `outside` = step - blocks
- head (forward_batch's Python, the embedding row, the final RMSNorm, argument building). GB/s in brackets: the
bytes a kernel reads (weights; K/V for attention) over its share. `of bandwidth`: the step's bytes (roofline.py's
count) over its time, against the read bandwidth measured in this run (roofline.py's method, best of 5 after
each round). `of plain read`: the plain read's time over the step's (scaled by their bytes), per round, the two
timed back to back: the distance to reading alone, under the same state of a shared machine. The formats take
turns round by round; medians over the rounds. Saves benchmarks/step_timeline.<cpu kind>.json (report.py).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS (tinyllm/threads.py)

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402
from numba.typed import List  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import tinyllm  # noqa: E402
from report import no_background_compiles, write_json  # noqa: E402
from roofline import decode_bytes, read_bandwidth, row_sums  # noqa: E402
from tinyllm.kernels import block, intdot  # noqa: E402
from tinyllm.kernels.attention_kernels import decode_attention  # noqa: E402
from tinyllm.kernels.dispatch import linear_into  # noqa: E402
from tinyllm.kernels.weight_formats import kernel_weight  # noqa: E402

MATRICES = ("wqkv", "wo", "w_in", "w_out")


KERNELS = ("wqkv", "attention", "wo", "w_in", "w_out", "head")      # in a step's order; bit i of `which`


def _sequence_loop(int8_inputs: bool):
    """A compiled loop: a step's kernels in its order, those whose bit is set in `which`, `repeats` times
    (int8_inputs a constant of the code, as in block.py)."""
    @njit
    def run(layers, attention_layers, head, x, q, att, qkv, o, gate_up, act, logits, start, shape, int_dots, which,
            repeats):
        for _ in range(repeats):
            for (wqkv, wo, w_in, w_out), (k, ks, v, vs) in zip(layers, attention_layers):
                if which & 1:
                    linear_into(wqkv, x, qkv, int8_inputs, int_dots)
                if which & 2:
                    decode_attention(q, k, ks, v, vs, start, att, shape)
                if which & 4:
                    linear_into(wo, x, o, int8_inputs, int_dots)
                if which & 8:
                    linear_into(w_in, x, gate_up, int8_inputs, int_dots)
                if which & 16:
                    linear_into(w_out, act, o, int8_inputs, int_dots)
            if which & 32:
                linear_into(head, x, logits, int8_inputs, int_dots)
    return run


SEQUENCES = {False: _sequence_loop(False), True: _sequence_loop(True)}


@njit(nogil=True)
def _read_all(chunks, out):
    for a in chunks:                            # roofline.py's streaming read, a parallel region per array
        row_sums(a, out)


def plain_read_chunks(arrays_in_order) -> tuple:
    """Float32 stand-ins of the same sizes (rounded up to 4 KiB) for each group of arrays, in order -> (a typed
    list of [rows, 1024] arrays, their bytes, a scratch output)."""
    chunks = List()
    for arrays in arrays_in_order:
        n = sum(a.nbytes for a in arrays)
        chunks.append(np.ones((-(-n // 4096), 1024), np.float32))                      # [rows, 1024]
    return chunks, sum(c.nbytes for c in chunks), np.empty(max(c.shape[0] for c in chunks), np.float32)
ALL = 2 ** len(KERNELS) - 1


class Timeline:
    """One format's model, cache and prepared arguments; `measure()` times every piece once (median of steps)."""

    def __init__(self, fmt: str, context: int, steps: int):
        quant, _, a8 = fmt.partition("+")
        self.fmt, self.S, self.steps = fmt, context, steps
        self.model = m = tinyllm.load(quant=None if quant == "fp32" else quant,
                                      activations="int8" if a8 else "float32")
        c, self.a8 = m.config, m.int8_inputs
        self.cache = m.new_cache(context + 2)
        if context:
            m.prefill(np.random.default_rng(0).integers(0, 1000, context), self.cache)
        rng = np.random.default_rng(1)
        cos, sin = m.rope_cos[context:context + 1], m.rope_sin[context:context + 1]
        weights, caches, attention_layers = [], [], []
        for i, layer in enumerate(m.layers):
            k, ks, v, vs, self.shape = block.cache_operands(self.cache.k[i], self.cache.v[i], c.n_heads)
            weights.append(block.block_weights(layer))
            caches.append((k, ks, v, vs, self.shape))
            S = context + 1
            attention_layers.append((k[:S], None if ks is None else ks[:S], v[:S], None if vs is None else vs[:S]))
        self.block_args = (weights, caches, context, cos, sin, c.n_heads, c.norm_eps, self.a8)   # as
        w0 = m.layers[0]                                                # backend.NumbaBackend.decode_blocks passes them
        self.cached_block_args = ([weights[0]] * len(weights), *self.block_args[1:])   # every layer: layer 0's weights

        def rows(n):
            return rng.standard_normal((1, n)).astype(np.float32)                      # [1, n]
        x, act = rows(c.dim), rows(w0.w_out.shape[1])
        self.x = x * 0.1
        self.sequence_args = (
            tuple(tuple(kernel_weight(getattr(layer, n)) for n in MATRICES) for layer in m.layers),
            tuple(attention_layers), kernel_weight(m.lm_head), x,
            rng.standard_normal((1, c.n_heads, c.head_dim)).astype(np.float32),       # q [1, H, Dh]
            np.empty((1, c.n_heads, c.head_dim), np.float32),                         # att [1, H, Dh]
            np.empty((1, w0.wqkv.shape[0]), np.float32), np.empty((1, c.dim), np.float32),
            np.empty((1, w0.w_in.shape[0]), np.float32), act, np.empty((1, m.lm_head.shape[0]), np.float32),
            context, self.shape, intdot.USE_INT_DOTS)
        kv_bytes = sum(a.nbytes for layer in attention_layers for a in layer if a is not None)
        self.bytes = {"attention": kv_bytes, "head": m.lm_head.nbytes,
                      **{n: sum(getattr(layer, n).nbytes for layer in m.layers) for n in MATRICES}}
        self.layer_bytes = sum(self.bytes[n] for n in MATRICES)    # the blocks' weights
        self.step_bytes = decode_bytes(m, context)                 # what roofline.py counts for a step
        in_order = []                                              # a step's reads: per layer, wqkv, K and V, ...
        for layer, kv in zip(self.sequence_args[0], attention_layers):
            in_order += [layer[0], [a for a in kv if a is not None], *layer[1:]]
        self.read_chunks, self.read_bytes, self.read_out = plain_read_chunks(in_order + [self.sequence_args[2]])
        self.measure()                                             # compiles the loops, warms the caches

    def _median(self, fn, repeats: int = 1) -> float:
        times = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) / repeats

    def measure(self) -> dict:
        m, S = self.model, self.S
        out = {}

        def step():
            self.cache.truncate(S)
            m.decode_step(100, self.cache)
        out["step"] = self._median(step)
        out["plain read"] = self._median(lambda: _read_all(self.read_chunks, self.read_out))
        out["blocks"] = self._median(lambda: block.decode_blocks(self.x.copy(), *self.block_args))
        out["cached"] = self._median(lambda: block.decode_blocks(self.x.copy(), *self.cached_block_args))
        sequence = SEQUENCES[self.a8]

        def kernels(which):
            return self._median(lambda: sequence(*self.sequence_args, which, 2), 2)
        out["kernels"] = kernels(ALL)
        out["layer kernels"] = kernels(ALL - 32)
        for bit, name in enumerate(KERNELS):
            out[name] = out["kernels"] - kernels(ALL - 2 ** bit)
        self.cache.truncate(S)
        return out


# issue 35's restatement of issue 18's target: a step at least this share of the plain read of its own bytes
TARGETS = {"fp32": 0.85, "int8-block+a8": 0.85, "native+a8": 0.85}


def of_plain_read(t: Timeline, runs: list) -> float:
    """The step's speed as a share of the plain read's, per round (the two timed back to back), median."""
    return float(np.median([(t.step_bytes / r["step"]) / (t.read_bytes / r["plain read"]) for r in runs]))


def layers_read(t: Timeline, med: dict) -> float:
    """Seconds the plain read's speed takes over the blocks' weights: what `cached` is to be set against."""
    return t.layer_bytes / (t.read_bytes / med["plain read"])


def table(results: dict, timelines: dict, bandwidth: float) -> str:
    head = ("| format | context | step ms | outside | blocks | cached | layers' read | glue | kernels | wqkv | attention "
            "| wo | w_in | w_out | head | step GB/s | of bandwidth | plain read GB/s | of plain read |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (fmt, context), runs in results.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        t = timelines[fmt, context]
        ms = lambda s: f"{s * 1e3:.2f}"                                              # noqa: E731
        share = lambda k: f"{ms(med[k])} ({t.bytes[k] / med[k] / 1e9:.0f})"           # noqa: E731
        step_gbs = t.step_bytes / med["step"] / 1e9
        lines.append(f"| {fmt} | {context} | {ms(med['step'])} | {ms(med['step'] - med['blocks'] - med['head'])} | "
                     f"{ms(med['blocks'])} | {ms(med['cached'])} | {ms(layers_read(t, med))} | "
                     f"{ms(med['blocks'] - med['layer kernels'])} | {ms(med['kernels'])} | "
                     + " | ".join(share(k) for k in KERNELS) + f" | {step_gbs:.1f} | {step_gbs / bandwidth:.0%} | "
                     f"{t.read_bytes / med['plain read'] / 1e9:.1f} | {of_plain_read(t, runs):.0%} |")
    verdicts = []
    for (fmt, context), runs in results.items():
        if fmt in TARGETS:
            t = timelines[fmt, context]
            share_of_bandwidth = t.step_bytes / np.median([r["step"] for r in runs]) / 1e9 / bandwidth
            share = of_plain_read(t, runs)
            verdicts.append(f"- {fmt} at context {context}: {share:.0%} of the plain read of its bytes (target "
                            f">= {TARGETS[fmt]:.0%}: {'met' if share >= TARGETS[fmt] else 'NOT met'}); "
                            f"{share_of_bandwidth:.0%} of the read bandwidth")
    return "\n".join(lines + ([""] + verdicts if verdicts else []))


def json_rows(results: dict, timelines: dict, bandwidth: float) -> list[dict]:
    """The table's figures (see table) as JSON rows: seconds as ms, each kernel's ms and GB/s."""
    rows = []
    for (fmt, context), runs in results.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        t = timelines[fmt, context]
        step_gbs = t.step_bytes / med["step"] / 1e9
        rows.append(dict(format=fmt, context=context, step_ms=med["step"] * 1e3,
                         outside_ms=(med["step"] - med["blocks"] - med["head"]) * 1e3,
                         blocks_ms=med["blocks"] * 1e3, cached_ms=med["cached"] * 1e3,
                         layers_read_ms=layers_read(t, med) * 1e3, glue_ms=(med["blocks"] - med["layer kernels"]) * 1e3,
                         kernels_ms=med["kernels"] * 1e3, kernel_ms={k: med[k] * 1e3 for k in KERNELS},
                         kernel_gbs={k: t.bytes[k] / med[k] / 1e9 for k in KERNELS}, step_gbs=step_gbs,
                         of_bandwidth=step_gbs / bandwidth, plain_read_gbs=t.read_bytes / med["plain read"] / 1e9,
                         of_plain_read=of_plain_read(t, runs)))
    return rows


def main(argv=None) -> int:
    no_background_compiles()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["fp32", "int8+a8", "int8-block+a8", "native+a8"])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="timed calls per piece per round (their median is taken)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    tinyllm.set_threads(args.threads)
    timelines = {(fmt, S): Timeline(fmt, S, args.steps) for fmt in args.formats for S in args.contexts}
    results, bandwidths = {key: [] for key in timelines}, []
    for r in range(args.rounds):
        for key, t in timelines.items():
            results[key].append(t.measure())
        bandwidths.append(read_bandwidth(args.threads, repeats=5))
        tinyllm.set_threads(args.threads)
        print(f"round {r + 1}/{args.rounds} done (bandwidth {bandwidths[-1]:.1f} GB/s)", file=sys.stderr)
    bandwidth = float(np.median(bandwidths))
    body = table(results, timelines, bandwidth)
    print(body)
    if not args.no_write:
        write_json("step_timeline", dict(rows=json_rows(results, timelines, bandwidth), rounds=args.rounds,
                                         threads=args.threads, bandwidth_gbs=bandwidth, bandwidth_samples=bandwidths),
                   command=" ".join(["python benchmarks/step_timeline.py"]
                                    + (sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
