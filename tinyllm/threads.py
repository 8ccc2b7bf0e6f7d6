"""One knob for the two thread pools tinyllm uses: BLAS (numpy's matmuls) and Numba's parallel loops.

On a 2-core machine, two pools of 2 threads each would fight over the cores; `set_threads(n)` caps both.
OpenBLAS's threads also spin-wait after each call, stealing the cores from the next Numba kernel; that wait is set
by OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads once when numpy loads it, so it must be in the environment before
numpy is imported: the scripts and benchmarks set it on their first lines (importing tinyllm changes nothing in
the environment).
"""
from __future__ import annotations

import os

_limits = None  # keeps the threadpoolctl limit alive for the life of the process


def set_threads(n: int) -> None:
    """Use at most `n` threads for BLAS and for Numba (1 <= n <= the machine's cores)."""
    global _limits
    cores = os.cpu_count() or 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cores:
        raise ValueError(f"invalid threads={n!r}: must be an integer from 1 to {cores} (this machine's cores)")
    from threadpoolctl import threadpool_limits

    import numba

    _limits = threadpool_limits(limits=n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))

