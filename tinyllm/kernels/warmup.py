"""Compiling the kernels before the first request, on tiny inputs typed and laid out as the model passes them.

Numba compiles a kernel for each new combination of argument types on its first call, and caches the result on
disk (`cache=True`), so only the first run of a fresh install pays for it. `warmup` makes that first call happen
at load time (a new array layout mid-request would mean a compile in the middle of a generation), for what the
model will run and nothing more: its weight formats, its activations setting, its KV cache format.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np

from ..kv_cache import int8_group, kv_storage
from ..quant import BLOCK, Int8Block, Int8Channel, Q4Block, Q4KBlock, Q5Block, Q6KBlock, quantize
from . import dispatch, intdot
from .block import BLOCKS, THREADED_BLOCKS, plain_blocks_only
from .dispatch import FEW_TOKENS, FUSED_ROWS, PREFILL_CHUNK, attention, linear, paged_attention, swiglu
from .kv_formats import kernel_operands
from .kv_rows import row_shape, row_shape_of
from .linear_kernels import TILE_MIN_ROWS
from .panel_kernels import PANEL_MIN_ROWS
from .pointwise import apply_rope, rmsnorm, rmsnorm_into
from .spin_barrier import new_state
from .weight_formats import kernel_weight

FORMATS = {np.ndarray: None, Int8Channel: "int8", Int8Block: "int8-block", Q4Block: "q4_1",
           Q4KBlock: "q4_k", Q5Block: "q5_0", Q6KBlock: "q6_k"}
NOTICE_AFTER_S = 1.0    # loading every kernel from the cache takes well under this; compiling takes seconds
HELPER_TIMEOUT_S = 600  # a second process compiling the decode kernels: given up on (and done here) after this
_threaded_helper = None  # the second process compiling threaded blocks, if this process started one
_done: set = set()      # what is warm, as tagged tuples: ("linear", fmt, int8_inputs, rows), ("block", fmt,
                        # int8_inputs, kv_dtype, heads), ("attention", kind, kv_dtype, heads), ("paged", kv_dtype,
                        # heads), ("ops",); heads: the model's (head size, query heads per KV head), which kv_rows.py
                        # compiles code for


def _matrix(fmt: str | None, rows: int, cols: int = BLOCK):
    """A [rows, cols] weight of format fmt (None: float32; "q5_0", "q6_k": a file's, which nothing quantizes to)."""
    w = np.ones((rows, cols), np.float32)
    if fmt == "q5_0":
        return Q5Block(np.ones((rows, cols // 2), np.uint8), np.ones((rows, cols // BLOCK), np.float32),
                       np.ones((rows, cols // BLOCK), np.uint32))
    if fmt == "q6_k":       # (narrower than a super-block: no scales, so the kernels read nothing past cols)
        return Q6KBlock(np.ones((rows, cols // 2), np.uint8), np.ones((rows, cols // 4), np.uint8),
                        np.ones((rows, cols // 256), np.int8), np.ones((rows, cols // 256), np.float32))
    return w if fmt is None else quantize(w, fmt)


def _layer_formats(layer) -> str | None | tuple:
    """A layer's weight formats, from its classes (one class: all four matrices of it; a tuple: wqkv's, wo's, w_in's,
    w_out's) -> one format name when the four agree, else the tuple of four (a file's mix, e.g. Q4_K_M's)."""
    fmts = tuple(FORMATS[t] for t in layer) if isinstance(layer, (tuple, list)) else (FORMATS[layer],) * 4
    return fmts[0] if len(set(fmts)) == 1 else fmts


def _each_matrix(fmt) -> tuple:
    """A layer's formats (_layer_formats) as four, wqkv's first: (fmt,) * 4 for one format."""
    return tuple(fmt) if isinstance(fmt, (tuple, list)) else (fmt,) * 4


def _block_arguments(fmt, kv_dtype: str, heads: tuple) -> tuple:
    """A small block's arguments, typed and laid out as the model passes them: weights of fmt (one format, or the
    layer's four: _layer_formats), a cache of kv_dtype, attention heads like the model's (heads: its head size and
    query heads per KV head)."""
    H, KVH, Dh = _dummy_heads(heads, kv_dtype)                      # D = 32: one block wide
    x, norm, trig = np.ones((1, BLOCK), np.float32), np.ones(BLOCK, np.float32), np.ones((1, Dh // 2), np.float32)
    kv = kv_storage((4, KVH, Dh), kv_dtype)                         # [S_max, KVH, Dh]
    (k, k_scales), (v, v_scales) = kernel_operands(kv), kernel_operands(kv)
    shapes = (((H + 2 * KVH) * Dh, BLOCK), (BLOCK, H * Dh), (2 * BLOCK, BLOCK), (BLOCK, BLOCK))   # [O, I] each
    mats = [tuple(kernel_weight(_matrix(f, rows, cols)))                     # (plain, as block.py takes them)
            for f, (rows, cols) in zip(_each_matrix(fmt), shapes)]
    return (x, norm, norm, *mats, intdot.USE_INT_DOTS, k, k_scales, v, v_scales, 0, trig, trig, H, 1e-5,
            row_shape_of(k, k_scales, H // KVH))


def _warm_decode_block(fmt, int8_inputs: bool, kv_dtype: str, heads: tuple, kinds=("plain", "threaded")):
    """The fused blocks of `kinds` (block.py: "plain", "threaded") for weights of fmt (_layer_formats), an
    activations setting, a cache of kv_dtype, and attention heads like the model's."""
    args = _block_arguments(fmt, kv_dtype, heads)
    if "plain" in kinds:
        BLOCKS[int8_inputs](*args)
    if "threaded" in kinds and _each_matrix(fmt)[0] is not None:    # (a quantized wqkv only: block.decode_blocks)
        THREADED_BLOCKS[int8_inputs](*args, new_state(), numba.get_num_threads())


def _in_the_cache(blocks, kind: str) -> bool:
    """Whether Numba's disk cache holds the fused block of `kind` ("plain", "threaded") for every (fmt, int8
    activations, kv_dtype, heads) in `blocks` (calling it then loads its code instead of compiling it)."""
    for fmt, int8_inputs, kv_dtype, heads in blocks:
        fmt, heads = _spec(fmt, heads)
        if kind == "threaded" and _each_matrix(fmt)[0] is None:    # fp32 runs the plain block
            continue
        kernel = (THREADED_BLOCKS if kind == "threaded" else BLOCKS)[int8_inputs]
        extra = (new_state(), 1) if kind == "threaded" else ()
        signature = tuple(kernel.typeof_pyval(a) for a in (*_block_arguments(fmt, kv_dtype, heads), *extra))
        index = kernel._cache._cache_file._load_index()            # Numba's cache index: (signature, ...) keys
        if signature not in kernel.overloads and not any(key[0] == signature for key in index):
            return False
    return True


def _spec(fmt, heads) -> tuple:
    """A block's format and heads as warmup keys them (tuples; they come as lists from JSON)."""
    return (tuple(fmt) if isinstance(fmt, list) else fmt), tuple(heads)


def _dummy_heads(heads: tuple, kv_dtype: str) -> tuple:
    """(H, KVH, Dh) of a small stand-in whose attention compiles the same code as the model's: its own head size
    and heads per KV head where kv_rows writes them out, else a generic shape (head size 16)."""
    head_dim, per_kv = heads
    if row_shape(head_dim, per_kv, int8_group(head_dim) if kv_dtype == "int8" else None) == ():
        return 2, 1, 16
    return per_kv, 1, head_dim


def _warm_attention(kv_dtype: str, heads: tuple, kinds=("decode", "prefill")) -> None:
    """decode_attention (a few query rows; "one thread": its serial twin) and tiled_causal_attention (a prompt
    chunk) on a cache of kv_dtype, for heads like the model's (its head size, query heads per KV head)."""
    H, KVH, Dh = _dummy_heads(heads, kv_dtype)
    for kind in kinds:
        if ("attention", kind, kv_dtype, heads) not in _done:
            T = FEW_TOKENS + 1 if kind == "prefill" else 2
            kv = kv_storage((T + 1, KVH, Dh), kv_dtype)             # [S, KVH, Dh]
            kv[:] = np.ones((T + 1, KVH, Dh), np.float32)
            setting, dispatch.one_thread_attention = dispatch.one_thread_attention, kind == "one thread"
            try:
                attention(np.ones((T, H, Dh), np.float32), kv, kv, 1)
            finally:
                dispatch.one_thread_attention = setting
            _done.add(("attention", kind, kv_dtype, heads))


def _warm_linear(fmt: str | None, int8_inputs: bool, rows: int) -> None:
    """The linear kernel for weights of format fmt, int8 activations or not, this many rows (1: the one-row kernel)."""
    if ("linear", fmt, int8_inputs, rows) not in _done:
        linear(np.ones((rows, BLOCK), np.float32), _matrix(fmt, 2), int8_inputs=int8_inputs)
        _done.add(("linear", fmt, int8_inputs, rows))


def _warm_rope() -> None:
    for T in (1, 2):                # q and k are views of the qkv rows: contiguous for one row, strided for more
        qkv = np.ones((T, 16), dtype=np.float32)
        apply_rope(qkv[:, :8].reshape(T, 2, 4), np.ones((T, 2), np.float32), np.ones((T, 2), np.float32))


def _warm_ops() -> None:
    """RMSNorm, RoPE, and SwiGLU for one row and (in parallel) for a batch's."""
    if ("ops",) not in _done:
        x = np.ones((1, BLOCK), dtype=np.float32)
        rmsnorm(x, x[0], 1e-5)
        _warm_rope()
        swiglu(np.ones((1, 4), np.float32))
        swiglu(np.ones((4, 4), np.float32))                        # the parallel form, for batches
        _done.add(("ops",))


def warm_decode_kernels(blocks, head_linears=(), ops: bool = False, first_run: bool = False) -> None:
    """The big kernels of a decode step for each (weight format, int8 activations, kv_dtype, heads) in `blocks`:
    each matrix's linears of one row and, with float activations, of a few (a verification pass: the float tiles;
    int8 activations take the prompt chunk's integer tiles there), and decode attention (the fused blocks call them
    too); the output head's one-row linear of each (format, int8 activations) in head_linears; the small ops if
    `ops`. first_run: the linears of one row only, no attention (a first run's share: warmup)."""
    for fmt, int8_inputs, kv_dtype, heads in blocks:
        fmt, heads = _spec(fmt, heads)
        for f in _each_matrix(fmt):
            for rows in (1,) if int8_inputs or first_run else (1, TILE_MIN_ROWS):
                _warm_linear(f, int8_inputs and f is not None, rows)
        if not first_run:
            _warm_attention(kv_dtype, heads, ("decode",))
    for fmt, int8_inputs in head_linears:
        _warm_linear(fmt, int8_inputs, 1)
    if ops:
        _warm_ops()


def warm_first_run(blocks, ops: bool = False) -> None:
    """A first run's other share (warmup): decode attention on one thread for each (weight format, int8
    activations, kv_dtype, heads) in `blocks`, and the small ops if `ops`."""
    for _, _, kv_dtype, heads in blocks:
        _warm_attention(kv_dtype, _spec(None, heads)[1], ("one thread",))
    if ops:
        _warm_ops()


def warm_prompt_kernels(blocks) -> None:
    """What prompt chunks run, for each (weight format, int8 activations, kv_dtype, heads) in `blocks`: each
    matrix's linears of TILE_MIN_ROWS and PANEL_MIN_ROWS rows (the tiles and panels), tiled causal attention and
    the parallel decode attention (a first run decodes on one thread until then)."""
    for fmt, int8_inputs, kv_dtype, heads in blocks:
        fmt, heads = _spec(fmt, heads)
        for f in _each_matrix(fmt):
            for rows in (TILE_MIN_ROWS, PANEL_MIN_ROWS):
                _warm_linear(f, int8_inputs and f is not None, rows)
        _warm_attention(kv_dtype, heads, ("prefill", "decode"))


def warmup(matrix_types=tuple(FORMATS), head_types=(), int8_inputs: bool = False, fused: bool = True,
           kv_dtype: str = "float32", heads: tuple = (64, 1)) -> float:
    """Compile (or load from Numba's cache) what a model needs, and nothing else, so that a first run compiles only
    its own format: for its blocks' weight classes (`matrix_types`: classes, or a tuple of four per kind of layer,
    wqkv's, wo's, w_in's, w_out's, where a file mixes formats in a layer) the one-row, tiled and prompt-chunk linears
    and (if `fused`) the one-call block of each kind of layer; for its output head's class (`head_types`) the
    one-row linear (the head sees one row per sequence: its tiled kernel waits for batches, warmup_paged); all for
    its activations setting (int8_inputs) and a KV cache of kv_dtype; attention for `heads` (the model's head size
    and query heads per KV head: kv_rows.py compiles code for them) and the small ops.

    Where the cache lacks this model's fused blocks (a first run), both cores compile what a first prompt and its
    decoding need, and nothing more: a second process decode attention on one thread (and the small ops, with
    quantized weights), this one the one-row linears (and the small ops, with fp32 weights). Then a background process compiles the prompt
    kernels (the tiles and panels, tiled attention, the parallel decode attention) and the fused blocks; meanwhile
    this process prefills a short prompt in chunks that the decode kernels take (prefill_chunk) and decodes op by op
    (blocks_ready). TINYLLM_WAIT_FOR_BLOCKS=1 compiles it all here. -> seconds it took."""
    global _threaded_helper
    t0 = time.perf_counter()
    layers = {_layer_formats(t) for t in matrix_types}
    matrices = {f for fmt in layers for f in _each_matrix(fmt)}
    head_formats = {FORMATS[t] for t in head_types}
    int8_inputs_of = {fmt: int8_inputs and fmt is not None for fmt in matrices | head_formats}   # quantized only
    batched = any(key[0] == "paged" for key in _done)                         # a pool exists: heads see batches
    heads = tuple(heads)
    layer_int8 = {fmt: int8_inputs and any(f is not None for f in _each_matrix(fmt)) for fmt in layers}
    blocks = [(fmt, layer_int8[fmt], kv_dtype, heads) for fmt in layers
              if fused and FUSED_ROWS and ("block", fmt, layer_int8[fmt], kv_dtype, heads) not in _done
              and (fmt, layer_int8[fmt], kv_dtype, heads) not in _pending]
    names = sorted({fmt or "fp32" for fmt in matrices | head_formats})
    what = " and ".join(names) + " weights" + (" with int8 activations" if any(int8_inputs_of.values()) else "")
    with compile_notice(t0, what) as notice:
        missing = [b for b in blocks if not _in_the_cache([b], "plain")]
        head_linears = [(fmt, int8_inputs_of[fmt]) for fmt in head_formats - matrices]
        # (TINYLLM_WAIT_FOR_BLOCKS=1: everything compiled here, so that the first step fuses; the test suite's
        # fused-step tests expect that)
        first_run = bool(missing) and os.environ.get("TINYLLM_WAIT_FOR_BLOCKS", "0") == "0"
        # the small ops on the side with less to do: on a first run the helper's with quantized weights (their
        # one-row linears take longer to compile than decode attention on one thread), else with int8 activations
        # (the prompt chunk's integer tiles take longer than the float ones)
        ops_there = any(any(f is not None for f in _each_matrix(fmt)) if first_run else int8
                        for fmt, int8, _, _ in missing)
        helper = _in_a_second_process("first" if first_run else "decode", missing, head_linears,
                                      ops_there) if missing else None
        first_run = first_run and helper is not None
        if helper is not None:      # meanwhile, here: the one-row linears (a first run) or the prompt kernels
            if first_run:
                warm_decode_kernels(missing, head_linears, first_run=True)
            else:
                _warm_attention(kv_dtype, heads, ("prefill",))
                for fmt in matrices:
                    _warm_linear(fmt, int8_inputs_of[fmt], PANEL_MIN_ROWS)
            if not ops_there:
                _warm_ops()
            _wait(helper)
        # then the rest: loaded from the cache where the helper compiled it (while a background process compiles
        # the prompt kernels, a first run's or an earlier call's, the decode kernels only, attention on one thread)
        decode_only = first_run or not prompt_kernels_ready()
        for fmt in int8_inputs_of:
            for rows in (1,) if decode_only else (1, TILE_MIN_ROWS, PANEL_MIN_ROWS) if fmt in matrices or batched \
                    else (1,):
                _warm_linear(fmt, int8_inputs_of[fmt], rows)
        _warm_attention(kv_dtype, heads, ("one thread",) if decode_only else ("decode", "prefill"))
        _warm_ops()
        later = []
        # the missing blocks (and on a first run the prompt kernels, first): compiled in the background and loaded
        # when they are ready
        if first_run:
            background = _in_a_second_process(("prompt", "plain", "threaded"), missing)
            if background is None:  # (no second process after all: the prompt kernels here, as before)
                warm_prompt_kernels(missing)
            else:                   # (ours, or another first run's: either writes the marker file)
                if background is not _ELSEWHERE:
                    _prompt_marker(missing).unlink(missing_ok=True)     # (a dead run's: ours takes seconds)
                _pending_prompt.append((_prompt_marker(missing), missing))
                dispatch.one_thread_attention = True
            if background is not None:
                _pending.extend(missing)
                _pending_threaded.extend(missing)
                _pending_groups.append(missing)
                later = missing
                plain_blocks_only()   # (then the threaded ones, when they are ready too)
                notice.later = (" (the prompt kernels and fused decode blocks go on in the background: until then, "
                                "prompts and decoding are slower)")
        now = [b for b in blocks if b not in later]
        if now and _threaded_helper is None and not _in_the_cache(now, "threaded"):   # (one helper per process
            _threaded_helper = _in_a_second_process(("threaded",), now)               # at most, and per machine)
        if _threaded_helper is None or _in_the_cache(now, "threaded"):
            compile_blocks(now, ("plain", "threaded"))
        else:                       # being compiled by a second process: this one runs the plain blocks meanwhile
            compile_blocks(now, ("plain",))
            plain_blocks_only()
            _pending_threaded.extend(now)
            _pending_groups.append(now)
    return time.perf_counter() - t0


_pending: list = []     # fused blocks whose plain kind a second process is compiling (op by op until it is ready)
_pending_prompt: list = []   # (marker file, blocks): a background process compiling their prompt kernels first
_pending_threaded: list = []   # fused blocks whose threaded kind it is compiling (the plain ones run until then)
_pending_groups: list = []   # both as the lists given to the second processes (each has its own lock)
RESTARTS = 1            # how often a process starts the background compile again if its helper died
_restarts_left = RESTARTS
LOOK_EVERY_S = 1.0      # how often blocks_ready looks in the cache for them
_next_look = 0.0


def blocks_ready() -> bool:
    """Whether the fused blocks may run: yes, unless warmup left their plain kind to compile in a second process (a
    first run; this process decodes op by op meanwhile). Once that process has put the plain ones in the disk cache,
    they are loaded here (not compiled) and run; once it has put the threaded ones there too, those are loaded and
    run from then on. Looks in the cache once every LOOK_EVERY_S at most (and whether the prompt kernels are ready:
    then decode attention runs on both threads again)."""
    global _next_look
    if not _pending and not _pending_threaded:
        return True
    now = time.monotonic()
    if now < _next_look:
        return not _pending
    _next_look = now + LOOK_EVERY_S
    prompt_kernels_ready()
    if _pending:
        if not _in_the_cache(_pending, "plain"):
            _restart_dead_helpers()
            return False
        compile_blocks(_pending, ("plain",))
        _pending.clear()
    elif _in_the_cache(_pending_threaded, "threaded"):
        compile_blocks(_pending_threaded, ("plain", "threaded"))   # (the plain ones are loaded: only marks them)
        _pending_threaded.clear()
        _pending_groups.clear()
        plain_blocks_only(False)
    else:
        _restart_dead_helpers()
    return True


FIRST_RUN_CHUNK = TILE_MIN_ROWS - 1   # prompt tokens a pass takes while the prompt kernels compile: the one-row
                                      # linears and decode attention take them
LONG_PROMPT = 4 * PREFILL_CHUNK       # more tokens than this left: the prompt kernels compiled here, not waited for


def prefill_chunk(remaining: int) -> int:
    """How many of a prompt's `remaining` tokens the next pass takes: PREFILL_CHUNK, or on a first run, while a
    background process compiles the prompt kernels (warmup), FIRST_RUN_CHUNK; with more than LONG_PROMPT tokens
    left, those kernels are compiled here then (with the notice), as they were at load before."""
    if _pending_prompt and not prompt_kernels_ready():
        if remaining <= LONG_PROMPT:
            return FIRST_RUN_CHUNK
        t0 = time.perf_counter()
        with compile_notice(t0, "long prompts"):
            for entry in list(_pending_prompt):
                warm_prompt_kernels(entry[1])
                _pending_prompt.remove(entry)
        dispatch.one_thread_attention = False
    return PREFILL_CHUNK


def prompt_kernels_ready() -> bool:
    """Whether the prompt kernels are in the cache: the background process that compiles them first (warmup: this
    run's or another's) has written its marker file, or no longer holds its lock (it ended; if it failed, a prompt
    chunk compiles them on its first call). Then decode attention runs on both threads again."""
    for entry in list(_pending_prompt):
        marker, blocks = entry
        if marker.exists() or not _held(_lock_path(blocks)):
            _pending_prompt.remove(entry)
    if not _pending_prompt:
        dispatch.one_thread_attention = False
    return not _pending_prompt


def _prompt_marker(blocks) -> Path:
    """The file a background process writes once it has compiled the prompt kernels for `blocks` (and removes when
    it ends)."""
    return _lock_path(blocks).with_suffix(".prompt")


def _restart_dead_helpers() -> None:
    """Start the background compile again for pending blocks whose helper died without filling the cache (killed by
    SIGKILL or the out-of-memory killer, or it failed): else this process would decode op by op for the rest of its
    life. At most RESTARTS times per process, so a helper that fails every time is not restarted forever."""
    global _restarts_left
    for group in list(_pending_groups):     # (the cache again after the lock: the helper may have just finished)
        if _restarts_left > 0 and not _held(_lock_path(group)) and not all(
                _in_the_cache(group, kind) for kind in ("plain", "threaded")):
            _restarts_left -= 1
            _in_a_second_process(("plain", "threaded"), group)


def _wait(helper) -> None:
    try:
        helper.wait(timeout=HELPER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        helper.kill()


def compile_blocks(blocks, kinds=("plain", "threaded")) -> None:
    """Compile (or load) the fused blocks of `kinds` for each (weight format, int8 activations, kv_dtype, heads) in
    `blocks`. Asked for both, a quantized layer's plain block is left in the disk cache if it is there: its decode
    steps run the threaded block, and the plain one (passes of TILE_MIN_ROWS .. FUSED_ROWS rows: a short prompt, a
    draft's verification) loads on its first call, as a function of Numba's cache does."""
    # Numba's threading layer first: a plain block loaded from the cache crashed if no parallel kernel had run yet
    numba.get_num_threads()
    for block in blocks:
        fmt, int8_inputs, kv_dtype, heads = block
        fmt, heads = _spec(fmt, heads)
        load = kinds
        if len(kinds) == 2 and _each_matrix(fmt)[0] is not None and _in_the_cache([block], "plain"):
            load = ("threaded",)
        _warm_decode_block(fmt, int8_inputs, kv_dtype, heads, load)
        if len(kinds) == 2:
            _done.add(("block", fmt, int8_inputs, kv_dtype, heads))


def _in_a_second_process(task, blocks, head_linears=(), ops: bool = False):
    """Compile for `blocks` in a second process (Numba compiles one function at a time per process): task "decode",
    their decode kernels, head_linears' and (if `ops`) the small ops (warm_decode_kernels; waited for, while this
    process compiles the prompt kernels), or "first", a first run's share (warm_first_run), or a
    tuple of fused block kinds ("plain", "threaded"), first "prompt" if it is there (warm_prompt_kernels, then a
    marker file: _prompt_marker), at the lowest priority and not waited for (at most one such process per machine
    for the same blocks, by a lock file). -> the process, _ELSEWHERE (another process holds the lock: it will fill
    the cache), or None (one core, TINYLLM_COMPILE_HELPER=0, or no way to start it: this process compiles it all)."""
    if not blocks or (os.cpu_count() or 1) < 2 or os.environ.get("TINYLLM_COMPILE_HELPER", "1") == "0":
        return None
    background = task not in ("decode", "first")   # the blocks: not waited for, not stopped by this run's Ctrl-C
    lock = ""
    try:
        if background:
            lock = _claim(blocks)
            if lock is None:
                return _ELSEWHERE
        paths = (str(_ROOT), os.environ.get("PYTHONPATH"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        code = ("import importlib, json, os, sys\nw = importlib.import_module('tinyllm.kernels.warmup')\n"
                "task, blocks, heads, ops = (json.loads(a) for a in sys.argv[1:5])\n"
                "if task == 'decode':\n    w.warm_decode_kernels(blocks, heads, ops)\n"
                "elif task == 'first':\n    w.warm_first_run(blocks, ops)\n"
                "elif 'prompt' in task:\n    w.warm_prompt_kernels(blocks)\n"
                "    w._prompt_marker(blocks).touch()\n"
                "if task not in ('decode', 'first'):\n"
                "    w.compile_blocks(blocks, tuple(k for k in task if k != 'prompt'))\n"
                "    w._prompt_marker(blocks).unlink(missing_ok=True)\n"
                "if sys.argv[5]:\n    os.remove(sys.argv[5])")
        lowest = background and hasattr(os, "nice")                 # (at the lowest priority: not in the way of
        arguments = [*map(json.dumps, (task, blocks, head_linears, ops)), lock]             # this run's threads)
        process = subprocess.Popen([sys.executable, "-c", code, *arguments], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(19)) if lowest else None,
                                   start_new_session=background)
        if lock:
            Path(lock).write_text(str(process.pid))     # the lock's holder: _held checks that it is alive
        return process
    except (AttributeError, OSError):
        if lock:                                        # (not started: nobody will fill the cache)
            Path(lock).unlink(missing_ok=True)
        return None


_ELSEWHERE = "compiling in another process"
_ROOT = Path(__file__).resolve().parents[2]     # the folder holding this tinyllm package
LOCK_STALE_S = 900      # a lock file older than this: its helper hangs or died; take over
UNWRITTEN_S = 30        # a lock file without a pid for longer than this: its process died before starting the helper


def _lock_path(blocks) -> Path:
    """The lock file for compiling these fused blocks: one per machine, package, Python and Numba cache."""
    key = json.dumps([str(_ROOT), sys.executable, os.environ.get("NUMBA_CACHE_DIR", ""), blocks])
    return Path(tempfile.gettempdir()) / f"tinyllm-blocks-{hashlib.sha1(key.encode()).hexdigest()[:16]}.lock"


def _claim(blocks) -> str | None:
    """The lock file for compiling these fused blocks, created -> its path, or None if another process holds it."""
    path = _lock_path(blocks)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return str(path)
        except FileExistsError:
            if _held(path):
                return None
            try:
                path.unlink()               # (its holder is gone: take it over)
            except FileNotFoundError:       # (another process took it over first: try to create it again)
                pass
            except OSError:
                return None
    return None


def _held(path: Path) -> bool:
    """Whether a lock file is held: it names a live process (the helper's pid, written when it started) and is
    younger than LOCK_STALE_S, or it is too new to name one yet."""
    try:
        age, text = time.time() - path.stat().st_mtime, path.read_text().strip()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if age > LOCK_STALE_S:
        return False
    if not text.isdigit():
        return age < UNWRITTEN_S
    return _alive(int(text))


def _alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (one that died and that its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # (another user's: alive)
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):       # (no /proc: not Linux)
        return True


def warmup_paged(kv_dtype: str = "float32", heads: tuple = (64, 1)) -> float:
    """Compile (or load) what batches need: the paged-attention kernel for blocks of kv_dtype (and the other
    attention kernels of that format), and the tiled linears of output heads warmed so far for one row only.
    PagedKVCache calls it when a pool is made, so only users of a paged pool pay for it; on a first run it waits
    for the prompt kernels (a server's first batch would compile them otherwise). -> seconds it took."""
    one_row_only = [(fmt, int8_inputs) for _, fmt, int8_inputs, rows in (key for key in _done if key[0] == "linear")
                    if rows == 1 and ("linear", fmt, int8_inputs, TILE_MIN_ROWS) not in _done]
    heads = tuple(heads)
    if ("paged", kv_dtype, heads) in _done and not one_row_only and prompt_kernels_ready():
        return 0.0
    t0 = time.perf_counter()
    with compile_notice(t0, f"batches (paged attention over {kv_dtype} blocks)"):
        H, KVH, Dh = _dummy_heads(heads, kv_dtype)
        blocks = kv_storage((2, 2, KVH, Dh), kv_dtype)              # [NB, BS, KVH, Dh]
        blocks[:] = np.ones((2, 2, KVH, Dh), np.float32)
        paged_attention(np.ones((2, H, Dh), np.float32), blocks, blocks, np.zeros((2, 1), np.int32),
                        np.ones(2, np.int32))
        if not prompt_kernels_ready():      # (a first run: what its background process compiles last, here)
            _warm_attention(kv_dtype, heads, ("decode",))
        while not prompt_kernels_ready() and time.perf_counter() - t0 < HELPER_TIMEOUT_S:
            time.sleep(0.1)                                         # (then loaded from the cache below)
        _warm_attention(kv_dtype, heads)
        for fmt, int8_inputs in one_row_only:                       # a head's tiled kernel: a batch's logits
            _warm_linear(fmt, int8_inputs, TILE_MIN_ROWS)
    _done.add(("paged", kv_dtype, heads))
    return time.perf_counter() - t0


def nothing_cached() -> bool:
    """Whether Numba's disk cache holds no kernel of this tinyllm at all (a fresh install, or one just upgraded):
    rmsnorm is in every model's warm-up."""
    try:
        return not rmsnorm_into._cache._cache_file._load_index()   # (Numba's index of the kernel's cached versions)
    except (AttributeError, OSError):
        return False


@contextmanager
def compile_notice(t0: float, what: str = "this model", after: float = NOTICE_AFTER_S):
    """Say on stderr that kernels are being compiled, and for what, when loading them takes longer than `after`
    seconds (the cache lacks them: a fresh install, or weights of a format this install has not run before), and
    how long it took at the end, with what the body adds to `.later` (what goes on compiling in the background). A
    warm start prints nothing."""
    shown, said = threading.Event(), SimpleNamespace(later="")
    why = "a fresh install's first run" if nothing_cached() else "the first run with these"

    def notice():
        shown.set()
        print(f"tinyllm: compiling the Numba kernels for {what} ({why}; they are cached on disk) ...",
              file=sys.stderr, flush=True)
    timer = threading.Timer(after, notice)
    timer.daemon = True
    timer.start()
    try:
        yield said
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"tinyllm: kernels compiled in {time.perf_counter() - t0:.1f} s{said.later}", file=sys.stderr,
                  flush=True)
