"""Shared by the benchmark scripts: write a measured section into benchmarks/RESULTS.md, replacing the previous
run's section of the same name and leaving every other section alone."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(name: str, body: str, path: Path = RESULTS) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Measured results\n"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def machine_info() -> dict:
    """CPU model, cores, and the versions that decide speed."""
    import numba
    import numpy as np
    from threadpoolctl import threadpool_info

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
    except (OSError, AttributeError):
        cpu = platform.processor() or "unknown"
    blas = next((f"{i['internal_api']} {i['version']} ({i.get('architecture', '?')})" for i in threadpool_info()
                 if i["user_api"] == "blas"), "unknown")
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
                numba=numba.__version__, blas=blas)


def machine_line(m: dict) -> str:
    return (f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']} ({m['blas']}), "
            f"numba {m['numba']}")
