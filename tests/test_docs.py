"""Every command and code block in docs/ runs, and prints what the document shows (numbers aside: timings move);
README.md and benchmarks/RESULTS.md are what benchmarks/report.py generates, within their sizes; links resolve.

How a page under docs/ is kept executable:
- A ```bash block is followed by the ```text block it printed. The command runs from the repository root; every
  line of the shown output, with its numbers masked, must be a line of the real output (stdout and stderr
  together), masked the same way. A line "..." marks an elided part.
- A page's ```python blocks (and the README's) run in order as one program (a later block sees an earlier block's names) in a fresh
  interpreter from the repository root. A ```text block right after one shows lines the program prints, checked as
  above.
- `<!-- no-test: why -->` on the line before a block leaves it out: a server that runs until stopped, a download or
  a build, a command that writes files. Keep such blocks few; say why.
- A block that loads the real model is marked slow.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").rglob("*.md"))
NEEDS_MODEL = ("generate.py", "tinyllm.load", "attention.py", "lens.py", "tokens.py", "heads.py", "patch.py",
               "--preset smollm2")
FENCE = re.compile(r"(?P<skip><!-- no-test: (?P<why>[^>]*)-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def blocks(doc: Path) -> list[dict]:
    """The fenced blocks of a page, in order: lang, body, skip, and the ```text block that follows it (or None)."""
    found = [dict(lang=m["lang"], body=m["body"], skip=m["skip"] is not None, why=(m["why"] or "").strip())
             for m in FENCE.finditer(doc.read_text())]
    for b, after in zip(found, found[1:] + [None]):
        b["shown"] = after["body"] if after is not None and after["lang"] == "text" and not after["skip"] else None
    return found


def name(doc: Path) -> str:
    return "-".join(doc.relative_to(REPO / "docs").with_suffix("").parts) if doc.parent != REPO else doc.stem


def marks(code: str) -> list:
    return [pytest.mark.slow] if any(n in code for n in NEEDS_MODEL) else []


def commands():
    for doc in DOCS:
        runnable = [b for b in blocks(doc) if b["lang"] == "bash" and not b["skip"] and b["shown"] is not None]
        for i, b in enumerate(runnable):
            yield pytest.param(b["body"].strip(), b["shown"], id=f"{name(doc)}-{i + 1}", marks=marks(b["body"]))


def programs():
    for doc in DOCS + [REPO / "README.md"]:
        runnable = [b for b in blocks(doc) if b["lang"] == "python" and not b["skip"]]
        if runnable:
            program = "\n".join(b["body"] for b in runnable)
            shown = "".join(b["shown"] or "" for b in runnable)
            yield pytest.param(program, shown, id=f"{name(doc)}-python", marks=marks(program))


def masked(line: str) -> str:
    """A line with every number as '#', runs of spaces as one, and the checkout's own path as '.'."""
    line = line.replace(str(REPO), ".")
    return re.sub(r"\s+", " ", re.sub(r"\d+(?:[.,]\d+)*", "#", line)).strip()


def check_output(r: subprocess.CompletedProcess, shown: str) -> None:
    real = {masked(line) for line in (r.stdout + "\n" + r.stderr).splitlines()}
    missing = [line for line in shown.splitlines() if masked(line) not in ("", "...") and masked(line) not in real]
    assert r.returncode == 0 and not missing, (r.returncode, missing, r.stdout[-2000:], r.stderr[-2000:])


def environment() -> dict:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("command, shown", list(commands()))
def test_documented_command_prints_what_the_document_shows(command, shown):
    r = subprocess.run(["bash", "-c", command], cwd=REPO, env=environment(), capture_output=True, text=True,
                       timeout=600)
    check_output(r, shown)


@pytest.mark.parametrize("program, shown", list(programs()))
def test_documented_python_runs_and_prints_what_the_document_shows(program, shown):
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=environment(), capture_output=True, text=True,
                       timeout=600)
    check_output(r, shown)


def test_every_command_in_the_docs_is_checked():
    """No command without its shown output (it would never be run), and no block left out without a reason."""
    for doc in DOCS:
        for b in blocks(doc):
            if b["lang"] == "bash" and not b["skip"]:
                assert b["shown"] is not None, f"{doc.name}: a bash block without its output: {b['body'][:80]!r}"
            if b["skip"]:
                assert b["why"], f"{doc.name}: a no-test marker without a reason"
        assert "OUTPUT-" not in doc.read_text(), f"{doc.name} has an output not pasted yet"


def test_results_and_readme_are_what_report_py_generates():
    r = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def test_readme_and_results_stay_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 260
    assert len((REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 320


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_links_point_to_files_that_exist():
    pages = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md"] + DOCS
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def report_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report
    return report


def test_report_puts_two_cpu_kinds_side_by_side():
    report = report_module()
    one = ["`cmd`", "", "bandwidth 80 GB/s"] + report.table(["format", "tok/s", "MB"], [["fp32", "97", "538"]])
    two = ["`cmd`", "", "bandwidth 28 GB/s"] + report.table(["format", "tok/s", "MB"], [["fp32", "45", "538"],
                                                                                          ["int8", "120", "135"]])
    assert report.side_by_side(["VNNI", "AVX2"], [one, two]) == [
        "`cmd`", "", "**VNNI**: bandwidth 80 GB/s **AVX2**: bandwidth 28 GB/s",
        "| format (VNNI · AVX2) | tok/s | MB |", "|---|---:|---:|",
        "| fp32 | 97 · 45 | 538 |", "| int8 | - · 120 | - · 135 |"]


def test_report_reads_each_cpu_kind_and_keeps_an_old_file_until_a_vnni_one_replaces_it(tmp_path, monkeypatch):
    report = report_module()
    monkeypatch.setattr(report, "HERE", tmp_path)
    (tmp_path / "x.json").write_text('{"old": 1}')
    (tmp_path / "x.avx2.json").write_text('{"machine": {"isa": "AVX2"}}')
    assert [kind for kind, _ in report.load("x")] == [report.UNRECORDED, "AVX2"]
    (tmp_path / "x.avx-512-vnni.json").write_text('{"machine": {"isa": "AVX-512 VNNI"}}')
    assert [kind for kind, _ in report.load("x")] == ["AVX-512 VNNI", "AVX2"]
    assert report.per_kind("y", "python benchmarks/y.py", None) == ["not measured yet: run `python benchmarks/y.py`"]


PDB_STOP = re.compile(r"^(?:\(Pdb\) )*(?:> |  )\./(?P<file>[\w/.]+\.py)\((?P<line>\d+)\)[\w<>]+\(\).*\n"
                      r"-> (?P<code>.*)$", re.M)


BREAKPOINT = re.compile(r"Breakpoint \d+ at \./(?P<file>[\w/.]+\.py):(?P<line>\d+)\n(?:\(Pdb\) )*> \./[\w/.]+\.py"
                        r"\((?P<stop>\d+)\)")


def moved_pdb_stops(text: str) -> list[str]:
    """pdb stops shown in a page ('> ./file.py(N)function()' then '-> code') whose line N no longer holds that code,
    and breakpoints on a function whose line N is no longer its def: the output check masks numbers, so without
    this a moved line would pass unseen."""
    moved = []
    for m in BREAKPOINT.finditer(text):
        lines = (REPO / m["file"]).read_text().splitlines()
        n = int(m["line"])
        if n != int(m["stop"]) and (n > len(lines) or not lines[n - 1].lstrip().startswith("def ")):
            moved.append(f"{m['file']}:{n} is not the def of the function pdb stops in")
    for m in PDB_STOP.finditer(text):
        lines = (REPO / m["file"]).read_text().splitlines()
        n = int(m["line"])
        if n > len(lines) or lines[n - 1].strip() != m["code"].strip():
            moved.append(f"{m['file']}({n}) shows {m['code'].strip()!r}")
    return moved


def test_pdb_stops_in_the_docs_are_at_the_lines_they_show():
    assert moved_pdb_stops("> ./tinyllm/ops.py(3)softmax()\n-> def softmax(x):") == [
        "tinyllm/ops.py(3) shows 'def softmax(x):'"]                        # a line that moved is caught
    assert moved_pdb_stops("Breakpoint 1 at ./tinyllm/ops.py:3\n(Pdb) > ./tinyllm/ops.py(5)softmax()") == [
        "tinyllm/ops.py:3 is not the def of the function pdb stops in"]
    for doc in DOCS:
        assert not moved_pdb_stops(doc.read_text()), doc.name
