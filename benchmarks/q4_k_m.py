"""A real Q4_K_M file of the default model, made by llama.cpp, read by tinyllm: what it answers, whether the reading
is exact, and what its quantization costs against fp32, beside llama.cpp's own figures (a check, not a test).

    python benchmarks/q4_k_m.py --llama-quantize PATH [--llama-perplexity PATH] [--llama-simple PATH]

The default file (Q4_1) is re-quantized by llama-quantize to F32 and to Q4_K_M (vs_llamacpp.requantize, kept in
the temporary folder between runs). On the default model (rows of 576 values, not a multiple of 256) llama-quantize
falls back for most tensors: only ffn_down is Q4_K or Q6_K; q, k, o, gate and up are Q5_0, half the v and the
embedding Q8_0. Then:
  1. answers: the chat prompt "What is the capital of France?", greedy, by tinyllm on the F32, Q4_1 and Q4_K_M files
     (fp32 arithmetic, and native + int8 activations) and by llama-simple on the same files with the same rendered
     prompt; and the margin of the first token over the runner-up in tinyllm's fp32 logits on each file;
  2. exactness: tinyllm's logits on the Q4_K_M file (quant=None: dequantized by kquants.py; native: the kernels on
     the file's blocks) against reference.py's forward pass on weights dequantized by gguf-py (llama.cpp's own
     Python package);
  3. KLD against fp32: llama-perplexity --kl-divergence-base on the F32 file, then --kl-divergence on the Q4_K_M
     file (its chunks of --ctx tokens, the second half of each scored); tinyllm on the same tokens (read from the
     base file) and positions, native + int8 activations and quant=None, against its own fp32 and against the base
     file's log-probabilities.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS (threads.py)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tinyllm  # noqa: E402
from tinyllm import hub, reference  # noqa: E402
from tinyllm.gguf import GGUFFile  # noqa: E402
from quality import log_softmax  # noqa: E402
from vs_llamacpp import requantize  # noqa: E402

QUESTION = "What is the capital of France?"


# --- 1. answers -------------------------------------------------------------------------------------------------
def tinyllm_answer(path: Path, **load) -> str:
    m = tinyllm.load(path, **load)
    return tinyllm.generate(m, QUESTION, max_new_tokens=40, chat=True).text.strip()


def llama_answer(simple: Path, path: Path, prompt: str) -> str:
    """llama-simple's greedy continuation of the rendered chat prompt (its own special tokens parsed)."""
    r = subprocess.run([str(simple), "-m", str(path), "-n", "40", prompt], capture_output=True, text=True, check=True)
    return r.stdout.split(prompt.rstrip("\n")[-20:], 1)[-1].strip()


def first_token_margin(path: Path, ids: list) -> str:
    m = tinyllm.load(path)
    z = m.logits(ids)[-1]                                                   # [V]
    top = np.argsort(z)[::-1][:2]
    return " vs ".join(f"{m.tokenizer.decode([int(t)])!r} {z[t]:.3f}" for t in top)


# --- 2. exactness ------------------------------------------------------------------------------------------------
def gguf_py_weights(path: Path):
    """reference.py's (config, weights) of the file, every tensor dequantized by gguf-py instead of kquants.py."""
    import gguf as gguf_py

    real = GGUFFile.tensor

    def by_gguf_py(self, name):
        info = self.tensors[name]
        rows = self.raw(name).reshape(info.n_elements // info.shape[-1], -1)  # [rows, row bytes]
        kind = gguf_py.GGMLQuantizationType[info.type_name]
        return gguf_py.quants.dequantize(rows, kind).astype(np.float32).reshape(info.shape)
    GGUFFile.tensor = by_gguf_py
    os.environ["TINYLLM_CONVERTED"] = "off"                  # not a converted copy holding kquants.py's values
    try:
        return reference.load(path)
    finally:
        GGUFFile.tensor = real
        del os.environ["TINYLLM_CONVERTED"]


def exactness(path: Path, ids: list) -> dict:
    config, weights = gguf_py_weights(path)
    expected = reference.logits(config, weights, np.array(ids))             # [T, V]
    out = {}
    for label, load in {"quant=None (kquants.py)": {}, "native, float activations": dict(quant="native")}.items():
        got = tinyllm.load(path, **load).logits(ids)
        out[label] = float(np.abs(got - expected).max() / np.abs(expected).max())
    return out


# --- 3. KLD ------------------------------------------------------------------------------------------------------
def perplexity_tool(tool: Path, model: Path, text: Path, base: Path, ctx: int, make_base: bool) -> str:
    r = subprocess.run([str(tool), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", "2",
                        "--kl-divergence-base", str(base)] + ([] if make_base else ["--kl-divergence"]),
                       capture_output=True, text=True, check=True)
    return r.stdout + r.stderr


def read_base(base: Path):
    """llama-perplexity's base file -> (n_ctx, tokens [chunks, n_ctx], log-probs [chunks, positions, V] of the
    scored positions, decompressed from its 16-bit form: log p = scale * u + min, per position)."""
    raw = base.read_bytes()
    assert raw[:8] == b"_logits_", f"{base} is not a llama-perplexity base file"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_pos = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(raw, np.uint16, n_chunk * n_pos * nv, 20 + 4 * n_chunk * n_ctx).reshape(-1, nv)
    head = rows[:, :4].copy().view(np.float32)                              # [chunks * positions, 2]: scale, min
    logp = head[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float32) + head[:, 1:2]
    return int(n_ctx), tokens, logp.reshape(n_chunk, n_pos, n_vocab)


def scored_logits(model, tokens: np.ndarray, n_ctx: int) -> np.ndarray:
    """The logits of llama-perplexity's scored positions (n_ctx/2 .. n_ctx-2 of each chunk) -> [chunks, pos, V]"""
    return np.stack([model.logits(list(map(int, chunk)))[n_ctx // 2:n_ctx - 1] for chunk in tokens])


def kld(ref_logp: np.ndarray, logits: np.ndarray, cutoff: bool = False) -> float:
    """mean KL(p_ref || p) over positions; cutoff: leave out p_ref below e^-16, as llama-perplexity does."""
    lq = log_softmax(logits.reshape(-1, logits.shape[-1]))
    lp = ref_logp.reshape(lq.shape).astype(np.float64)
    terms = np.exp(lp) * (lp - lq)
    if cutoff:
        terms = np.where(lp > -16, terms, 0)
    return float(terms.sum(-1).mean())


def main(argv=None) -> int:
    from report import no_background_compiles
    no_background_compiles()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-quantize", type=Path, required=True)
    ap.add_argument("--llama-perplexity", type=Path, help="default: next to llama-quantize")
    ap.add_argument("--llama-simple", type=Path, help="default: next to llama-quantize")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity's chunk length")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    tools = {name: getattr(args, f"llama_{name}") or args.llama_quantize.with_name(f"llama-{name}")
             for name in ("perplexity", "simple")}
    tinyllm.set_threads(args.threads)
    source = Path(hub.ensure_default_model())
    work = Path(tempfile.gettempdir()) / "tinyllm-vs-llamacpp"
    work.mkdir(exist_ok=True)
    files = {"F32": requantize(args.llama_quantize, source, "F32", work), "Q4_1": source,
             "Q4_K_M": requantize(args.llama_quantize, source, "Q4_K_M", work)}
    kinds = {}
    for info in GGUFFile(files["Q4_K_M"]).tensors.values():
        kinds[info.type_name] = kinds.get(info.type_name, 0) + 1
    print(f"Q4_K_M file: {files['Q4_K_M']} ({files['Q4_K_M'].stat().st_size / 2**20:.1f} MiB), tensor types {kinds}")

    m = tinyllm.load(files["Q4_K_M"])
    ids = m.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    prompt = m.tokenizer.decode(ids)
    print(f"\n## 1. Answers to {QUESTION!r} (chat template, greedy)\n")
    for kind, path in files.items():
        print(f"{kind} file, first token (tinyllm fp32 logits): {first_token_margin(path, ids)}")
        print(f"  tinyllm fp32:        {tinyllm_answer(path)!r}")
        if kind != "F32":                                                   # (float weights: nothing native)
            print(f"  tinyllm native+a8:   {tinyllm_answer(path, quant='native', activations='int8')!r}")
        print(f"  llama.cpp (simple):  {llama_answer(tools['simple'], path, prompt)!r}")

    print("\n## 2. tinyllm's logits on the Q4_K_M file against gguf-py's dequantization + reference.py\n")
    for label, err in exactness(files["Q4_K_M"], ids).items():
        print(f"  {label}: max |difference| / max |logit| = {err:.2e}")

    print(f"\n## 3. KLD against fp32 (llama-perplexity's chunks of {args.ctx} tokens of eval_text.txt)\n")
    text, base = ROOT / "benchmarks" / "data" / "eval_text.txt", work / f"eval_text.F32.c{args.ctx}.kld"
    perplexity_tool(tools["perplexity"], files["F32"], text, base, args.ctx, make_base=True)
    log = perplexity_tool(tools["perplexity"], files["Q4_K_M"], text, base, args.ctx, make_base=False)
    theirs = float(re.search(r"Mean\s+KLD:\s+([-\d.]+)", log).group(1))
    n_ctx, tokens, base_logp = read_base(base)
    fp32 = log_softmax(scored_logits(tinyllm.load(files["F32"]), tokens, n_ctx).reshape(-1, base_logp.shape[-1]))
    print(f"  positions: {tokens.shape[0]} chunks x {base_logp.shape[1]}; llama.cpp Q4_K_M: mean KLD {theirs:.6f}")
    for label, load in {"native+a8": dict(quant="native", activations="int8"), "fp32 arithmetic": {}}.items():
        got = scored_logits(tinyllm.load(files["Q4_K_M"], **load), tokens, n_ctx)
        print(f"  tinyllm {label}: mean KLD {kld(fp32, got):.6f} against its own fp32, "
              f"{kld(base_logp, got, cutoff=True):.6f} against llama.cpp's base log-probs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
