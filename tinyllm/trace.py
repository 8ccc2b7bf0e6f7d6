"""What a run did inside: per layer q, k (after RoPE) and v of every position, attention probabilities, the
residual stream's norm, a logit lens, and the sampling stages of every generated token.

    out = tinyllm.generate(model, "The capital of France is", max_new_tokens=8, trace=True)
    tr = out.trace
    tr.tokens                 # the text of every position that went through the model, prompt then generated
    tr.attention(layer)       # [H, S, S]: row t = the probabilities position t gave to positions 0..t
    tr.logit_lens(layer)      # top tokens of the final norm + head applied to that layer's output
    tr.sampling[i]            # the stages that chose generated token i

A Trace is an explicit object handed to the forward pass (`model.logits(ids, trace=tr)`, `model.prefill(ids,
cache, trace=tr)`, `generate(..., trace=True)`); without one nothing is recorded and nothing is paid. A traced
pass runs op by op (the fused decode block records nothing), on either backend and either cache; its tokens are
the untraced run's. The attention probabilities are recomputed from the recorded q and k, which is what
attention computes (the kernels never hold the [S, S] matrix). With a float16 or int8 cache the recorded k and v
are the stored, rounded values attention read, not the exact ones the layer computed (and with int8, q rounded
to int8 blocks as attention used it: kv_cache.query_for). Memory is bounded: pick layers and heads, and a
run past `max_positions` positions stops with a clear error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import ops
from .backend import NumpyOps

LENS_TOP = 5        # logit lens: top tokens kept per position
STAGES_TOP = 10     # sampling stages: top tokens kept per stage


class TraceLimitError(ValueError):
    """The traced run outgrew the trace's position cap."""


@dataclass
class StageTop:
    """The most likely tokens after one sampling stage."""
    stage: str                  # "raw", "repetition penalty", "temperature", "top-k", "top-p", "min-p", "greedy"
    ids: list[int]              # up to STAGES_TOP ids that survived the stage (probability > 0), most likely first
    probs: list[float]          # their probabilities in this stage's distribution
    kept: int = 0               # how many tokens survived the stage in all (the vocabulary, before any cut)


@dataclass
class SampledToken:
    """How one generated token was chosen: the stages in order, the token drawn and its final probability."""
    stages: list[StageTop]
    token: int
    prob: float


@dataclass
class _LayerRecord:
    q: list = field(default_factory=list)          # per pass: [T, H, Dh] after RoPE
    k: list = field(default_factory=list)          # per pass: [T, KVH, Dh] after RoPE, as the cache stores it
    v: list = field(default_factory=list)          # per pass: [T, KVH, Dh] as the cache stores it
    norms: list = field(default_factory=list)      # per pass: [T, 3] |x| entering, after attention, after MLP
    out: list = field(default_factory=list)        # per pass: [T, D] the block's output (for the logit lens)


class Trace:
    """Recorder of a run's internals. layers / heads: which to keep (default all); max_positions: the cap."""

    def __init__(self, layers=None, heads=None, max_positions: int = 1024):
        if not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"invalid max_positions={max_positions!r}: must be an integer >= 1")
        self.layers_wanted = None if layers is None else sorted(set(int(i) for i in layers))
        self.heads_wanted = None if heads is None else sorted(set(int(h) for h in heads))
        self.max_positions = max_positions
        self.token_ids: list[int] = []
        self.sampling: list[SampledToken] = []
        self._layers: dict[int, _LayerRecord] = {}
        self._model = None

    # --- recording (called by the model and the generation loop) -------------------------------------------------
    def begin_pass(self, model, ids, start: int) -> None:
        """A forward pass of `ids` at positions start.. is about to run."""
        if self._model is None:
            self._bind(model)
        if start != len(self.token_ids):
            raise ValueError(f"a trace follows one sequence: this pass starts at position {start}, the trace holds "
                             f"{len(self.token_ids)} (use a new Trace for a new sequence)")
        if start + len(ids) > self.max_positions:
            raise TraceLimitError(f"the trace is capped at {self.max_positions} positions and this run reaches "
                                  f"{start + len(ids)}: trace a shorter run or raise max_positions (memory grows "
                                  f"with positions x layers)")
        self.token_ids.extend(int(i) for i in ids)

    def _bind(self, model) -> None:
        c = model.config
        for name, chosen, n in (("layer", self.layers_wanted, c.n_layers), ("head", self.heads_wanted, c.n_heads)):
            if chosen is not None and (not chosen or chosen[0] < 0 or chosen[-1] >= n):
                raise ValueError(f"trace {name}s {chosen} are out of range: the model has {n} (0 .. {n - 1})")
        self._model = model
        self._layers = {i: _LayerRecord() for i in (self.layers_wanted or range(c.n_layers))}

    def records_layer(self, i: int) -> bool:
        return i in self._layers

    def record_layer(self, i: int, q, k, v, x_in, x_mid, x_out) -> None:
        """One layer of one pass: q [T, H, Dh], k, v [T, KVH, Dh], and the residual stream [T, D] entering the
        block, after its attention and after its MLP."""
        r = self._layers[i]
        r.q.append(np.array(q, dtype=np.float32))
        r.k.append(np.array(k, dtype=np.float32))
        r.v.append(np.array(v, dtype=np.float32))
        r.norms.append(np.stack([np.linalg.norm(x, axis=-1) for x in (x_in, x_mid, x_out)], axis=-1))
        r.out.append(np.array(x_out, dtype=np.float32))

    def record_sampling(self, stages: list, token: int) -> None:
        """The (name, p [V]) stages of sampling.sample for one generated token, and the token drawn."""
        kept = []
        for name, p in stages:
            survivors = int(np.count_nonzero(p))
            top = np.argsort(-p, kind="stable")[:min(STAGES_TOP, survivors)]   # a cut token is not a candidate
            kept.append(StageTop(name, [int(t) for t in top], [float(p[t]) for t in top], survivors))
        self.sampling.append(SampledToken(kept, int(token), float(stages[-1][1][token])))

    # --- reading ------------------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[str]:
        """The text of every position that went through the model (a piece of a UTF-8 character shows as �)."""
        tok = self._model.tokenizer if self._model is not None else None
        if tok is None:
            return [str(i) for i in self.token_ids]
        return [tok.id_to_bytes(i).decode("utf-8", errors="replace") for i in self.token_ids]

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    @property
    def heads(self) -> list[int]:
        return self.heads_wanted if self.heads_wanted is not None else list(range(self._model.config.n_heads))

    def _cat(self, layer: int, name: str) -> np.ndarray:
        if layer not in self._layers:
            raise ValueError(f"layer {layer} was not traced; traced layers: {self.layers}")
        parts = getattr(self._layers[layer], name)
        if not parts:
            raise ValueError("nothing was traced yet: run the model with this trace first")
        return np.concatenate(parts)

    def q(self, layer: int) -> np.ndarray:
        """[S, H, Dh] every position's queries (after RoPE)."""
        return self._cat(layer, "q")

    def k(self, layer: int) -> np.ndarray:
        """[S, KVH, Dh] every position's keys (after RoPE: as the cache stores them)."""
        return self._cat(layer, "k")

    def v(self, layer: int) -> np.ndarray:
        """[S, KVH, Dh] every position's values."""
        return self._cat(layer, "v")

    def layer_output(self, layer: int) -> np.ndarray:
        """[S, D] the residual stream leaving block `layer` at every position (what the logit lens reads)."""
        return self._cat(layer, "out")

    def head_outputs(self, layer: int) -> np.ndarray:
        """[S, H, Dh] every head's output at every position: its attention probabilities times the values, what
        the output projection wo reads (recomputed from the recorded q, k, v, as `attention` is)."""
        q, k, v = self.q(layer), self.k(layer), self.v(layer)        # [S, H, Dh], [S, KVH, Dh] x 2
        return ops.attention(q, k, v, 0, self._model.alibi_slopes).reshape(q.shape)   # [S, H, Dh]

    def residual_norms(self, layer: int) -> np.ndarray:
        """[S, 3] the residual stream's L2 norm per position: entering the layer, after attention, after the MLP."""
        return self._cat(layer, "norms")

    def attention(self, layer: int) -> np.ndarray:
        """[H, S, S] float32 for the traced heads: row t holds the probabilities position t gave to positions
        0..t (zeros above the diagonal), prefill and decode rows in one matrix."""
        q, k = self.q(layer), self.k(layer)                          # [S, H, Dh], [S, KVH, Dh]
        S, H, Dh = q.shape
        G = H // k.shape[1]
        heads = self.heads
        kh = k[:, [h // G for h in heads]].transpose(1, 2, 0)        # [h, Dh, S]: each head's KV head (GQA)
        scores = (q[:, heads].transpose(1, 0, 2) @ kh) / np.float32(np.sqrt(Dh))   # [h, S, S]
        if self._model.alibi_slopes is not None:                     # ALiBi: minus slope x distance
            distance = (np.arange(S)[None, :] - np.arange(S)[:, None]).astype(np.float32)   # [S, S]
            scores = scores + self._model.alibi_slopes[heads][:, None, None] * distance
        causal = np.tril(np.ones((S, S), dtype=bool))
        probs = ops.softmax(np.where(causal, scores, np.float32(-np.inf)), axis=-1)
        return np.where(causal, probs, 0).astype(np.float32)

    def logit_lens(self, layer: int, top: int = LENS_TOP, positions=None) -> tuple[np.ndarray, np.ndarray]:
        """The final norm and output head applied to the layer's output at every position (or only at
        `positions`, a list: the head is the costly part): what the model would predict if it stopped there
        (nostalgebraist 2020). -> (ids [S, top], probs [S, top]), most likely first; for the last layer these are
        the model's own predictions."""
        m = self._model
        x = self.layer_output(layer)                                 # [S, D]
        if positions is not None:
            x = x[list(positions)]                                   # [P, D]
        if m.config.norm == "rms":
            h = ops.rmsnorm(x, m.final_norm, m.config.norm_eps)
        else:
            h = ops.layernorm(x, m.final_norm, m.final_norm_b, m.config.norm_eps)
        logits = NumpyOps.linear(h, m.lm_head, int8_inputs=m.int8_inputs) / m.config.logit_scale   # [S, V]
        p = ops.softmax(logits.astype(np.float64), axis=-1)
        ids = np.argsort(-p, axis=-1, kind="stable")[:, :top]        # [S, top]
        return ids, np.take_along_axis(p, ids, axis=-1)

    def __repr__(self) -> str:
        return (f"Trace({len(self.token_ids)} positions, layers {self.layers}, {len(self.heads) if self._model else '?'} "
                f"heads, {len(self.sampling)} sampled tokens)")
