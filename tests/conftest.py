"""Shared fixtures. Real-model fixtures are session-scoped: the default model loads once per test run."""
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
# scripts/reference.py (the independent reference: tokenizers + transformers) is importable from tests.
sys.path.insert(0, str(REPO / "scripts"))


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
