"""benchmarks/RESULTS.md and the README's figures, generated from the JSON files the benchmarks write.

    python benchmarks/report.py           # rewrite RESULTS.md and the README's report blocks from benchmarks/*.json
    python benchmarks/report.py --check   # exit 1 if either differs from what the JSON files give

Every benchmark saves its measurements with `write_json(name, data)`: benchmarks/<name>.<cpu kind>.json, the
machine (CPU, instruction set, versions) recorded inside, one file per kind of CPU, so that an AVX2-only run does
not overwrite an AVX-512 VNNI one. A file named benchmarks/<name>.json was written before the scripts recorded the
instruction set (on AVX-512 VNNI machines, by the notes of the time); it is shown until a file of that kind
replaces it. A section whose file is missing says which command to run. The README's figures sit between
`<!-- report:NAME -->` and `<!-- /report:NAME -->` and come from the same files. Nothing here measures anything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
README = HERE.parent / "README.md"
UNRECORDED = "CPU kind not recorded"


# --- what the benchmark scripts call ------------------------------------------------------------------------------
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    found = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return set(found.group(1).split()) if found else set()


def no_background_compiles() -> None:
    """Set TINYLLM_COMPILE_HELPER=0 for this process and those it starts: warm-up then compiles all a model runs,
    its fused blocks (plain and threaded) included, before it returns, where Numba's cache lacks it. By default a
    first run leaves the blocks to a second process and decodes op by op, then with the plain blocks, until they
    are ready (tinyllm/kernels/warmup.py), and a benchmark would time that, with a compiler beside it."""
    os.environ.setdefault("TINYLLM_COMPILE_HELPER", "0")


def wait_for_background_compiles(timeout: float = 300.0) -> None:
    """Wait while a first run's fused blocks still compile in the background (tinyllm/kernels/warmup.py: its helper
    holds a lock file while it compiles; older checkouts named it tinyllm-threaded-*), so that they do not share the
    cores with the next measurement. A lock that names a process no longer running (a helper killed) is not waited
    for."""
    import tempfile
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_compiling(lock) for pattern in (
            "tinyllm-blocks-*.lock", "tinyllm-threaded-*.lock") for lock in Path(tempfile.gettempdir()).glob(pattern)):
        time.sleep(0.5)


def _compiling(lock: Path) -> bool:
    """Whether a helper's lock file stands for a compile still going: it names a live process, or no process (an
    older checkout's locks, or one being written)."""
    try:
        text = lock.read_text().strip()
    except OSError:
        return False
    if not text.isdigit():
        return True
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def machine_info() -> dict:
    """CPU model and instruction set, cores, and the versions that decide speed."""
    import numba
    import numpy as np
    from threadpoolctl import threadpool_info

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
        family = re.search(r"CPU family:\s*(\d+)", lscpu)
        model = re.search(r"^Model:\s*(\d+)", lscpu, re.M)
        if family and model:
            cpu += f" (family {family.group(1)} model {model.group(1)})"
    except (OSError, AttributeError):
        cpu = platform.processor() or "unknown"
    flags = cpu_flags()
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    blas = next((f"{i['internal_api']} {i['version']} ({i.get('architecture', '?')})" for i in threadpool_info()
                 if i["user_api"] == "blas"), "unknown")
    return dict(cpu=cpu, isa=isa, cores=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
                numba=numba.__version__, blas=blas)


def machine_line(m: dict) -> str:
    isa = f", {m['isa']}" if m.get("isa") else ""
    return (f"{m['cpu']}{isa}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']} ({m['blas']}), "
            f"numba {m['numba']}")


def slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def plain(value):
    """numpy scalars and arrays, tuples and the like as JSON sees them."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def write_json(name: str, data, command: str | None = None) -> Path:
    """Save one benchmark's measurements as benchmarks/<name>.<cpu kind>.json and regenerate RESULTS.md and the
    README's blocks from every file. A list is wrapped as {"rows": data}; the machine is recorded if absent."""
    data = dict(rows=data) if isinstance(data, list) else dict(data)
    data.setdefault("machine", machine_info())
    if command:
        data["command"] = command
    path = HERE / f"{name}.{slug(data['machine'].get('isa') or UNRECORDED)}.json"
    path.write_text(json.dumps(data, indent=1, default=plain) + "\n")
    render()
    print(f"wrote {path.relative_to(HERE.parent)}; regenerated benchmarks/RESULTS.md", flush=True)
    return path


def replace_section(name: str = "", body: str = "", path: Path = RESULTS) -> None:
    """Kept for scripts not yet moved to write_json: regenerates the page from the JSON files (the body is ignored:
    RESULTS.md holds only what the JSON files give)."""
    render()


# --- reading the files --------------------------------------------------------------------------------------------
def kind_of(data) -> str:
    m = data.get("machine") if isinstance(data, dict) else None
    if isinstance(m, dict) and m.get("isa"):
        return m["isa"]
    return UNRECORDED


def load(name: str) -> list[tuple[str, dict]]:
    """[(cpu kind, data)] for a benchmark: the files of known kinds, and the old unkinded file (measured on
    AVX-512 VNNI machines before the kind was recorded) until an AVX-512 VNNI file replaces it."""
    found = []
    for path in sorted(HERE.glob(f"{name}.*.json")):
        if path.name.count(".") == 2:                              # name.kind.json, not name_other.json
            data = json.loads(path.read_text())
            found.append((kind_of(data), data))
    if all(kind != "AVX-512 VNNI" for kind, _ in found) and (HERE / f"{name}.json").exists():
        data = json.loads((HERE / f"{name}.json").read_text())
        found.append((kind_of(data if isinstance(data, dict) else {}), data))
    order = {UNRECORDED: 0, "AVX-512 VNNI": 0, "AVX2": 1}
    return sorted(found, key=lambda kd: order.get(kd[0], 2))


def machine_of(data) -> str | None:
    if not isinstance(data, dict):
        return None
    m = data.get("machine") or data.get("meta", {}).get("machine")
    return machine_line(m) if isinstance(m, dict) else m


def command_of(data, default) -> str:
    """The command a file records, else `default` (a string, or a function of the data for files that record
    only their settings)."""
    if callable(default):
        return default(data)
    if isinstance(data, dict):
        cmd = data.get("command") or data.get("meta", {}).get("command")
        if cmd:
            return re.sub(r"\s--(write|render)\b", "", cmd).strip()
    return default


# --- formatting ---------------------------------------------------------------------------------------------------
def table(head: list[str], rows: list[list], right: int = 1) -> list[str]:
    """A markdown table; columns from `right` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(head))]
    return ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def n(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def pct(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def ms(seconds) -> str:
    return n(seconds * 1e3)


def not_measured(command: str) -> list[str]:
    return [f"not measured yet: run `{command}`"]


def per_kind(name: str, command: str, render_one) -> list[str]:
    """A section's body: the command, then its tables; with files of several CPU kinds, side by side."""
    entries = load(name)
    if not entries:
        return not_measured(command if isinstance(command, str) else command({}))
    bodies = [[f"`{command_of(data, command)}`", ""] + render_one(data) for _, data in entries]
    return bodies[0] if len(bodies) == 1 else side_by_side([kind for kind, _ in entries], bodies)


def blocks(lines: list[str]) -> list[list[str]]:
    """Consecutive table lines as one block, every other line a block of its own."""
    out: list[list[str]] = []
    for line in lines:
        if line.startswith("|") and out and out[-1][0].startswith("|"):
            out[-1].append(line)
        else:
            out.append([line])
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def side_by_side(kinds: list[str], bodies: list[list[str]]) -> list[str]:
    """Several kinds' renderings of one section as one: equal lines once, differing prose once per kind, and each
    table once with its rows matched by their left-aligned (key) columns, a cell "a · b" where the kinds differ."""
    parts = [blocks(b) for b in bodies]
    shapes = [[len(b) > 1 or b[0].startswith("|") for b in p] for p in parts]
    if any(s != shapes[0] for s in shapes):                        # not the same layout: one after the other
        return [line for kind, body in zip(kinds, bodies) for line in [f"**{kind}**", ""] + body + [""]][:-1]
    out = []
    for group in zip(*parts):
        if not group[0][0].startswith("|"):
            lines = [g[0] for g in group]
            out.append(lines[0] if len(set(lines)) == 1 else " ".join(f"**{k}**: {x}" for k, x in zip(kinds, lines)))
            continue
        head, align = cells(group[0][0]), cells(group[0][1])
        keys = [i for i, a in enumerate(align) if not a.endswith(":")]
        rows: dict[tuple, list[list[str] | None]] = {}
        for j, g in enumerate(group):
            for line in g[2:]:
                c = cells(line)
                rows.setdefault(tuple(c[i] for i in keys), [None] * len(group))[j] = c
        merged = []
        for key, per in rows.items():
            row = []
            for i in range(len(head)):
                if i in keys:
                    row.append(key[keys.index(i)])
                    continue
                values = ["-" if p is None or i >= len(p) else p[i] for p in per]
                row.append(values[0] if len(set(values)) == 1 else " · ".join(values))
            merged.append(row)
        head[0] = f"{head[0]} ({' · '.join(kinds)})"
        out += ["| " + " | ".join(head) + " |", group[0][1]] + ["| " + " | ".join(r) + " |" for r in merged]
    return out


# --- the sections -------------------------------------------------------------------------------------------------
FORMATS = ["fp32", "int8", "int8-block", "q4_1", "native", "int8+a8", "int8-block+a8", "q4_1+a8", "native+a8"]


def decode_section() -> list[str]:
    def one(r):
        h, bw = r["headline"], r["bandwidth_gbs"][str(r["threads"])]
        rows = [[f, n(v["weight_mb"]), n(v["bytes_per_token_mb"], 1), n(v["decode_tok_s"], 1),
                 f"{v['speedup_vs_fp32']:.2f}x", n(v["achieved_gbs"], 1), pct(v["bw_fraction"]),
                 n(v["ceiling_tok_s"]), n(v["prefill_tok_s"]), pct(v["prefill_peak_fraction"])] for f, v in h.items()]
        ctx = r["context"]
        contexts = list(next(iter(ctx.values())))
        peak = r["sgemm_gflops"]
        out = [f"Batch 1, {r.get('context_tokens', 256)} tokens of context, {r['threads']} threads. Measured in the "
               f"same run: read bandwidth {bw:.1f} GB/s ({r['bandwidth_gbs']['1']:.1f} with one thread), sgemm "
               + ", ".join(f"{v:.0f} GFLOP/s at {k}" for k, v in peak.items()) + ". The roof is that bandwidth "
               f"over the bytes a step reads (weights and K/V); prefill: a {r.get('prompt_tokens', 128)}-token "
               "prompt, against the sgemm peak.", ""]
        out += table(["format", "weights MB", "read per token MB", "decode tok/s", "vs fp32", "GB/s",
                      "of bandwidth", "roof tok/s", "prefill tok/s", "of sgemm peak"], rows)
        out += ["", "Decode tok/s against the context (batch 1; each cached token adds "
                f"{r['kv_bytes_per_token']:,} bytes of float32 K and V to a step's read):", ""]
        out += table(["format"] + [f"S={c}" for c in contexts],
                     [[f] + [n(v[c], 1) for c in contexts] for f, v in ctx.items()])
        t = r["threads_sweep"]
        counts = list(t)
        out += ["", f"Decode tok/s with {' / '.join(counts)} threads (context 256): "
                + ", ".join(f"{f} " + " / ".join(n(t[c][f], 1) for c in counts) for f in t[counts[0]])
                + f". The fixed cost of a step, paid whatever the format (the same code path over {r['n_layers']} "
                f"layers of dim-64 matrices): {r['fixed_step_ms']:.2f} ms."]
        return out
    return (["## How fast is decode, per weight format, against the memory roof", ""]
            + per_kind("roofline", "python benchmarks/roofline.py", one)
            + ["", "`+a8`: the same weights with `activations=\"int8\"` (each linear's input rounded to int8 blocks, "
               "integer dot products). `native`: the file's own Q4_1/Q8_0 blocks. What the kernels do about these "
               "figures: [docs/design/kernels.md](../docs/design/kernels.md).", "", "### Where a step's time goes", ""]
            + per_kind("step_timeline", "python benchmarks/step_timeline.py", step_timeline))


def step_timeline(r) -> list[str]:
    kernels = ["wqkv", "attention", "wo", "w_in", "w_out", "head"]
    cached = all("cached_ms" in x for x in r["rows"])          # (older files lack them)
    rows = [[x["format"], x["context"], n(x["step_ms"], 2), n(x["outside_ms"], 2), n(x["glue_ms"], 2)]
            + ([n(x["cached_ms"], 2), n(x["layers_read_ms"], 2)] if cached else [])
            + [f"{n(x['kernel_ms'][k], 2)} ({n(x['kernel_gbs'][k])})" for k in kernels]
            + [n(x["step_gbs"], 1), pct(x["of_bandwidth"]), pct(x["of_plain_read"])] for x in r["rows"]]
    return ([f"Batch 1, ms per step (median of {r['rounds']} rounds), each kernel's GB/s in brackets; read "
             f"bandwidth {r['bandwidth_gbs']:.1f} GB/s; `plain read`: the same bytes read in a step's pattern "
             "with nothing computed, timed back to back with the step."
             + (" `blocks, weights cached`: the 30 blocks with every layer given layer 0's weights, which stay in "
                "the CPU's caches (their arithmetic, little to read); `layers' read`: their 30 layers' weights read "
                "at the plain read's speed. Where the first comes near the second, a step is bound by arithmetic "
                "as much as by memory." if cached else ""), ""]
            + table(["format", "context", "step ms", "outside", "glue"]
                    + (["blocks, weights cached", "layers' read"] if cached else []) + kernels
                    + ["step GB/s", "of bandwidth", "of plain read"], rows, right=2))


def llamacpp_section() -> list[str]:
    def one(r):
        res = r["results"]
        cols = [(file, setting) for file, settings in res.items() for setting in settings]
        tests = list(next(iter(next(iter(res.values())).values())))
        rows = [[t] + [f"{n(res[f][s][t][1])} / {n(res[f][s][t][0])} = **{res[f][s][t][1] / res[f][s][t][0]:.2f}**"
                       for f, s in cols] for t in tests]
        return ([f"tok/s, tinyllm / llama.cpp = ratio (above 1: tinyllm is faster); {r['meta']['threads']} threads "
                 f"each, medians of "
                 f"{r['meta']['rounds']} alternating rounds; llama.cpp's KV cache float16, tinyllm's "
                 f"{r['meta']['kv']}. `ppN`: a prompt of N tokens; `tg64`: 64 tokens decoded (`@d2048`: after "
                 "2,048); `batch B`: B sequences decoding together.", ""]
                + table(["test"] + [f"{f} file / tinyllm {s}" for f, s in cols], rows))
    return (["## How far from llama.cpp", "",
             "The same GGUF file in both (F32 and Q8_0 made from it by llama-quantize); building llama.cpp: "
             "[docs/benchmarks.md](../docs/benchmarks.md).", ""]
            + per_kind("vs_llamacpp", "python benchmarks/vs_llamacpp.py --llama-bench PATH --llama-batched-bench "
                       "PATH --write", one))


def prefill_section() -> list[str]:
    def long(r):
        rows = r["rows"] if isinstance(r, dict) else r
        quants = list(dict.fromkeys(x["quant"] for x in rows))
        lengths = list(dict.fromkeys(x["prompt_tokens"] for x in rows))
        get = {(x["quant"], x["way"], x["prompt_tokens"]): x for x in rows}
        body = []
        for T in lengths:
            line = [n(T)]
            for q in quants:
                for way in ("chunked", "one pass"):
                    x = get.get((q, way, T))
                    line.append("-" if x is None else f"{n(x['ttft_ms'])} ({n(x['peak_extra_mib'], 1)})")
            body.append(line)
        return (["TTFT in ms (peak extra memory in MiB) of a prefill of random ids; `chunked`: `model.prefill`, "
                 "chunks of 128 tokens with tiled attention; `one pass`: the whole prompt at once, attention in "
                 "numpy over the full score matrix (`-`: not run at that length).", ""]
                + table(["prompt tokens"] + [f"{q} {w}" for q in quants for w in ("chunked", "one pass")], body))
    return (["## Prefill and long prompts", ""]
            + per_kind("long_prompts", "python benchmarks/long_prompts.py", long)
            + ["", "![TTFT and peak memory against prompt length](long_prompts.png)"])


def batching_section() -> list[str]:
    def batch(r):
        fmts = list(r["batch"])
        sizes = list(r["batch"][fmts[0]])
        rows = [[b] + [f"{n(r['batch'][f][b]['total_tok_s'])} ({n(r['batch'][f][b]['step_ms'], 1)} ms)"
                       for f in fmts] for b in sizes]
        return (["Decode over a paged KV cache, context 256 per sequence: total tok/s (step time = ITL per user). "
                 "One read of the weights serves the whole batch.", ""]
                + table(["batch"] + fmts, rows))

    def policies(r):
        keys = ["throughput", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "steps"]

        def cells(x):
            return [n(x["throughput"], 1), ms(x["ttft_p50_s"]), ms(x["ttft_p95_s"]), ms(x["itl_p50_s"]),
                    ms(x["itl_p95_s"]), x["steps"]]
        assert keys
        rows = [["12 requests at t=0, 4 slots", p] + cells(r["picture"][p]) for p in ("static", "continuous")]
        for name, w in r["poisson"].items():
            for slots, v in w["by_slots"].items():
                for p in ("static", "continuous"):
                    rows.append([f"{w['n']} Poisson requests at {w['rate']:g}/s, {name} lengths, {slots} slots", p]
                                + cells(v["results"][p]))
        out = [f"fp32 weights, paged KV cache of {r['kv_memory']}; each row the better of its policy's rounds. "
               "Slot timelines of the first workload: `batching_timeline.png`.", ""]
        out += table(["workload", "policy", "tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms",
                      "steps"], rows, right=2)
        sw, roof = r["sweep"], r["roof_step_ms"]
        out += ["", f"Batch size against the roof (context {r['context']}; roof = max(bytes / "
                f"{r['bandwidth_gbs']:.1f} GB/s, FLOPs / {r['sgemm_gflops']:.0f} GFLOP/s), both measured in the run; "
                f"KV budget {r['kv_memory']} holds {r['kv_batch_limit']} sequences of this length):", ""]
        b1 = sw["1"]["total_tok_s"]
        out += table(["batch", "step ms", "total tok/s", "vs batch 1", "roof step ms", "roof vs batch 1"],
                     [[b, n(v["step_ms"], 1), n(v["total_tok_s"], 1), f"{v['total_tok_s'] / b1:.1f}x",
                       n(roof[b], 1), f"{roof['1'] * int(b) / roof[b]:.1f}x"] for b, v in sw.items()])
        wb = r["waste"]["by_block"]
        first = next(iter(wb.values()))
        out += ["", f"KV memory allocated but empty ({r['waste']['n']} requests with prompts of 128..512 tokens): "
                "paged " + ", ".join(f"{pct(v['paged'], 1)} with blocks of {b}" for b, v in wb.items())
                + f"; contiguous, reserved per request {pct(first['contiguous_request'], 1)}, reserved at the full "
                f"context {pct(first['contiguous_context'], 1)}. The prefill chunk cap against the ITL tail:", ""]
        out += table(["prompt tokens per request per step", "ITL p50 / p95 / p99 ms", "TTFT p50 / p95 ms",
                             "tok/s"],
                            [[k, f"{ms(v['itl_p50_s'])} / {ms(v['itl_p95_s'])} / {ms(v['itl_p99_s'])}",
                              f"{ms(v['ttft_p50_s'])} / {ms(v['ttft_p95_s'])}", n(v["throughput"], 1)]
                             for k, v in r["prefill_cap"].items()])
        return out

    def serving(r):
        s = r["settings"]
        rows = [[x["rate"], f"{x['completed']}/{x['requests']}", n(x["output_throughput"], 1),
                 f"{ms(x['ttft_s']['p50'])} / {ms(x['ttft_s']['p95'])}",
                 f"{n(x['itl_s']['p50'] * 1e3, 1)} / {n(x['itl_s']['p95'] * 1e3, 1)}",
                 n(x["e2e_s"]["p95"], 2)] for x in r["sweep"]]
        out = [f"Server: `scripts/serve.py {' '.join(s['server_args'])}`; {s['num_requests']} requests per point, "
               f"Poisson arrivals, prompts {s['prompt_len'][0]}..{s['prompt_len'][1]} tokens, outputs "
               f"{s['output_len'][0]}..{s['output_len'][1]}, greedy, at most {s['max_concurrency']} in flight; "
               "the client runs on the same cores.", ""]
        out += table(["rate req/s", "ok", "out tok/s", "TTFT p50 / p95 ms", "ITL p50 / p95 ms", "e2e p95 s"], rows)
        p = r["policies"]
        out += ["", f"Static against continuous scheduling at {p['static']['rate']:g} req/s:", ""]
        out += table(["policy", "out tok/s", "TTFT p95 ms", "ITL p95 ms", "e2e p95 s"],
                     [[k, n(v["output_throughput"], 1), ms(v["ttft_s"]["p95"]), n(v["itl_s"]["p95"] * 1e3, 1),
                       n(v["e2e_s"]["p95"], 2)] for k, v in p.items()])
        med = lambda xs: sorted(xs)[len(xs) // 2]                  # noqa: E731
        runs = r["overhead"]                                       # one per thread count, the same on both sides

        def each(key, fmt="{:.1f}", of=med):                       # "x / y": one figure per thread count
            return " / ".join(fmt.format(of(o[key])) for o in runs)
        out += ["", f"One greedy stream of {runs[0]['tokens']} tokens with {each('threads', '{}', int)} threads "
                f"(median of {runs[0]['rounds']} alternating rounds, server and in-process on the same threads): "
                f"{each('http_tok_s')} tok/s through HTTP, {each('generate_tok_s')} with `tinyllm.generate` "
                f"in-process (**{each('ratio', '{:.2f}x', float)}**), {each('engine_tok_s')} with the Engine "
                "in-process."]
        return out
    return (["## Batching and serving", ""]
            + per_kind("roofline", "python benchmarks/roofline.py", batch)
            + ["", "### Static and continuous batching", ""]
            + per_kind("batching", "python benchmarks/batching.py", policies) + ["", "### Over HTTP", ""]
            + per_kind("serving", serving_command, serving)
            + ["", "![rate sweep](serving.png)"])


def serving_command(r) -> str:
    if not r.get("settings"):
        return "python benchmarks/load.py report"
    if r.get("command"):
        return command_of(r, "")
    s = r["settings"]
    return " ".join(["python benchmarks/load.py report", f"--num-requests {s['num_requests']}"]
                    + [f"--server-arg={a}" for a in s["server_args"]])


def experiments_section() -> list[str]:
    def one(r):
        pre, pm = r["prefix"], r["preemption"]
        hit = [v for v in pm["requests"].values() if v["preemptions"]]
        calm = [v for v in pm["requests"].values() if not v["preemptions"]]
        return [f"fp32 weights, {r['threads']} threads.", "",
                "- Sampling: choosing a token took " + ", ".join(f"{x['sample_ms']:.2f} ms ({x['setting']})"
                                                                  for x in r["sampling"])
                + f", against a decode step of {r['sampling'][0]['step_ms']:.1f} ms.",
                f"- Prefix caching, a shared 500-token system prompt: the second request's TTFT "
                f"{pre['without cache']:.0f} ms without the prefix cache, {pre['with cache']:.0f} ms with it.",
                f"- Preemption, 4 requests of 40 + 60 tokens on a pool of {pm['pool_blocks']} blocks of 16 (each needs "
                f"7): {pm['preemptions']} preemptions; the longest gap between two tokens "
                + ", ".join(f"{v['itl_max_ms']:.0f}" for v in hit) + " ms for the preempted requests, "
                + ", ".join(f"{v['itl_max_ms']:.0f}" for v in calm) + " ms for the others (ITL p50 "
                f"{min(v['itl_p50_ms'] for v in pm['requests'].values()):.1f}-"
                f"{max(v['itl_p50_ms'] for v in pm['requests'].values()):.1f} ms)."]
    return (["## Sampling cost, prefix caching, preemption", ""]
            + per_kind("experiments", "python benchmarks/experiments.py", one))


def quality_section() -> list[str]:
    def one(r):
        ref = r["fp32"]
        rows = [["fp32", n(ref["weight_mb"]), "-", "-", "-", "-", n(ref["ppl"], 3)]]
        for f, v in r.items():
            if isinstance(v, dict) and "top1" in v and f != "int8_parts":
                rows.append([f, n(v["weight_mb"]), pct(v["top1"], 2), f"{v['kld_mean']:.5f}", f"{v['kld_p99']:.4f}",
                             n(v["max_logit_err"], 3), n(v["ppl"], 3)])
        positions = next(v["positions"] for v in r.values() if isinstance(v, dict) and "positions" in v)
        out = [f"Against fp32 over {n(positions)} positions (`benchmarks/data/eval_text.txt` and the reference "
               "prompts of tests/fixtures); perplexity over the text alone. `q4_1` keeps the output head at "
               "int8-block (the default); `4-bit head` quantizes it too.", ""]
        out += table(["format", "weights MB", "top-1 agreement", "mean KLD", "p99 KLD", "max logit error",
                      "perplexity"], rows)
        parts = r.get("int8_parts", {})
        if parts:
            out += ["", "Where int8 per-row's error comes from (the fp32 model with some matrices replaced by their "
                    "int8 round trip):", ""]
            out += table(["int8 per row on", "top-1 agreement", "mean KLD", "p99 KLD"],
                         [[k, pct(v["top1"], 2), f"{v['kld_mean']:.5f}", f"{v['kld_p99']:.4f}"]
                          for k, v in parts.items()])
        return out
    return (["## Quality per format", ""]
            + per_kind("quality", "NUMBA_NUM_THREADS=1 python benchmarks/quality.py --threads 1", one))


def kv_section() -> list[str]:
    def quality(r):
        paths = list(dict.fromkeys(x["path"] for x in r["rows"]))
        got = {(x["kv_format"], x["path"]): x for x in r["rows"]}
        rows = [[fmt, n(got[fmt, paths[0]]["bytes_per_token"])]
                + [f"{got[fmt, p]['kld_mean']:.2e} / {got[fmt, p]['kld_p99']:.2e} / {pct(got[fmt, p]['top1'], 2)}"
                   if (fmt, p) in got else "-" for p in paths]
                for fmt in dict.fromkeys(x["kv_format"] for x in r["rows"])]
        out = ["Against the float32 cache, fp32 weights, `benchmarks/data/eval_text.txt` in chunks of 512 tokens; "
               "each cell: mean KLD / p99 KLD / top-1 agreement. "
               + " ".join(f"Greedy continuations of the {g['prompts']} reference prompts ({g['tokens']} tokens) with "
                          f"{g['kv_format']}: {g['same']} of {g['prompts']} identical to the float32 cache's."
                          for g in r.get("greedy", [])), ""]
        return out + table(["KV format", "bytes/token"] + paths, rows)

    def speed(r):
        fmts = list(dict.fromkeys(x["kv_format"] for x in r["rows"]))
        keys = list(dict.fromkeys((x["weights"], x["context"]) for x in r["rows"]))
        got = {(x["weights"], x["context"], x["kv_format"]): x for x in r["rows"]}
        rows = [[w, n(c)] + [f"{n(got[w, c, d]['tok_s'], 1)} ({got[w, c, d]['vs_float32']:.2f}x of "
                             f"{got[w, c, d]['limit']:.2f}x)" if (w, c, d) in got else "-" for d in fmts]
                for w, c in keys]
        return (["Decode tok/s at batch 1 with the cache filled to the context; in brackets the speed against the "
                 "float32 cache, of the most a smaller cache can buy (the ratio if a step's time were its bytes, "
                 "weights + K/V).", ""]
                + table(["weights", "context"] + fmts, rows, right=2))
    return (["## KV cache formats", ""]
            + per_kind("kv_quality", "python benchmarks/kv_dtype.py --quality", quality) + [""]
            + per_kind("kv_speed", "python benchmarks/kv_dtype.py --speed --quant fp32,native,native+a8", speed))


def speculative_section() -> list[str]:
    def one(r):
        p = r["pass_ms"]
        out = [f"fp32 target, greedy, {r['new_tokens']} new tokens, {r['runs']} repetitions; every speculative run "
               "gave exactly the plain greedy tokens. alpha = accepted / drafted; c = a draft step / a target pass; "
               "expected = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); measured = decode tok/s over the mean of the "
               "plain runs beside it (median, min-max).", "",
               f"One pass: plain decode step {p['step']:.1f} ms; verify pass of k+1 tokens "
               + ", ".join(f"k={k}: {v:.1f} ms" for k, v in p["verify"].items()) + "; draft steps "
               + ", ".join(f"{k} {v:.1f} ms" for k, v in p["draft"].items()) + ".", ""]
        rows = [[x["task"], x["draft"], x["k"], f"{x['alpha']:.2f}", n(x["tokens_per_target_pass"], 2),
                 f"{x['cost_ratio']:.2f}", f"{x['expected']:.2f}x",
                 f"**{x['speedup']:.2f}x** ({x['speedup_range'][0]:.2f}-{x['speedup_range'][1]:.2f})",
                 n(x["ttft_ms"])] for x in r["rows"]]
        out += table(["task", "draft", "k", "alpha", "tok / target pass", "c", "expected", "measured",
                      "TTFT ms"], rows, right=2)
        sweep = r.get("sweep", [])
        if sweep:
            ks = sorted({x["k"] for x in sweep})
            pairs = list(dict.fromkeys((x["task"], x["draft"]) for x in sweep))
            got = {(x["task"], x["draft"], x["k"]): x for x in sweep}
            out += ["", "Measured speedup against k (alpha in brackets):", ""]
            out += table(["task", "draft"] + [f"k={k}" for k in ks],
                         [[t, d] + [f"{got[t, d, k]['speedup']:.2f}x ({got[t, d, k]['alpha']:.2f})"
                                    if (t, d, k) in got else "-" for k in ks] for t, d in pairs], right=2)
        return out
    return (["## Speculative decoding", ""]
            + per_kind("speculative", "python benchmarks/speculative.py --new-tokens 48 --runs 3", one))


def startup_section() -> list[str]:
    def one(r):
        rows = [[x["quant"], f"{x['mapped']['wall_s']:.2f} s", n(x["mapped"]["peak_mib"]),
                 f"{x['converting']['wall_s']:.2f} s", n(x["converting"]["peak_mib"]),
                 "-" if x.get("first_run_s") is None else f"{x['first_run_s']:.1f} s",
                 "-" if x.get("compile_s") is None else f"{x['compile_s']:.1f} s"] for x in r["rows"]]
        f = r["floor"]
        return (["A whole process of `scripts/generate.py --prompt Hi --max-new-tokens 1 --quant Q`; warm = Numba's "
                 f"cache filled (median of {r['runs']}); mapped = the converted model mapped from tinyllm's cache, "
                 "converting = `TINYLLM_CONVERTED=off`; first run = empty caches.", ""]
                + table(["weights", "warm, mapped", "peak MiB", "warm, converting", "peak MiB", "first run",
                         "compiling"], rows)
                + ["", f"The floor, a process that imports numpy and Numba and calls one cached parallel kernel: "
                   f"{f['wall_s']:.2f} s, peak {f['peak_mib']:.0f} MiB."])
    return ["## Startup", ""] + per_kind("startup", "python benchmarks/startup.py --first-run", one)


def contention_section() -> list[str]:
    def one(r):
        before = {(x["format"], x["competitors"]): x for x in r.get("before", [])}     # a run with --old
        llama = {(x["format"], x["competitors"]): x for x in r.get("llama", [])}       # a run with --llama-bench

        def beside(other, x):
            k = (x["format"], x["competitors"])
            return [f"{other[k]['tok_s']:.1f} / {other[k]['of_quiet']:.2f}" if k in other else "-"] if other else []
        rows = [[x["format"], x["competitors"], n(x["tok_s"], 1), f"{x['of_quiet']:.2f}"] + beside(llama, x)
                + beside(before, x) for x in r["results"]]
        return ([f"Decode at context 64 from the Python API, {r['threads']} threads allowed, beside N processes of two "
                 f"busy threads each; tok/s = steps over the time they took (stalled steps count), medians of "
                 f"{r['rounds']} rounds of {r['seconds']:g} s per condition, measured in turn; of quiet = the "
                 "median of each round's ratio to that round's quiet run.", ""]
                + table(["format", "busy processes", "tok/s", "of quiet"]
                        + (["llama.cpp (F32 / Q4_1 file): tok/s / of quiet"] if r.get("llama") else [])
                        + (["--old checkout: tok/s / of quiet"] if r.get("before") else []), rows, right=2))
    return (["## A busy machine", "",
             "Why the threads follow the machine: [docs/design/kernels.md](../docs/design/kernels.md#a-busy-machine).",
             ""] + per_kind("contention", "python benchmarks/contention.py --write", one))


def tokenizer_section() -> list[str]:
    def one(r):
        rows = [[x["text"], x["calls"], n(x["tinyllm_cold"], 2), n(x["tinyllm_warm"], 2), n(x["tokenizers_cold"], 2),
                 n(x["tokenizers_warm"], 2), f"{x['tinyllm_cold'] / x['tokenizers_cold']:.2f}",
                 f"{x['tinyllm_warm'] / x['tokenizers_warm']:.2f}"] for x in r["rows"]]
        return ([f"tinyllm's pure-Python BPE against Hugging Face `tokenizers` (Rust): MB/s of UTF-8 input, best of "
                 f"{r['repeats']}, one thread, vocab {r['vocab']}, tokenizers "
                 f"{r['tokenizers']}; both give the same ids. Cold = empty word caches.", ""]
                + table(["text", "calls", "tinyllm cold", "warm", "tokenizers cold", "warm", "ratio cold", "warm"],
                        rows, right=2))
    return (["## Tokenizer speed", ""]
            + per_kind("tokenizer", "python benchmarks/bench_tokenizer.py --repeats 3", one))


def transformers_section() -> list[str]:
    def one(r):
        rows = [[e["engine"], n(e["prefill"], 1), n(e["decode"], 1), n(e["itl_ms"], 2)] for e in r["engines"]]
        a, b = r["engines"]
        rows.append(["ratio", f"{a['prefill'] / b['prefill']:.2f}", f"{a['decode'] / b['decode']:.2f}",
                     f"{a['itl_ms'] / b['itl_ms']:.2f}"])
        return ([f"fp32 in both, {r['threads']} threads, a {r['prompt_tokens']}-token prompt and {r['new_tokens']} "
                 f"greedy steps, median of {r['runs']} runs; transformers {r['transformers']}, torch {r['torch']}; "
                 f"greedy tokens identical: {r['same_tokens']}/{r['total_tokens']}.", ""]
                + table(["engine", "prefill tok/s", "decode tok/s", "step ms"], rows))
    return (["## Against Hugging Face transformers", ""]
            + per_kind("vs_transformers", "python benchmarks/bench_vs_transformers.py", one))


SECTIONS = [decode_section, llamacpp_section, prefill_section, batching_section, contention_section,
            quality_section, speculative_section, startup_section, kv_section, tokenizer_section,
            transformers_section, experiments_section]
BENCHMARKS = ["roofline", "step_timeline", "vs_llamacpp", "long_prompts", "batching", "serving", "experiments",
              "contention", "quality", "kv_quality", "kv_speed", "speculative", "startup", "tokenizer",
              "vs_transformers"]


def machines() -> list[str]:
    seen: dict[str, set] = {}
    for name in BENCHMARKS:
        for kind, data in load(name):
            line = machine_of(data)
            seen.setdefault(kind, set()).add(line or "the machine not recorded in the file")
    out = []
    for kind, lines in seen.items():
        note = "" if kind != UNRECORDED else (
            " (files written before the scripts recorded the CPU's instruction set, from runs on AVX-512 VNNI "
            "machines by the notes of the time; a run on such a machine replaces them)")
        out.append(f"- {kind}{note}: " + "; ".join(sorted(lines)))
    return out


def results_page() -> str:
    out = ["# Measured results", "",
           "Generated by `python benchmarks/report.py` from the JSON files the benchmarks write "
           "(`benchmarks/*.json`); do not edit by hand. Each table names the command that measured it; run the "
           "command, then `python benchmarks/report.py`. The machines: shared 2-core VMs whose speed drifts by "
           "tens of percent from minute to minute, so the scripts interleave what they compare and report "
           "medians; compare ratios within a table, not absolute figures across tables. Where files of more than "
           "one kind of CPU exist, a cell holds each kind's figure, in the order the table's first column names "
           "them (one figure where they agree).",
           ""] + machines() + [""]
    for section in SECTIONS:
        out += section() + [""]
    return "\n".join(out).rstrip() + "\n"


# --- the README's blocks ------------------------------------------------------------------------------------------
def readme_decode() -> list[str]:
    entries = load("roofline")
    if not entries:
        return not_measured("python benchmarks/roofline.py")
    kind, r = entries[0]
    rows = [[f, n(v["weight_mb"]), n(v["decode_tok_s"]), n(v["ceiling_tok_s"]), n(v["prefill_tok_s"])]
            for f, v in r["headline"].items()]
    return ([f"Batch 1, context 256, {r['threads']} threads ({kind}; from `benchmarks/RESULTS.md`):", ""]
            + table(["format", "weights MB", "decode tok/s", "memory roof tok/s", "prefill tok/s (128 tokens)"], rows))


def readme_llamacpp() -> list[str]:
    entries = load("vs_llamacpp")
    if not entries:
        return not_measured("python benchmarks/vs_llamacpp.py --llama-bench PATH --write")
    kind, r = entries[0]
    rows = []
    for file, settings in r["results"].items():
        for setting, tests in settings.items():
            ratio = {t: v[1] / v[0] for t, v in tests.items()}
            rows.append([f"{file} / {setting}", f"{ratio['tg64']:.2f}x", f"{ratio['pp512']:.2f}x",
                         f"{ratio['batch 32']:.2f}x" if "batch 32" in ratio else "-"])
    return ([f"tinyllm's speed over llama.cpp's on the same file and threads (above 1: tinyllm faster; {kind}):", ""]
            + table(["llama.cpp file / tinyllm setting", "decode (tg64)", "prefill (pp512)", "batch 32"], rows))


README_BLOCKS = {"decode": readme_decode, "llamacpp": readme_llamacpp}


def fill_blocks(text: str) -> str:
    def block(m):
        name = m.group(1)
        if name not in README_BLOCKS:
            raise SystemExit(f"README.md: unknown report block {name!r} (known: {', '.join(README_BLOCKS)})")
        return f"<!-- report:{name} -->\n" + "\n".join(README_BLOCKS[name]()) + f"\n<!-- /report:{name} -->"
    return re.sub(r"<!-- report:([\w-]+) -->.*?<!-- /report:\1 -->", block, text, flags=re.S)


def generated() -> dict[Path, str]:
    out = {RESULTS: results_page()}
    if README.exists():
        out[README] = fill_blocks(README.read_text())
    return out


def render() -> None:
    for path, text in generated().items():
        path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md or the README's blocks are stale")
    args = p.parse_args(argv)
    if args.check:
        stale = [str(path.relative_to(HERE.parent)) for path, text in generated().items()
                 if not path.exists() or path.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python benchmarks/report.py", file=sys.stderr)
            return 1
        print("RESULTS.md and the README's blocks are what the JSON files give")
        return 0
    render()
    print(f"wrote {RESULTS.relative_to(HERE.parent)} ({len(results_page().splitlines())} lines) and the README's "
          "blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
