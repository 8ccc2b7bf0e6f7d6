"""One knob for the two thread pools tinyllm uses: BLAS (numpy's matmuls) and Numba's parallel loops.

On a 2-core machine, two pools of 2 threads each would fight over the cores; `set_threads(n)` caps both.
OpenBLAS's threads also spin-wait after each call, stealing the cores from the next Numba kernel; that wait is set
by OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads once when numpy loads it, so it must be in the environment before
numpy is imported: the scripts and benchmarks set it on their first lines (importing tinyllm changes nothing in
the environment).

And other processes may be using the cores too: `ThreadGovernor` chooses each decode step's thread count (at most
the cap) from the measured step times and the machine's runnable tasks.
"""
from __future__ import annotations

import os
import time

import numpy as np

_limits = None  # keeps the threadpoolctl limit alive for the life of the process
_allowed = None  # the count set_threads was given (None: Numba's default, every core)


def set_threads(n: int) -> None:
    """Use at most `n` threads for BLAS and for Numba (1 <= n <= the machine's cores)."""
    global _limits, _allowed, _blas_threads
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cores():
        raise ValueError(f"invalid threads={n!r}: must be an integer from 1 to {cores()} (this machine's cores)")
    from threadpoolctl import threadpool_limits

    import numba

    _limits = threadpool_limits(limits=n)
    _allowed, _blas_threads = min(n, numba.config.NUMBA_NUM_THREADS), n
    numba.set_num_threads(_allowed)


def allowed() -> int:
    """The most threads a kernel may use: set_threads' count, else every thread Numba starts."""
    import numba

    return _allowed or numba.config.NUMBA_NUM_THREADS


def cores() -> int:
    """The machine's cores (logical CPUs)."""
    return os.cpu_count() or 1


def others_running() -> int | None:
    """How many tasks of other processes are running or ready to run on this machine right now: Linux's count of
    runnable tasks (/proc/loadavg's fourth field) less this process's own runnable threads; None where that
    cannot be read."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        mine = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                mine += f.read().rpartition(")")[2].split()[0] == "R"      # the state field follows the name
        return max(runnable - mine, 0)
    except (OSError, ValueError, IndexError):
        return None


_kernel_thread, _warned = None, False   # the first thread that ran a model's kernels; said once


def note_kernel_thread() -> None:
    """Called where a model's parallel kernels run (warm-up, each step): once they run on a second thread while the
    first is alive, say once that this is slow. OpenMP gives each such thread its own workers; with more workers
    than cores libgomp cuts their waits short, and every parallel kernel then waits for a wake-up (a server's
    decode at a third of its speed: docs/serving.md, "One thread runs the kernels")."""
    global _kernel_thread, _warned
    import sys
    import threading

    me = threading.current_thread()
    if _kernel_thread is None or not _kernel_thread.is_alive():
        _kernel_thread = me
    elif me is not _kernel_thread and not _warned:
        _warned = True
        print(f"tinyllm: warning: this model's kernels now run on thread {me.name!r} as well as on "
              f"{_kernel_thread.name!r}; OpenMP then slows every parallel kernel: load and run a model on one thread "
              "(docs/serving.md)", file=sys.stderr)


_blas, _blas_threads = None, None   # numpy's BLAS libraries (threadpoolctl's controllers) and the count set on them


def step_threads(n: int) -> None:
    """Run the next steps on n threads: Numba's parallel loops (this thread's count) and numpy's BLAS, whose sgemm
    takes the passes of many rows and whose waiting threads stall on a busy machine as Numba's do. Called by the
    governed steps (backend.governed) with n <= allowed()."""
    global _blas, _blas_threads
    import numba

    numba.set_num_threads(n)
    if _blas is None:
        from threadpoolctl import ThreadpoolController
        _blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    if n != _blas_threads:
        for lib in _blas:
            lib.set_num_threads(n)
        _blas_threads = n


CONFIRM_S = 0.001  # seconds between two looks at the runnable tasks before a core is counted as taken


def free_threads(most: int | None = None) -> int:
    """As many threads as cores are free of other processes' work right now, at least one, at most `most`
    (default: allowed()). A core seen busy is looked at again CONFIRM_S later: on a quiet machine about one look
    in 250 saw a task of another process (a kernel thread waking up, most gone half a millisecond later), and a
    prompt's pass, or a governor's first steps, ran on one thread for it."""
    most = allowed() if most is None else most
    others = others_running()
    if others:
        time.sleep(CONFIRM_S)
        again = others_running()
        others = None if again is None else min(others, again)
    return most if others is None else max(1, min(most, cores() - others))


class ThreadGovernor:
    """How many threads the next decode step runs on: the most allowed while the machine has cores for them, one
    (or fewer) while other work keeps them busy.

    A decode step's threads meet at barriers some 200 times (kernels/spin_barrier.py). On a machine whose cores are
    busy with other work, each barrier can wait for a thread the scheduler has set aside, and one thread then
    decodes several times faster than two (docs/design/kernels.md, "A busy machine"). So the count is measured:
    PROBE steps run on the other count, and the faster one wins (by BETTER, or noise would flip it back and forth).
    A probe starts

    - on the most threads: when the last three steps' median is SLOWER than the best step (other work has
      started), and now and then (every `gap` steps, a gap that doubles each time the count is confirmed, up to
      MAX_GAP: a quiet machine pays a fraction of a percent);
    - on fewer threads: once Linux's count of runnable tasks has shown a free core CLIMB looks in a row (the
      other work has ended), and after the gap: a probe of more threads on a busy machine costs a stalled step
      (a probe step STALLED ends its probe), so it waits at least CLIMB_GAP steps. The count of free cores also
      sets the first count.

    A step on more than one thread that other work has just begun to hold up can take a second (a time slice at
    each barrier), and three of them would pass before the median saw it: so a step is given a `budget`, STALLED
    times the best step but at least MIN_BUDGET (a quiet shared machine has hiccups of tens of milliseconds), past
    which it goes on on one thread (kernels/block.py decode_blocks), and a step that fell back moves the count to
    fewer threads at once. Before a best step is known (the governor's first steps), the budget is the time to read
    the step's bytes at SLOWEST_READ.

        n = governor.choose(); numba.set_num_threads(n); <the step, within governor.budget()>
        governor.record(n, seconds, fell_back)
    """
    PROBE, FIRST_GAP, CLIMB_GAP, MAX_GAP = 3, 256, 256, 1024   # steps (no probe within a short answer)
    CLIMB, LOOK = 3, 4   # looks in a row (one every LOOK steps) that see a free core before more threads are tried
    SLOWER = 1.5         # the median of the last 3 steps this much slower than the best: the machine got busier
    STALLED = 4.0        # a probe step this much slower than the best: that count loses at once
    BETTER = 0.95        # the other count must be at least 5% faster to switch
    MIN_BUDGET = 0.1     # seconds: a step's budget is never shorter
    SLOWEST_READ = 2e9   # bytes/s: a first step reading its weights slower than this is held up (DRAM gives 10x more)

    def __init__(self, most=None):
        self._most = most                      # None: threads.allowed() at each step (set_threads may change it)
        self.current = None                    # the count steps run on
        self.probing = None                    # the count being tried, during a probe
        self.gap = self.until_probe = self.FIRST_GAP
        self.recent, self.trial, self.best = [], [], None
        self.switches, self.free_seen = 0, 0

    @property
    def most(self) -> int:
        return self._most or allowed()

    def choose(self) -> int:
        most = self.most
        if self.current is None:               # the first step: as many threads as cores free, at least one
            self.current = free_threads(most)
            if self.current < most:
                self.gap = self.until_probe = self.CLIMB_GAP
        self.current = min(self.current, most)
        return min(self.probing or self.current, most)

    def budget(self, step_bytes: int = 0) -> float:
        """Seconds past which the next step, which reads `step_bytes` of weights, should go on on one thread (0: no
        limit, as when it runs on one)."""
        if min(self.probing or self.current or 1, self.most) == 1:
            return 0.0
        if self.best is None:
            return max(step_bytes / self.SLOWEST_READ, self.MIN_BUDGET)
        return max(self.STALLED * self.best, self.MIN_BUDGET)

    def record(self, n: int, seconds: float, fell_back: bool = False) -> None:
        if fell_back:                          # held up mid-step: fewer threads now, more once cores come free
            self.current, self.probing, self.trial, self.recent, self.best = max(n // 2, 1), None, [], [], None
            self.gap = self.until_probe = self.CLIMB_GAP
            self.switches, self.free_seen = self.switches + 1, 0
            return
        if self.probing is not None:
            self.trial.append(seconds)
            if len(self.trial) >= self.PROBE or seconds > self.STALLED * self.best:
                self._decide()
            return
        self.recent = (self.recent + [seconds])[-8:]
        self.best = min(self.best or seconds, seconds)
        if self.most == 1:
            return
        self.until_probe -= 1
        if self.current < self.most:           # on fewer threads: more once cores come free, or after the gap
            if self.until_probe % self.LOOK == 0:
                others = others_running()       # (tens of microseconds: every LOOK steps)
                free = others is not None and others + self.current < cores()
                self.free_seen = self.free_seen + 1 if free else 0
            if self.free_seen >= self.CLIMB or self.until_probe <= 0:
                self._probe(min(2 * self.current, self.most))
            return
        slowed = len(self.recent) >= 3 and sorted(self.recent[-3:])[1] > self.SLOWER * self.best   # (their median)
        if slowed or self.until_probe <= 0:
            self._probe(max(self.current // 2, 1))

    def _probe(self, n: int) -> None:
        self.probing, self.trial, self.free_seen = n, [], 0

    def _decide(self) -> None:
        mine, theirs = float(np.median(self.recent[-self.PROBE:])), float(np.median(self.trial))
        if theirs < self.BETTER * mine:
            fewer = self.probing < self.current
            self.current, self.recent, self.best = self.probing, list(self.trial), theirs
            self.gap, self.switches = self.CLIMB_GAP if fewer else self.FIRST_GAP, self.switches + 1
        else:                                  # confirmed: wait longer, from today's speed (context grows)
            self.gap, self.best = min(2 * self.gap, self.MAX_GAP), mine
        self.probing, self.trial, self.until_probe = None, [], self.gap
