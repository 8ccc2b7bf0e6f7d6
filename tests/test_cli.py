"""scripts/generate.py as a user runs it: streamed text on stdout, one summary line on stderr, and one-line
errors with exit code 2 for bad input."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    assert r.returncode == 2 and message in err and len(error_lines(err)) == 1, err


def test_missing_model_one_line(tmp_path):
    r = run("--prompt", "hello", model=tmp_path / "nope.gguf")
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "no such file" in err and len(error_lines(err)) == 1


def test_prompt_longer_than_context(tiny_path):
    r = run("--prompt", "x " * 100, "--raw", model=tiny_path)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "context is 64" in err and len(error_lines(err)) == 1


@pytest.mark.skipif(os.name != "posix", reason="raw argv bytes")
def test_non_utf8_prompt_bytes(tiny_path):
    argv = [sys.executable.encode(), str(SCRIPT).encode(), b"--prompt", b"caf\xe9", b"--raw",
            b"--model", str(tiny_path).encode()]
    r = subprocess.run(argv, capture_output=True, timeout=300)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "UTF-8" in err and len(error_lines(err)) == 1, err


@pytest.mark.slow
def test_default_model_chat_answer():
    r = run("--prompt", "What is the capital of France?", "--max-new-tokens", "30")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout.decode()
    assert "[eos]" in r.stderr.decode()


def test_kv_memory_too_small_one_line(tiny_path):
    r = run("--prompt", "hello", "--raw", "--kv", "paged", "--kv-memory", "1KiB", model=tiny_path)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "KV memory" in err and len(error_lines(err)) == 1, err


# --- in-process calls of main(): fast (no interpreter start and numba import per case) -------------------------
@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("generate_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(cli, capsys, *args):
    """-> (exit code, stdout, stderr) of scripts/generate.py's main(args), run in this process."""
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:                      # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    """stderr's lines without the first-run compile notice (kernels/warmup.py's compile_notice), which precedes an
    error that comes after loading the model when the Numba cache is cold."""
    return [line for line in err.strip().splitlines()
            if not line.startswith(("tinyllm: compiling the Numba kernels", "tinyllm: kernels compiled in"))]


def assert_one_line_error(code, err, expected_code=2):
    lines = error_lines(err)
    assert code == expected_code and "Traceback" not in err, err
    assert len(lines) == 1 or lines[0].startswith("usage:"), err   # argparse prints usage, then one error line


def test_overflowing_weights_one_line_exit_2(cli, capsys, tmp_path):
    from test_corrupt_files import overflowing_model
    code, _, err = call(cli, capsys, "--prompt", "hello", "--raw", "--model", overflowing_model(tmp_path / "h.gguf"))
    assert_one_line_error(code, err)
    assert "overflow" in err


def test_huge_kv_memory_one_line_exit_2(cli, capsys, tiny_path):
    code, _, err = call(cli, capsys, "--prompt", "hello", "--raw", "--kv", "paged", "--kv-memory", "1TiB",
                        "--model", tiny_path)
    assert_one_line_error(code, err)
    assert "KV memory 1TiB cannot be allocated" in err


def test_quant_head_flag(cli, capsys, tmp_path):
    path = tmp_path / "t.gguf"
    tiny_llama(path, dim=64, ffn=64)
    code, out, err = call(cli, capsys, "--prompt", "hello", "--raw", "--json", "--max-new-tokens", "2",
                          "--quant", "q4_1", "--quant-head", "q4_1", "--model", path)
    assert code == 0, err and json.loads(out)["quant"] == "q4_1"
    code, _, err = call(cli, capsys, "--prompt", "hello", "--quant-head", "q4_1", "--model", path)
    assert_one_line_error(code, err)
    assert "needs quantized matrices" in err


def test_closed_output_pipe_exits_74(tiny_path):
    argv = [sys.executable, str(SCRIPT), "--prompt", "hello", "--raw", "--max-new-tokens", "40", "--model",
            str(tiny_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                                            # like `... | head -c 0`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 74, err
    assert "broken pipe" in err and "Traceback" not in err and len(error_lines(err)) == 1


def test_the_script_leaves_after_its_converted_model_is_written(tmp_path, monkeypatch):
    # generate.py exits with os._exit, which would cut the thread writing the converted model short
    path, folder = tmp_path / "m.gguf", tmp_path / "converted"
    tiny_llama(path)
    monkeypatch.setenv("TINYLLM_CONVERTED", str(folder))
    code = ("import runpy, sys, time\n"                        # a slow disk: the write ends after the generation
            f"sys.path.insert(0, {str(SCRIPT.parent.parent)!r})\n"
            "from tinyllm import converted\n"
            "save = converted.save\n"
            "converted.save = lambda *a: (time.sleep(2), save(*a))[1]\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--prompt', 'hello', '--raw', '--max-new-tokens', '1', '--model', "
            f"{str(path)!r}]\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (entry,) = folder.iterdir()                                    # one whole entry, no partial file
    assert entry.suffix == ".tinyllm"
    from tinyllm import converted
    assert converted.load(path, None, None) is not None


def test_ctrl_c_during_imports_exits_130_without_traceback():
    # A KeyboardInterrupt raised by `import tinyllm` itself, as Ctrl-C in the first half second would.
    code = ("import builtins, runpy, sys\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'tinyllm': raise KeyboardInterrupt\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--prompt', 'x']\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 130 and b"Traceback" not in r.stderr and b"interrupted" in r.stderr, r.stderr


FLAG_VALUES = {
    "--max-new-tokens": ["1", "3", "0", "-1", "2147483648", "1e3", "x", ""],
    "--temperature": ["0", "0.7", "1e-320", "-1", "nan", "inf", "1e309", "x"],
    "--top-k": ["0", "5", "-1", "99999999999999999999", "1.5"],
    "--top-p": ["1", "0.5", "0", "1.5", "nan"],
    "--min-p": ["0", "0.1", "-0.1", "2", "nan"],
    "--repetition-penalty": ["1", "1.2", "0", "-1", "inf"],
    "--seed": ["0", "7", "-1", "18446744073709551616", "x"],
    "--stop": ["", "l", "hello", "\x00"],
    "--threads": ["1", "0", "-2", "999"],
    "--quant": ["int8", "q4_1", "int8-block", "native", "fp16"],
    "--quant-head": ["q4_1", "fp32", "int4"],
    "--activations": ["float32", "int8", "int4"],
    "--backend": ["numpy", "numba", "cuda"],
    "--kv": ["contiguous", "paged", "ring"],
    "--kv-memory": ["64KiB", "1KiB", "0", "-5MiB", "1TiB", "lots", "1e3MiB"],
    "--speculative": ["ngram", "layers:1", "layers:0", "layers:x", "draft=", "self-q4", "nope"],
    "--num-draft": ["1", "4", "0", "-3", "10000"],
    "--prompt": ["hello", "", "<|im_end|>", "\udcff", "x" * 2000],
    "--model": [None, "", "/nonexistent.gguf", "/"],
}
SWITCHES = ["--raw", "--json"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(sorted(FLAG_VALUES)), st.integers(0, 7), max_size=5),
       switches=st.sets(st.sampled_from(SWITCHES)))
def test_fuzz_cli_flags_exit_codes(cli, capsys, tiny_path, flags, switches):
    args = ["--prompt", "hello", "--max-new-tokens", "3"]
    model = str(tiny_path)
    for flag, k in flags.items():
        value = FLAG_VALUES[flag][k % len(FLAG_VALUES[flag])]
        if flag == "--model":
            model = model if value is None else value
        else:
            args += [flag, value]
    code, out, err = call(cli, capsys, *args, *sorted(switches), "--model", model)
    assert code in (0, 2), (args, code, err)
    if code == 2:
        assert_one_line_error(code, err)
    else:
        assert "Traceback" not in err and ("--json" not in switches or json.loads(out)["token_ids"] is not None)


@pytest.mark.parametrize("script", ["generate.py", "serve.py"])
def test_help_says_each_default_once(script):
    r = subprocess.run([sys.executable, str(SCRIPT.parent / script), "--help"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    options = [line for line in r.stdout.splitlines() if "(default" in line]
    assert options and not [line for line in options if line.count("(default") > 1 or "(default: None)" in line]
    assert "(default: float32)" in r.stdout                            # a default the help does not state: shown
