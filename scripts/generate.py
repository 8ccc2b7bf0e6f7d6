#!/usr/bin/env python
"""Generate text with tinyllm: streams the answer to stdout and a one-line summary of the run to stderr.

    python scripts/generate.py --prompt "What is the capital of France?"
    python scripts/generate.py --prompt "Once upon a time" --raw --temperature 0.8 --seed 1 --max-new-tokens 64
    python scripts/generate.py --prompt "2+2=" --raw --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")   # before numpy loads OpenBLAS: idle threads sleep (threads.py)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Exit codes: 0 done, 2 bad input (arguments, prompt, model file), 74 an I/O or system failure that is not the
# input's fault (output pipe closed, the default model cannot be fetched, out of memory; EX_IOERR of sysexits.h),
# 130 interrupted (Ctrl-C).
EXIT_BAD_INPUT, EXIT_IO_FAILURE, EXIT_INTERRUPTED = 2, 74, 130

try:                     # importing numpy and Numba takes a while: Ctrl-C then must not print a traceback
    import tinyllm  # noqa: E402
    from tinyllm.cli import DefaultsHelpFormatter  # noqa: E402
    from tinyllm import converted  # noqa: E402
    from tinyllm.hub import FetchError  # noqa: E402
except KeyboardInterrupt:
    print("\ninterrupted", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quant", default=None, choices=["fp32", "int8", "int8-block", "q4_1", "q4_k", "native"],
                   help="weight format: fp32 (default), int8 per row, int8 per block of 32, 4-bit q4_1 or q4_k, or "
                        "the file's own blocks")
    p.add_argument("--quant-head", default=None, choices=["fp32", "int8", "int8-block", "q4_1", "q4_k"],
                   help="format of the output head (the tied embedding) when quantizing; default: int8-block for "
                        "the 4-bit formats (a 4-bit head costs much more quality than 4-bit matrices), the matrices' own "
                        "otherwise")
    p.add_argument("--activations", default="float32", choices=["float32", "int8"],
                   help="with quantized weights: int8 rounds each linear's input to int8 blocks too and multiplies "
                        "in integers (llama.cpp's scheme: faster decode, slightly less exact)")
    p.add_argument("--backend", default="numba", choices=["numba", "numpy"],
                   help="numba kernels (fast) or plain numpy (readable, steppable)")
    p.add_argument("--kv", default="contiguous", choices=["contiguous", "paged"],
                   help="KV cache: one contiguous reservation, or blocks from a pool as the sequence grows")
    p.add_argument("--kv-memory", default=None,
                   help="with --kv paged: the KV pool's budget, e.g. 64MiB; a request that could outgrow it is refused")
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "int8"],
                   help="how the KV cache stores K and V: float16 halves its memory, int8 (with a scale per "
                        "position and head) needs about a quarter; rounded once, when stored")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (temperature > 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token (fixed output lengths for benchmarks)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) instead of streaming")
    p.add_argument("--threads", type=int, default=None, help="threads for BLAS and Numba (default: all cores)")
    p.add_argument("--speculative", default=None, metavar="SOURCE",
                   help="speculative decoding with a draft: draft=PATH, self-int8, self-q4, layers:N or ngram "
                        "(same output distribution; greedy output unchanged)")
    p.add_argument("--num-draft", type=int, default=4, help="tokens drafted per target pass (with --speculative)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # validate sampling and cache settings before the (slower) model load, so a typo fails at once
        params = tinyllm.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
        cache = tinyllm.CacheSpec(args.kv, args.kv_memory, args.kv_dtype)
        if args.threads is not None:
            tinyllm.set_threads(args.threads)
        t0 = time.perf_counter()
        model = tinyllm.load(args.model, quant=args.quant, backend=args.backend, activations=args.activations,
                             head_quant=args.quant_head)
        load_s = time.perf_counter() - t0
        draft, draft_s = args.speculative, 0.0
        if draft is not None:            # build the draft now (a self-draft quantizes and compiles for seconds)
            from tinyllm.speculative import make_draft
            t0 = time.perf_counter()
            draft = make_draft(model, draft)
            draft_s = time.perf_counter() - t0
        chat = not args.raw and model.tokenizer.effective_chat_template is not None
        kwargs = dict(max_new_tokens=args.max_new_tokens, params=params, cache=cache, stop=args.stop, chat=chat,
                      speculative=draft, num_draft=args.num_draft, ignore_eos=args.ignore_eos)
        if args.json:
            res = tinyllm.generate(model, args.prompt, **kwargs)
        else:
            s = tinyllm.stream(model, args.prompt, **kwargs)
            for piece in s:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            res = s.result
        if args.json:
            out = {"prompt_ids": res.prompt_ids, "token_ids": res.token_ids, "text": res.text,
                   "finish_reason": res.finish_reason, "load_s": load_s, "jit_s": model.jit_s,
                   "quant": model.quant, "activations": model.activations, "weight_bytes": model.weight_bytes,
                   "stats": res.stats.as_dict()}
            if draft is not None:
                out["draft_build_s"] = draft_s
            print(json.dumps(out), flush=True)
        else:
            acts = ", int8 activations" if model.activations == "int8" else ""
            built = f", draft built in {draft_s:.1f} s" if draft is not None else ""
            print(f"[{res.finish_reason}] load {load_s:.1f} s (JIT {model.jit_s:.1f} s{built}) | {model.quant} "
                  f"{model.weight_bytes / 2**20:.0f} MiB{acts} | {res.stats.summary()}", file=sys.stderr)
    except BrokenPipeError:                                 # e.g. `generate.py ... | head -c 10`
        _discard_stdout()
        print("error: the output was closed before the answer was written (broken pipe)", file=sys.stderr)
        return EXIT_IO_FAILURE
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_IO_FAILURE
    except MemoryError:
        print("error: out of memory; try a smaller --quant format, --kv-memory or --max-new-tokens", file=sys.stderr)
        return EXIT_IO_FAILURE
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ArithmeticError as e:                            # a compiled kernel met inf/NaN activations
        print(f"error: the model's arithmetic failed ({type(e).__name__}: {e}): its weights overflow float32; "
              f"the model file is corrupt or not made for this engine", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _exit_at_once(code: int) -> None:
    """Exit without the interpreter's teardown (freeing Numba's compiled code and some 600 modules took longer
    than a short run's work: benchmarks/RESULTS.md, "Startup"). Everything was written; stdout and stderr are
    flushed first, and a converted model still being written to tinyllm's cache is finished (or, after Ctrl-C,
    abandoned)."""
    converted.wait_for_saves(abandon=code == EXIT_INTERRUPTED)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):                       # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit_at_once(main())
