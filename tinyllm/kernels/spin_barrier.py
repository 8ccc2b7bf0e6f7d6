"""A barrier for the threads of one parallel region, so that a whole Llama block runs in a single region
(block.py's threaded block) instead of starting and joining one region per kernel.

Numba has no barrier: a `prange` region ends with a join, and the next kernel starts a new region. Here the
threads of `for tid in prange(get_num_threads())` (one iteration per thread under the omp and workqueue
threading layers) wait for each other between the stages of a block by counting arrivals in a shared int64
array with atomic operations (a central counter with a generation number, the textbook sense-reversing barrier):

    state[COUNT]       arrivals at the current barrier (0 between barriers)
    state[GENERATION]  how many barriers have opened; a waiting thread spins until it changes

The two sit 128 bytes apart, so that the spinning reads do not share a cache line with the arrivals' writes. A
thread that waits spins (with the x86 `pause` hint): the waits are microseconds, far shorter than putting a
thread to sleep and waking it. Every thread of the region must reach every barrier, or the others spin forever:
the threaded block is written so that all threads run the same sequence of stages.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

COUNT, GENERATION = 0, 16            # int64 slots, 128 bytes apart
STATE_SIZE = 32


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

    @njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
    def barrier(state, n):
        """Wait until all n threads of the region have arrived here."""
        if n == 1:
            return
        generation = _read(state, GENERATION)
        if _fetch_add(state, COUNT, 1) == n - 1:     # the last to arrive: reset the count, open the barrier
            _fetch_add(state, COUNT, -n)
            _fetch_add(state, GENERATION, 1)
        else:
            while _read(state, GENERATION) == generation:
                _pause()
