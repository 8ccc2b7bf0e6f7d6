"""scripts/generate.py as a user runs it: streamed text on stdout, one summary line on stderr, and one-line
errors with exit code 2 for bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_gguf import tiny_llama

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"


def run(*args, model=None):
    argv = [sys.executable, str(SCRIPT), *args] + (["--model", str(model)] if model else [])
    return subprocess.run(argv, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    tiny_llama(p)
    return p


def test_streams_and_summarises(tiny_path):
    r = run("--prompt", "hello", "--raw", "--max-new-tokens", "8", "--temperature", "1", "--seed", "0",
            model=tiny_path)
    assert r.returncode == 0, r.stderr
    summary = r.stderr.decode().strip().splitlines()[-1]
    for field in ("prompt", "generated", "TTFT", "prefill", "decode", "ITL mean", "p95"):
        assert field in summary


def test_json_output(tiny_path):
    r = run("--prompt", "hello", "--raw", "--json", "--max-new-tokens", "4", "--threads", "1", model=tiny_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["prompt_tokens"] == len(out["prompt_ids"]) and len(out["token_ids"]) <= 4
    assert {"ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_s"} <= set(out["stats"])


def test_ignore_eos_gives_the_full_length(tiny_path):
    r = run("--prompt", "hello", "--raw", "--json", "--max-new-tokens", "30", "--temperature", "3", "--seed", "0",
            "--ignore-eos", model=tiny_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 30 and out["finish_reason"] == "length"


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "invalid temperature"),
    (["--top-p", "0"], "invalid top_p"),
    (["--threads", "999"], "invalid threads"),
    (["--max-new-tokens", "0"], "invalid max_new_tokens"),
    (["--activations", "int8"], "activations='int8' needs quantized weights"),
])
def test_bad_values_one_line_exit_2(tiny_path, args, message):
    r = run("--prompt", "hello", *args, model=tiny_path)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and message in err and len(err.splitlines()) == 1, err


def test_missing_model_one_line(tmp_path):
    r = run("--prompt", "hello", model=tmp_path / "nope.gguf")
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "no such file" in err and len(err.splitlines()) == 1


def test_prompt_longer_than_context(tiny_path):
    r = run("--prompt", "x " * 100, "--raw", model=tiny_path)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "context is 64" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(os.name != "posix", reason="raw argv bytes")
def test_non_utf8_prompt_bytes(tiny_path):
    argv = [sys.executable.encode(), str(SCRIPT).encode(), b"--prompt", b"caf\xe9", b"--raw",
            b"--model", str(tiny_path).encode()]
    r = subprocess.run(argv, capture_output=True, timeout=300)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "UTF-8" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_default_model_chat_answer():
    r = run("--prompt", "What is the capital of France?", "--max-new-tokens", "30")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout.decode()
    assert "[eos]" in r.stderr.decode()


def test_kv_memory_too_small_one_line(tiny_path):
    r = run("--prompt", "hello", "--raw", "--kv", "paged", "--kv-memory", "1KiB", model=tiny_path)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "KV memory" in err and len(err.splitlines()) == 1, err
