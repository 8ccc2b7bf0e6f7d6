"""A busy machine: the barrier's sleep under more threads than cores, and the thread governor's choices."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tinyllm import threads
from tinyllm.threads import ThreadGovernor

ROOT = Path(__file__).resolve().parent.parent


def run_steps(governor, step_seconds, steps):
    """Drive a governor for `steps` decode steps whose time is step_seconds(n_threads, step) -> the counts used."""
    used = []
    for i in range(steps):
        n = governor.choose()
        used.append(n)
        governor.record(n, step_seconds(n, i))
    return np.array(used)


@pytest.fixture
def machine(monkeypatch):
    """A two-core machine whose other processes' runnable tasks are machine['others']."""
    state = {"others": 0}
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads, "others_running", lambda: state["others"])
    return state


def test_on_a_quiet_machine_the_governor_keeps_every_thread_and_probes_rarely(machine):
    quiet = lambda n, i: {2: 0.010, 1: 0.016}[n]                      # noqa: E731  two threads 1.6x faster
    used = run_steps(ThreadGovernor(most=2), quiet, 4000)
    assert used[0] == 2 and used[-1] == 2
    assert 0 < (used == 1).sum() <= 0.01 * len(used)                 # probes happen, and cost under 1% of steps


def test_free_threads_counts_a_core_as_taken_only_if_it_stays_taken(monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads, "CONFIRM_S", 0.0)
    looks = iter([1, 0])                                              # a task of another process, gone at once
    monkeypatch.setattr(threads, "others_running", lambda: next(looks))
    assert threads.free_threads(2) == 2
    looks = iter([1, 1])                                              # a busy process: still there
    assert threads.free_threads(2) == 1
    looks = iter([0])                                                 # a quiet machine: one look only
    assert threads.free_threads(2) == 2
    looks = iter([3, None])                                           # unreadable the second time: every thread
    assert threads.free_threads(2) == 2


def test_when_other_work_starts_the_governor_drops_to_one_thread_within_a_few_steps(machine):
    governor = ThreadGovernor(most=2)
    quiet = run_steps(governor, lambda n, i: {2: 0.010, 1: 0.016}[n], 100)
    machine["others"] = 4                                             # busy processes, seen as runnable tasks
    busy = run_steps(governor, lambda n, i: {2: 0.500, 1: 0.020}[n], 900)   # two threads: stalled barriers
    assert quiet[-1] == 2
    assert (busy[:10] == 2).sum() <= 3                                # two or three stalled steps, then one thread
    assert (busy[10:] == 2).sum() <= 3                                # then a stalled probe step now and then


def test_the_governor_climbs_back_once_cores_come_free_and_starts_from_what_is_free(machine):
    steps = {2: 0.010, 1: 0.016}
    machine["others"] = 3
    governor = ThreadGovernor(most=2)
    assert governor.choose() == 1                                     # started on a busy machine: one thread
    run_steps(governor, lambda n, i: steps[n], 200)
    assert governor.current == 1                                      # (busy: never tried two)
    machine["others"] = 0
    used = run_steps(governor, lambda n, i: steps[n], 40)
    assert used[-1] == 2 and governor.current == 2


def test_a_step_held_up_past_its_budget_moves_the_governor_to_one_thread_at_once(machine):
    """A step given `budget()` (STALLED times the best step, at least MIN_BUDGET; none on one thread; before a best
    is known, the time to read the step's bytes at SLOWEST_READ) that fell back to one thread mid-step leaves the
    next steps on one thread, without three more stalled steps to see it; the count climbs back once cores come
    free."""
    governor = ThreadGovernor(most=2)
    assert governor.choose() == 2
    assert governor.budget(10**8) == ThreadGovernor.MIN_BUDGET        # no best step yet: from the bytes, at least
    assert governor.budget(10**9) == pytest.approx(1e9 / ThreadGovernor.SLOWEST_READ)     # MIN_BUDGET
    run_steps(governor, lambda n, i: {2: 0.010, 1: 0.016}[n], 20)
    assert governor.current == 2 and governor.budget() == ThreadGovernor.MIN_BUDGET   # (4 x 10 ms is less)
    governor.best = 0.050
    assert governor.budget() == pytest.approx(ThreadGovernor.STALLED * 0.050)
    machine["others"] = 4
    governor.record(governor.choose(), 0.200, fell_back=True)        # a step held up, finished on one thread
    assert governor.choose() == 1 and governor.budget() == 0.0
    machine["others"] = 0
    used = run_steps(governor, lambda n, i: {2: 0.010, 1: 0.016}[n], 40)
    assert used[-1] == 2


@pytest.mark.parametrize("quant, activations", [(None, "float32"), ("q4_1", "int8")])
def test_a_step_that_falls_back_to_one_thread_mid_step_gives_the_same_logits(machine, monkeypatch, quant, activations):
    """The fused step's layers after the budget is spent run on one thread (the plain block for fp32, the threaded
    one for quantized weights): the same logits, bit for bit, as a step that kept its threads."""
    import numba
    sys.path.insert(0, str(ROOT / "tests"))
    from test_model import random_model
    from tinyllm.kernels import block
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread: nothing to fall back from")
    m = random_model("llama", dim=64, ffn_dim=64, quant=quant, activations=activations)
    fell = []
    decode_blocks = block.decode_blocks
    monkeypatch.setattr(m.compute.kernels, "decode_blocks", lambda *a: fell.append(decode_blocks(*a)) or fell[-1])
    out = []
    for budget in (0.0, 1e-9):                                       # no limit; spent after the first layer
        monkeypatch.setattr(ThreadGovernor, "budget", lambda self, step_bytes=0, b=budget: b)
        monkeypatch.setattr(threads, "allowed", lambda: 2)
        m.compute._governors.clear()
        threads.step_threads(2)
        cache = m.new_cache(16)
        m.forward([1, 2, 3], cache)
        out.append(m.forward([4], cache))
    assert fell == [False, False, True, True]                         # (the prompt of 3 tokens is a fused step too)
    np.testing.assert_array_equal(out[0], out[1])


def test_a_governor_of_one_allowed_thread_never_asks_for_two(machine):
    used = run_steps(ThreadGovernor(most=1), lambda n, i: 0.01 * (1 + i % 7), 500)
    assert (used == 1).all()


def test_others_running_counts_a_busy_process_and_not_this_ones_threads():
    if threads.others_running() is None:
        pytest.skip("no /proc/loadavg here")
    busy = subprocess.Popen(["sh", "-c", "(while :; do :; done) & while :; do :; done"], start_new_session=True)
    try:
        seen = max(threads.others_running() for _ in range(200))
    finally:
        os.killpg(busy.pid, 9)
        busy.wait()
    assert seen >= 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the futex sleep is Linux's")
def test_the_threaded_block_with_more_threads_than_cores_and_a_busy_process_gives_the_same_logits():
    """Four threads on this machine's cores beside a busy process: the barrier's waiters sleep and are woken, and
    the decode of a random model gives the logits of one thread, bit for bit, in bounded time (no lost wake-up)."""
    code = textwrap.dedent("""
        import sys, numpy as np, numba
        sys.path.insert(0, "tests")
        from test_model import random_model
        from tinyllm.kernels import block
        m = random_model("llama", dim=64, ffn_dim=64, quant="q4_1", activations="int8")
        ids = np.random.default_rng(3).integers(0, 50, 40)
        out = []
        for n in (4, 1):
            numba.set_num_threads(n)
            block._plain_only = False
            cache = m.new_cache(48)
            logits = [m.forward(ids[:4], cache)] + [m.forward(ids[i:i + 1], cache) for i in range(4, 40)]
            out.append(np.concatenate(logits))
        assert np.array_equal(out[0], out[1]), np.abs(out[0] - out[1]).max()
        print("same")
    """)
    busy = subprocess.Popen(["sh", "-c", "(while :; do :; done) & while :; do :; done"], start_new_session=True)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, NUMBA_NUM_THREADS="4"))
    finally:
        os.killpg(busy.pid, 9)
        busy.wait()
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]


def test_a_fused_step_tells_its_governor_the_bytes_of_its_weights(monkeypatch):
    """The first step's budget comes from the bytes the step reads: the fused step passes its layers' weights."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_model import random_model
    m = random_model("llama", dim=64, ffn_dim=64, quant="q4_1", activations="int8")
    asked, budget = [], ThreadGovernor.budget
    monkeypatch.setattr(ThreadGovernor, "budget", lambda self, step_bytes=0: asked.append(step_bytes) or
                        budget(self, step_bytes))
    m.forward([1, 2], m.new_cache(8))
    layer_bytes = [sum(a.nbytes for w in (layer.wqkv, layer.wo, layer.w_in, layer.w_out) for a in vars(w).values()
                       if isinstance(a, np.ndarray)) for layer in m.layers]
    assert asked and asked[-1] == pytest.approx(sum(layer_bytes), rel=0.1)   # (and the norms)


def test_batched_and_fused_steps_each_have_a_governor_that_sets_their_thread_count(monkeypatch):
    """A batched decode step over a paged pool (op by op) and a fused decode step run on the count their own
    governor chooses (keyed by the step's shape), and record their time with it; a traced pass is not governed."""
    import sys
    sys.path.insert(0, str(ROOT / "tests"))
    from test_model import random_model
    from tinyllm.paged import PagedKVCache
    from tinyllm.trace import Trace
    m = random_model("llama", dim=64, ffn_dim=64, quant="q4_1", activations="int8")
    chosen, choose = [], ThreadGovernor.choose
    monkeypatch.setattr(threads, "allowed", lambda: 1)                   # (so every governor chooses 1)
    monkeypatch.setattr(ThreadGovernor, "choose", lambda self: chosen.append(self) or choose(self))
    pool = PagedKVCache(m.config, block_size=4, num_blocks=16)
    seqs = [pool.new_sequence() for _ in range(2)]
    n0 = m.compute.kernels.get_num_threads()
    from tinyllm import backend
    monkeypatch.setattr(backend, "step_threads", lambda n: used.append(n))
    used = []
    m.forward_batch([[1, 2, 3], [4, 5]], seqs)
    m.forward_batch([[6], [7]], seqs)                                     # a decode step of 2 sequences
    m.forward([1, 2], m.new_cache(8))                                     # a fused step of 2 tokens
    governors = m.compute._governors
    assert ("ops", 2, 2) in governors and ("ops", 2, 8) in governors and ("fused", len(m.layers), 2) in governors
    assert governors["ops", 2, 2] in chosen and governors["ops", 2, 2].best is not None   # its step was recorded
    assert n0 == 1 or used == [1] * len(used) and used                   # the chosen count was applied
    before = len(chosen)
    m.forward([1, 2], m.new_cache(8), trace=Trace())
    assert len(chosen) == before


def test_step_threads_sets_numba_and_blas_counts():
    """A governed step's count reaches both pools: Numba's (this thread's) and numpy's BLAS (threadpoolctl)."""
    import numba
    from threadpoolctl import threadpool_info
    n0 = numba.get_num_threads()
    try:
        threads.step_threads(1)
        assert numba.get_num_threads() == 1
        assert all(lib["num_threads"] == 1 for lib in threadpool_info() if lib["user_api"] == "blas")
    finally:
        threads.step_threads(n0)
    assert all(lib["num_threads"] == n0 for lib in threadpool_info() if lib["user_api"] == "blas")


def test_kernels_on_a_second_thread_are_said_once(monkeypatch, capsys):
    """A model's kernels run on a second thread while the first lives: one warning line, said once."""
    import threading
    monkeypatch.setattr(threads, "_kernel_thread", None)
    monkeypatch.setattr(threads, "_warned", False)
    threads.note_kernel_thread()
    threads.note_kernel_thread()
    assert capsys.readouterr().err == ""                        # the same thread: nothing to say
    for _ in range(2):
        t = threading.Thread(target=threads.note_kernel_thread, name="worker")
        t.start()
        t.join()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tinyllm: warning:") and "'worker'" in err[0]
