"""Every command in docs/*.md runs, and prints what the document shows (numbers aside: timings move).

A document pairs each ```bash block with the ```text block after it, the output it printed. Here each command is
run from the repository root; every line of the shown output, with its numbers masked, must be a line of the real
output (stdout and stderr together), with its numbers masked the same way. A line "..." marks an elided part.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
NEEDS_MODEL = ("generate.py", "tinyllm.load", "attention.py", "lens.py", "tokens.py", "--preset smollm2")


def examples():
    for doc in DOCS:
        text = doc.read_text()
        for i, m in enumerate(re.finditer(r"```bash\n(.*?)```\s*```text\n(.*?)```", text, re.S)):
            command, shown = m.group(1).strip(), m.group(2)
            marks = [pytest.mark.slow] if any(n in command for n in NEEDS_MODEL) else []
            yield pytest.param(command, shown, id=f"{doc.stem}-{i + 1}", marks=marks)


def masked(line: str) -> str:
    """A line with every number as '#', runs of spaces as one, and the checkout's own path as '.'."""
    line = line.replace(str(REPO), ".")
    return re.sub(r"\s+", " ", re.sub(r"\d+(?:[.,]\d+)*", "#", line)).strip()


@pytest.mark.parametrize("command, shown", list(examples()))
def test_documented_command_prints_what_the_document_shows(command, shown):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    real = {masked(line) for line in (r.stdout + "\n" + r.stderr).splitlines()}
    missing = [line for line in shown.splitlines() if masked(line) not in ("", "...") and masked(line) not in real]
    assert r.returncode == 0 and not missing, (r.returncode, missing, r.stdout[-2000:], r.stderr[-2000:])


def test_every_command_in_the_docs_is_checked():
    """No command without its shown output (it would never be run)."""
    for doc in DOCS:
        text = doc.read_text()
        assert text.count("```bash") == len(re.findall(r"```bash\n.*?```\s*```text\n", text, re.S)), doc.name
        assert "OUTPUT-" not in text, f"{doc.name} has an output not pasted yet"
