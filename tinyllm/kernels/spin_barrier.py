"""A barrier for the threads of one parallel region, so that a whole Llama block runs in a single region
(block.py's threaded block) instead of starting and joining one region per kernel.

Numba has no barrier: a `prange` region ends with a join, and the next kernel starts a new region. Here the
threads of `for tid in prange(get_num_threads())` (one iteration per thread under the omp and workqueue
threading layers) wait for each other between the stages of a block by counting arrivals in a shared int64
array with atomic operations (a central counter with a generation number, the textbook sense-reversing barrier):

    state[COUNT]       arrivals at the current barrier (0 between barriers)
    state[SLEEPERS]    threads asleep in the kernel waiting for the generation to change
    state[GENERATION]  how many barriers have opened; a waiting thread waits until it changes

The slots sit 64 or more bytes apart, so that the spinning reads do not share a cache line with the arrivals'
writes. A thread that waits first spins (with the x86 `pause` hint) for about SPIN_CYCLES: on a quiet machine the
waits are microseconds, far shorter than putting a thread to sleep and waking it. Past that, the thread it waits
for is most likely not running at all (another process has its core), and spinning on would burn the very time
slice that thread needs, so the waiter sleeps on a futex (Linux's wait-on-an-address, as libgomp's and glibc's
barriers do) and the last to arrive wakes it. On other systems it spins on. Every thread of the region must reach
every barrier, or the others wait forever: the threaded block is written so that all threads run the same
sequence of stages.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import binding as llvm, ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

COUNT, SLEEPERS, GENERATION = 0, 8, 16       # int64 slots, 64 and 128 bytes apart
STATE_SIZE = 32
SPIN_CYCLES = 100_000     # time-stamp counter ticks (some 30-50 microseconds) of spinning before sleeping
FUTEX_WAIT, FUTEX_WAKE = 128, 129                 # FUTEX_WAIT / FUTEX_WAKE with FUTEX_PRIVATE_FLAG (one process)


def new_state() -> np.ndarray:
    """A barrier's shared state: one per caller that may run a region (the model's decode loop is one)."""
    return np.zeros(STATE_SIZE, np.int64)


if config.DISABLE_JIT:                # plain Python runs one thread: every barrier is already passed
    def barrier(state, n):
        return None
else:
    def _slot(context, builder, signature, args):
        """A pointer to state[i] (args: the state array, i)."""
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])

    @intrinsic
    def _fetch_add(typingctx, state, i, value):
        """state[i] += value, atomically -> the value before."""
        def codegen(context, builder, signature, args):
            return builder.atomic_rmw("add", _slot(context, builder, signature, args), args[2], "seq_cst")
        return types.int64(state, types.intp, types.int64), codegen

    @intrinsic
    def _read(typingctx, state, i):
        """state[i], read atomically (acquire: what the writer did before its release is seen after)."""
        def codegen(context, builder, signature, args):
            return builder.load_atomic(_slot(context, builder, signature, args), "acquire", 8)
        return types.int64(state, types.intp), codegen

    _X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

    @intrinsic
    def _pause(typingctx):
        """The spin-wait hint (x86 `pause`: frees the core's shared resources while spinning); nothing elsewhere."""
        def codegen(context, builder, signature, args):
            if _X86:
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse2.pause")
                builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    # Sleeping needs Linux's futex system call, made directly (inline `syscall`: nothing to link, so the kernels
    # that inline the barrier stay cacheable); x86-64 Linux only, elsewhere a waiter spins.
    CAN_SLEEP = _X86 and platform.system() == "Linux" and platform.architecture()[0] == "64bit"
    _SYS_FUTEX = 202                                  # x86-64's number for futex
    if CAN_SLEEP:
        llvm.initialize_native_asmparser()            # (Numba does not: LLVM then cannot emit inline assembly)

    @intrinsic
    def _futex(typingctx, state, i, op, value):
        """futex(&state[i], op, value): FUTEX_WAIT sleeps while the low 32 bits of state[i] equal value (returns at
        once if they differ), FUTEX_WAKE wakes up to value sleepers -> the call's result."""
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            address = builder.ptrtoint(_slot(context, builder, signature, args), i64)
            zero = ir.Constant(i64, 0)
            call = ir.FunctionType(i64, [i64] * 6)
            return builder.asm(call, "syscall", "={rax},{rax},{rdi},{rsi},{rdx},{r10},{r8},~{rcx},~{r11},~{memory}",
                               [ir.Constant(i64, _SYS_FUTEX), address, args[2], args[3], zero, zero], True)
        return types.int64(state, types.intp, types.int64, types.int64), codegen

    @intrinsic
    def _cycles(typingctx):
        """The time-stamp counter (rdtsc): a clock that costs nanoseconds to read."""
        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])
        return types.int64(), codegen

    @njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
    def barrier(state, n):
        """Wait until all n threads of the region have arrived here."""
        if n == 1:
            return
        generation = _read(state, GENERATION)
        if _fetch_add(state, COUNT, 1) == n - 1:     # the last to arrive: reset the count, open the barrier
            _fetch_add(state, COUNT, -n)
            _fetch_add(state, GENERATION, 1)
            if CAN_SLEEP and _read(state, SLEEPERS) > 0:   # (after the locked add: a sleeper counted is woken)
                _futex(state, GENERATION, FUTEX_WAKE, n)
        else:
            start = _cycles()
            while _read(state, GENERATION) == generation:
                if CAN_SLEEP and _cycles() - start > SPIN_CYCLES:
                    _fetch_add(state, SLEEPERS, 1)              # before the kernel checks the generation again
                    _futex(state, GENERATION, FUTEX_WAIT, generation & 0xFFFFFFFF)
                    _fetch_add(state, SLEEPERS, -1)
                else:
                    _pause()
