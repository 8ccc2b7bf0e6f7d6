"""Interventions: change one part of a forward pass and watch the output, to learn what that part is for.

    model.logits(ids, ablate=[(3, 5)])                     # head 5 of layer 3 writes nothing
    clean = Trace(); model.logits(clean_ids, trace=clean)  # a run to take values from
    model.logits(ids, patch=[Patch.residual(clean, layer=4, positions=[2])])      # activation patching
    tinyllm.generate(model, prompt, ablate=[(3, 5)])       # every pass of a generation, prefill and decode

Ablating a head zeroes its output (its Dh columns of the attention output, before the output projection wo) at
every position. Patching replaces, at chosen positions, the residual stream leaving a block, or one head's output,
with the values a traced run of another prompt computed there (causal tracing: Meng et al. 2022; activation
patching as in Wang et al. 2022). The hook points are TransformerLens's `hook_z` (a head's output) and
`hook_resid_post` (a block's output). An intervened pass runs op by op, as a traced one does: the fused decode
block knows nothing of this, so a pass without interventions pays nothing.
Left out: mean or resampling ablation, path patching, hooks that run arbitrary code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Patch:
    """Values to put in place of what a pass computes: after block `layer` (head None: the residual stream, [P, D])
    or head `head` of layer `layer` (its output before wo, [P, Dh]), at the absolute `positions` (P of them)."""
    layer: int
    positions: tuple
    values: np.ndarray                  # [P, D] or [P, Dh]
    head: int | None = None

    @classmethod
    def residual(cls, trace, layer: int, positions, source_positions=None) -> "Patch":
        """The residual stream leaving block `layer` as `trace` recorded it at source_positions (default: the same
        positions), to put at `positions`."""
        src = _source(positions, source_positions)
        return cls(int(layer), tuple(int(p) for p in positions), trace.layer_output(layer)[src])   # [P, D]

    @classmethod
    def head_output(cls, trace, layer: int, head: int, positions, source_positions=None) -> "Patch":
        """Head `head` of layer `layer`'s output as `trace` recorded it, to put at `positions`."""
        src = _source(positions, source_positions)
        out = trace.head_outputs(layer)[src, int(head)]                                            # [P, Dh]
        return cls(int(layer), tuple(int(p) for p in positions), out, int(head))


def _source(positions, source_positions) -> list[int]:
    src = list(positions if source_positions is None else source_positions)
    if len(src) != len(list(positions)):
        raise ValueError(f"a patch takes one source position per position: got {len(src)} source positions for "
                         f"{len(list(positions))} positions")
    return src


class Interventions:
    """The ablations and patches of one run, checked against the model's shapes; the model calls `heads` on each
    layer's attention output and `residual` on each block's output."""

    def __init__(self, config, ablate=(), patch=()):
        H, L = config.n_heads, config.n_layers
        self.ablated: dict[int, list[int]] = {}       # layer -> heads to zero
        for pair in ablate:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(_is_int(x) for x in pair)):
                raise ValueError(f"ablate takes (layer, head) pairs of integers, got {pair!r}")
            layer, head = int(pair[0]), int(pair[1])
            _check_range("layer", layer, L)
            _check_range("head", head, H)
            self.ablated.setdefault(layer, []).append(head)
        self.patches: list[Patch] = [patch] if isinstance(patch, Patch) else list(patch)
        for p in self.patches:
            if not isinstance(p, Patch):
                raise ValueError(f"patch takes Patch objects (Patch.residual / Patch.head_output), got "
                                 f"{type(p).__name__}")
            _check_range("layer", p.layer, L)
            width = config.dim if p.head is None else config.head_dim
            if p.head is not None:
                _check_range("head", p.head, H)
            if np.shape(p.values) != (len(p.positions), width):
                raise ValueError(f"patch values have shape {np.shape(p.values)}, need ({len(p.positions)}, {width}): "
                                 f"one row per position of the {'residual (D)' if p.head is None else 'head (Dh)'}")
            if min(p.positions, default=0) < 0:
                raise ValueError(f"patch positions must be >= 0, got {list(p.positions)}")
        self.head_dim = config.head_dim

    def check_positions(self, n_positions: int) -> None:
        """A clear error for a patch position a run of n_positions never reaches."""
        for p in self.patches:
            if max(p.positions, default=0) >= n_positions:
                raise ValueError(f"patch position {max(p.positions)} is never reached: this run has positions "
                                 f"0 .. {n_positions - 1}")

    def heads(self, layer: int, att: np.ndarray, start: int) -> np.ndarray:
        """att [T, H*Dh], the attention output of positions start.. at `layer`, with the ablations and head patches
        of that layer applied (a copy; att itself is left alone)."""
        Dh = self.head_dim
        ablated = self.ablated.get(layer, [])
        patches = [p for p in self.patches if p.layer == layer and p.head is not None]
        if not ablated and not patches:
            return att
        att = att.copy()
        for h in ablated:
            att[:, h * Dh:(h + 1) * Dh] = 0                         # [T, Dh]: this head adds nothing
        for p in patches:
            for t, row in _rows_in_pass(p, start, att.shape[0]):
                att[t, p.head * Dh:(p.head + 1) * Dh] = row          # [Dh]
        return att

    def residual(self, layer: int, x: np.ndarray, start: int) -> np.ndarray:
        """x [T, D], the residual stream leaving block `layer` at positions start.., with that layer's patches."""
        patches = [p for p in self.patches if p.layer == layer and p.head is None]
        if not patches:
            return x
        x = x.copy()
        for p in patches:
            for t, row in _rows_in_pass(p, start, x.shape[0]):
                x[t] = row                                           # [D]
        return x


def _rows_in_pass(p: Patch, start: int, T: int):
    """(row in this pass, value) for each of the patch's positions that falls in positions start .. start+T-1."""
    return [(pos - start, p.values[j]) for j, pos in enumerate(p.positions) if start <= pos < start + T]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_range(name: str, i: int, n: int) -> None:
    if not 0 <= i < n:
        raise ValueError(f"{name} {i} is out of range: the model has {n} {name}s (0 .. {n - 1})")


def make_interventions(config, ablate=(), patch=()) -> Interventions | None:
    """An Interventions of the ablate / patch arguments, or None when there are none (the pass stays untouched)."""
    if not ablate and (patch is None or (not isinstance(patch, Patch) and not patch)):
        return None
    return Interventions(config, ablate or (), patch if patch is not None else ())
