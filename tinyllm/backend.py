"""Backend: what runs a model's forward pass. model.py says what is computed; a backend says with which code.

    NumpyBackend   ops.py's plain numpy for every pass: the code to read and step through in a debugger
    NumbaBackend   kernels/: compiled linears that read each weight format's own bytes, attention over the
                   cache's stored format, a Llama block of a decode step as one compiled call, warm-up

Each offers the same few things to the model: `ops_for(n_rows)`, the functions a pass of that many rows runs
(linear, rmsnorm, layernorm, apply_rope, swiglu, gelu_tanh, gelu, attention, paged_attention);
`prefill_chunk(remaining)`, how many of a prompt's remaining tokens the next pass takes; `decode_blocks(model, x,
segment)`, the fused block when `fuses` says so; and `warm_up`, compiling what a model and a cache format need
before the first request; `governed(key)`, the thread count of a step (threads.py: fewer threads while other work
keeps the cores busy).
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import numpy as np

from . import ops
from .kv_cache import ContiguousKVCache, attention_inputs
from .quant import QuantizedWeight, round_activations
from .threads import ThreadGovernor, free_threads, note_kernel_thread, step_threads

BACKENDS = ("numba", "numpy")


class NumpyOps:
    """ops.py for a model's weights and caches: quantized weights and stored K/V are made float32 first."""
    rmsnorm, layernorm, swiglu = staticmethod(ops.rmsnorm), staticmethod(ops.layernorm), staticmethod(ops.swiglu)
    gelu_tanh, gelu, apply_rope = staticmethod(ops.gelu_tanh), staticmethod(ops.gelu), staticmethod(ops.apply_rope)

    @staticmethod
    def linear(x: np.ndarray, w, b: np.ndarray | None = None, int8_inputs: bool = False) -> np.ndarray:
        """ops.linear on a weight of any format. With int8_inputs (activations="int8") a quantized weight's input
        is rounded to int8 blocks first, as the kernels round it; float32 weights always take x as it is."""
        if isinstance(w, QuantizedWeight):
            if int8_inputs:
                x = round_activations(x)                    # [T, I], each value now int8 * its block's scale
            w = w.dequantize()                              # [O, I] float32
        return ops.linear(x, w, b)

    @staticmethod
    def attention(q: np.ndarray, k, v, start: int) -> np.ndarray:
        """ops.attention over K and V in any stored format (kv_cache.attention_inputs). -> [T, H*Dh]"""
        return ops.attention(*attention_inputs(q, k, v), start)

    @staticmethod
    def paged_attention(q, k_blocks, v_blocks, block_tables, context_lens) -> np.ndarray:
        """ops.paged_attention over blocks in any stored format. -> [B, H*Dh]"""
        return ops.paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, attend=NumpyOps.attention)


class NumpyBackend:
    name = "numpy"

    def prefill_chunk(self, remaining: int) -> int:
        return remaining                # a prompt in one pass: one big matmul per weight

    def ops_for(self, n_rows: int):
        return NumpyOps

    def fuses(self, n_rows: int) -> bool:
        return False                    # every block runs op by op, steppable

    def warm_up(self, model, kv_dtype: str = "float32") -> float:
        return 0.0

    def warm_up_paged(self, model, kv_dtype: str = "float32") -> float:
        return 0.0

    def governed(self, key, probe: bool = True):
        return nullcontext()            # (numpy's threads are BLAS's own)


class NumbaBackend:
    """The kernels of kernels/: which of them a pass of n rows runs is kernels.for_rows' rule (dispatch.py). What
    the fused block takes of each layer's weights and of each cache is prepared once and kept here, keyed weakly,
    so a cache or a draft model that goes away leaves nothing behind."""
    name = "numba"

    def __init__(self):
        from . import kernels           # imports numba: only a model that runs on it pays for that
        self.kernels = kernels
        self._layer_operands = weakref.WeakKeyDictionary()    # LayerWeights -> what the fused block takes of it
        self._last_layers = ((), [], 0)                       # (the layers of the last step, their operands, bytes)
        self._cache_operands = weakref.WeakKeyDictionary()    # cache -> per layer, what it takes of K and V
        self._paged_kv_dtypes = set()                          # the pool formats warmed up for
        self._governors = {}                                    # a step's shape -> its ThreadGovernor

    def ops_for(self, n_rows: int):
        return self.kernels.for_rows(n_rows)

    def prefill_chunk(self, remaining: int) -> int:
        """A longer prompt goes in chunks, each of which stays in the kernels (fewer while a first run's prompt
        kernels compile: warmup.prefill_chunk)."""
        return self.kernels.prefill_chunk(remaining)

    def fuses(self, n_rows: int) -> bool:
        return n_rows <= self.kernels.FUSED_ROWS and self.kernels.blocks_ready()   # (a first run: op by op until
                                                                                    # its blocks are compiled)

    def decode_blocks(self, model, x: np.ndarray, start: int, cache) -> None:
        """Every block of `model` for the few new tokens x [T, D] (updated in place) at positions start.., one
        compiled call per layer with no Python between the kernels (block.py); tests/test_model.py checks it
        against the op-by-op blocks."""
        c, T = model.config, x.shape[0]
        last, weights, weight_bytes = self._last_layers  # (a draft may share this backend with other layers)
        if len(last) != len(model.layers) or any(a is not b for a, b in zip(last, model.layers)):
            known = self._layer_operands
            weights = [known.get(layer) or known.setdefault(layer, self.kernels.block_weights(layer))
                       for layer in model.layers]
            weight_bytes = sum(w.nbytes for layer in model.layers             # (what the step reads)
                               for w in (layer.wqkv, layer.wo, layer.w_in, layer.w_out))
            self._last_layers = tuple(model.layers), weights, weight_bytes
        k, v, key = cache.contiguous()                   # [L, S, KVH, Dh] each (a paged sequence: its run of blocks)
        known = self._cache_operands.get(cache)
        if known is None or known[0] != key or len(known[1]) != len(weights):
            known = self._cache_operands[cache] = (key, [self.kernels.cache_operands(k[i], v[i], c.n_heads)
                                                         for i in range(len(weights))])
        caches = known[1]
        cos, sin = model.rope_cos[start:start + T], model.rope_sin[start:start + T]   # [T, Dh/2] each
        with self.governed(("fused", len(weights), T), step_bytes=weight_bytes) as step:
            step.fell_back = self.kernels.decode_blocks(x, weights, caches, start, cos, sin, c.n_heads, c.norm_eps,
                                                        model.int8_inputs, step.budget)

    @contextmanager
    def governed(self, key, probe: bool = True, step_bytes: int = 0):
        """Run the step inside on as many threads as the ThreadGovernor of `key` (the step's shape) chooses: the
        most allowed, unless fewer ran faster lately (a busy machine: threads.py); its time goes to the governor.
        Yields the step's `budget` (seconds, 0: none; from `step_bytes`, the weights it reads, until a best step is
        known) past which it should go on on one thread, and takes back whether it did (`fell_back`). probe=False
        (a prompt's pass: one such pass may be a whole request, too few to measure a count on): as many threads as
        cores are free right now."""
        note_kernel_thread()
        governor = self._governors.get(key) if probe else None
        if governor is None and probe:
            governor = self._governors[key] = ThreadGovernor()
        n = governor.choose() if probe else free_threads()
        if n != self.kernels.get_num_threads():
            step_threads(n)                             # (Numba's for this thread, and BLAS's; the head runs on n too)
        step = SimpleNamespace(budget=governor.budget(step_bytes) if probe else 0.0, fell_back=False)
        t0 = time.perf_counter()
        yield step
        if probe:
            governor.record(n, time.perf_counter() - t0, step.fell_back)

    def warm_up(self, model, kv_dtype: str = "float32") -> float:
        """Compile (or load from Numba's disk cache) the kernels of this model's weight formats, activations setting
        and a cache of kv_dtype, so that no step pays for it (a no-op for what is warm already). -> seconds"""
        note_kernel_thread()
        blocks = {tuple(type(w) for w in (layer.wqkv, layer.wo, layer.w_in, layer.w_out)) for layer in model.layers}
        heads = (model.config.head_dim, model.config.kv_mul)          # what attention compiles code for
        return self.kernels.warmup(blocks, {type(model.lm_head)}, model.int8_inputs, model.has_fusable_blocks,
                                   kv_dtype, heads)

    def warm_up_paged(self, model, kv_dtype: str = "float32") -> float:
        """What a batch over a paged pool of kv_dtype needs: the batched attention kernel, the batch's linears."""
        if kv_dtype in self._paged_kv_dtypes:
            return 0.0
        self._paged_kv_dtypes.add(kv_dtype)
        return self.kernels.warmup_paged(kv_dtype, (model.config.head_dim, model.config.kv_mul))


def make_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return NumbaBackend() if name == "numba" else NumpyBackend()
