"""This machine's roofs: the read bandwidth and float32 sgemm peak measured here, and a cache of them.

`measure_roofs` measures (a benchmark: seconds, best on a quiet machine); `save_calibration` / `load_calibration`
keep the result in the user's cache directory, so that `scripts/capacity.py --calibrate` measures once and the
lab's "this server" preset predicts with this machine's figures. benchmarks/roofline.py measures the same way.
Left out: anything per kernel (benchmarks/ does that) and GPUs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np


@numba.njit(parallel=True, fastmath=True)
def row_sums(a, out):
    """The streaming read: each row of a [rows, 1024] float32 array summed into out (numpy twin: a.sum(axis=1)),
    the rows split between the threads."""
    for r in numba.prange(a.shape[0]):
        s = np.float32(0.0)
        for j in range(a.shape[1]):
            s += a[r, j]
        out[r] = s


def median_time(fn, repeats: int) -> float:
    """Seconds of fn(), the median of `repeats` runs after one untimed warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def read_bandwidth(threads: int | None = None, repeats: int = 9, mib: int = 1024) -> float:
    """GB/s of a streaming read: Numba sums each 4 KiB row of a `mib` MiB float32 array (1 GiB: far larger than
    any cache), rows split across `threads` (None: Numba's current count).
    The best of `repeats` runs: a roof is what the machine can do, and on a shared machine the median is
    pulled down by whoever else is running."""
    a = np.ones((mib * 256, 1024), dtype=np.float32)                # [rows, 1024]: mib MiB
    out = np.empty(a.shape[0], dtype=np.float32)
    if threads is not None:
        numba.set_num_threads(threads)
    row_sums(a, out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        row_sums(a, out)
        times.append(time.perf_counter() - t0)
    return a.nbytes / min(times) / 1e9


def sgemm_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """GFLOP/s of numpy's float32 matmul [m, k] x [k, n]."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    return 2 * m * k * n / median_time(lambda: a @ b.T, repeats) / 1e9


@dataclass(frozen=True)
class MachineRoofs:
    """This machine's roofs, as `measure_roofs` found them."""
    bandwidth: float       # bytes/s of the streaming read
    peak_flops: float      # FLOP/s of float32 sgemm at 2048^3
    memory: float          # bytes of RAM (0 when the OS does not say)
    threads: int
    machine: str           # host and processor: a cache copied from another machine is not used
    measured: str          # when, ISO 8601 UTC
    source: str            # what measured it


def this_machine() -> str:
    return f"{platform.node()} / {platform.machine()} / {os.cpu_count()} cores"


def machine_memory() -> float:
    """Bytes of RAM, or 0 where the OS has no sysconf for it."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 0.0


def measure_roofs(threads: int | None = None, repeats: int = 5, mib: int = 1024, source: str = "") -> MachineRoofs:
    """Measure the read bandwidth and the sgemm peak now (a benchmark: seconds, and best on a quiet machine)."""
    bandwidth = read_bandwidth(threads, repeats=repeats, mib=mib) * 1e9
    peak = sgemm_gflops(2048, 2048, 2048, repeats=repeats) * 1e9
    return MachineRoofs(bandwidth, peak, machine_memory(), numba.get_num_threads() if threads is None else threads,
                        this_machine(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), source)


def calibration_file() -> Path:
    """$XDG_CACHE_HOME/tinyllm/calibration.json, else ~/.cache/tinyllm/calibration.json."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tinyllm" / "calibration.json"


def save_calibration(roofs: MachineRoofs, path: Path | None = None) -> Path:
    path = Path(path or calibration_file())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(roofs), indent=1) + "\n")
    return path


def load_calibration(path: Path | None = None) -> MachineRoofs | None:
    """The cached roofs of this machine; None when there are none (or they are another machine's). A file that
    is not a calibration is a ValueError saying so."""
    path = Path(path or calibration_file())
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable calibration ({e}): delete it, or run "
                         f"python scripts/capacity.py --calibrate again") from None
    fields = {f.name for f in dataclasses.fields(MachineRoofs)}
    if not isinstance(data, dict) or set(data) != fields or \
            not all(isinstance(data[k], (int, float)) and data[k] >= 0 for k in ("bandwidth", "peak_flops", "memory")):
        raise ValueError(f"{path} is not a calibration of this tinyllm (fields {sorted(fields)}): delete it, or run "
                         f"python scripts/capacity.py --calibrate again")
    roofs = MachineRoofs(**data)
    return roofs if roofs.machine == this_machine() else None
