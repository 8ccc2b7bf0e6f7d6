"""Shared fixtures, and the two runs of the suite.

`pytest` runs the default set: every fast test and, per capability, at least one end-to-end test on the real model
(generation, prefill/decode parity, quantized formats, paged cache, speculative decoding, engine, server, tokenizer
against the reference). It takes a few minutes on a 2-core machine from a fresh clone (kernels compile on first use).
`pytest --full` also runs the tests marked `slow`: sweeps over the real model and the reference, llama.cpp's
tokenizer suite, the browser tests, checks that compile every kernel from scratch in a second process. CI
(`.ci/run`) runs `pytest --full`. A new test that takes seconds, or repeats over more cases what a default test
already covers on the same code, gets `@pytest.mark.slow` (or `pytest.param(..., marks=pytest.mark.slow)` for
the extra cases of a parametrization).

The whole suite runs in two worker processes (pytest-xdist, a test file at a time per worker): most of its time is
Numba compiling kernels on first use, one core per compile, so two compile at once. A file or test named on the
command line (`pytest tests/test_sampling.py`), `--pdb`, `--trace` or an explicit `-n` runs as asked: in this process,
where breakpoints work, unless `-n` says otherwise.

Real-model fixtures are session-scoped: the default model loads once per worker."""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Converted models (tinyllm/converted.py) go to a folder of this run, not the user's cache, and are deleted after.
os.environ["TINYLLM_CONVERTED"] = tempfile.mkdtemp(prefix="tinyllm-test-cache-")
atexit.register(shutil.rmtree, os.environ["TINYLLM_CONVERTED"], ignore_errors=True)
# A model's fused blocks run as soon as it is warm, as tests of the fused step expect: warm-up compiles them instead
# of leaving them to a background process (kernels/warmup.py; that flow has a test of its own, which turns it on).
os.environ["TINYLLM_WAIT_FOR_BLOCKS"] = "1"
# scripts/reference.py (the independent reference: tokenizers + transformers) is importable from tests.
sys.path.insert(0, str(REPO / "scripts"))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every test, including those marked slow (what CI runs)")


WORKERS = 2    # the machines this is written for have 2 cores; more workers would compile the same kernels twice


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (no paths given: the `testpaths` of setup.cfg) in WORKERS processes, if pytest-xdist is
    installed (the test extra) and nothing on the command line asks for one process (a path, -n, --pdb, --trace)."""
    whole_suite = getattr(config, "args_source", None) == pytest.Config.ArgsSource.TESTPATHS
    if (whole_suite and config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None
            and not config.getoption("usepdb") and not config.getoption("trace")
            and not os.environ.get("PYTEST_XDIST_WORKER")):
        config.option.numprocesses, config.option.dist = WORKERS, "loadfile"


def pytest_collection_modifyitems(config, items):
    """Without --full, a test marked slow is skipped, not deselected: it is listed with its reason, and a file whose
    tests are all slow still collects (exit 0, not pytest's 5 for "no tests collected")."""
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="runs with --full")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path():
    """Path of the default GGUF file, fetched on first use (see tinyllm/hub.py)."""
    from tinyllm import hub

    return hub.ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """SmolLM2-135M-Instruct loaded in fp32 (dequantized from the file's Q4_1/Q8_0)."""
    import tinyllm

    return tinyllm.load(default_model_path)
