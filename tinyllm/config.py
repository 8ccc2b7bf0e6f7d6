"""ModelConfig: the handful of numbers that fix a transformer's shapes, and the sizes that follow from them.

Dimension names used in shape comments across tinyllm (model, ops, kernels, caches):
    T  tokens of one sequence in a pass   S  positions in the KV cache (past + current); S_max its capacity
    N  rows of a pass (all its sequences) B  sequences in a batch
    D  model width (dim)                  F  feed-forward hidden width
    H  query heads                        KVH key/value heads (GQA: KVH divides H)
    G  query heads per KV head (H / KVH)  Dh head dim
    V  vocabulary size                    L  layers
    P  positions with a RoPE angle        NB blocks in a paged pool; BS positions per block
  and for a matrix multiply y = x W^T (kernels): M rows of x, I inputs (row length), O outputs (rows of W).
"""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "gpt2", "alibi")     # how positions enter: RoPE, learned embeddings, ALiBi's bias
# checkpoint families that run as RoPE blocks (arch "llama"), each difference a config field: qwen2 qkv_bias, qwen3
# qk_norm, granite embed_scale / logit_scale (and scales folded into weights at load: checkpoint.fold_scales),
# starcoder2 norm / mlp / biases, gpt_neox also rotary_dim and parallel_residual, olmo2 post_norm and qk_norm "all"
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "starcoder2", "gpt_neox", "olmo2")
# every Hugging Face model_type tinyllm runs: falcon is RoPE (or, falcon-rw, ALiBi), mpt ALiBi, gpt2 learned positions
FAMILIES = LLAMA_FAMILIES + ("falcon", "mpt", "gpt2")
NORMS, MLPS = ("rms", "layer", "layer_nobias"), ("swiglu", "gelu_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # how positions enter: "llama" (RoPE; by default RMSNorm, SwiGLU), "gpt2" (learned
                              # positions; by default LayerNorm, GELU) or "alibi" (a per-head bias on the attention
                              # scores, slopes in the weights: MPT, Falcon-RW; LayerNorm, exact GELU by default)
    vocab_size: int           # V
    dim: int                  # D
    n_layers: int             # L
    n_heads: int              # H
    n_kv_heads: int           # KVH
    ffn_dim: int              # F
    context_length: int       # the longest sequence the model was trained for (and positions exist for)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0   # llama only
    tie_embeddings: bool = True   # output head shares the token embedding table
    attn_bias: bool = False       # q/k/v/o projections carry biases (gpt2: always)
    qkv_bias: bool = False        # q/k/v projections carry biases, o does not (qwen2)
    qk_norm: str = ""             # q and k RMS-normed before RoPE: "head" (each head's Dh values: qwen3) or "all"
                                  # (the whole row of q, of k: olmo2)
    post_norm: bool = False       # the norms apply to attention's and the MLP's outputs, not inputs (olmo2)
    explicit_head_dim: int | None = None  # when Dh != D / H (some llama variants say so in config.json)
    embed_scale: float = 1.0      # the token embeddings are multiplied by this (granite)
    logit_scale: float = 1.0      # the logits are divided by this (granite)
    norm: str = ""                # "rms" (llama's default), "layer" (LayerNorm with a bias: gpt2's default) or
                                  # "layer_nobias" (LayerNorm without one: MPT)
    mlp: str = ""                 # "swiglu" (llama's default: gate and up) or "gelu_tanh" (gpt2's) / "gelu" (exact,
                                  # erf): one matrix in and one out
    mlp_bias: bool | None = None  # those two carry biases (None: the default, yes for a GELU MLP; falcon-7b, MPT: no)
    clip_qkv: float = 0.0         # q, k and v clamped to [-clip_qkv, clip_qkv] (MPT's clip_qkv; 0: not clamped)
    rotary_dim: int | None = None  # RoPE turns only the first rotary_dim of each head's Dh dims (gpt-neox); None: all
    parallel_residual: bool = False   # x + attn(norm1(x)) + mlp(norm2(x)) (gpt-neox), not one after the other
    family: str = ""              # the checkpoint's own name of its architecture ("qwen2", "mistral", ...)
    name: str = ""

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; tinyllm runs {', '.join(ARCHITECTURES)}")
        llama = self.arch == "llama"         # the block's defaults: what a config that says nothing more means
        object.__setattr__(self, "norm", self.norm or ("rms" if llama else "layer"))
        object.__setattr__(self, "mlp", self.mlp or ("swiglu" if llama else "gelu" if self.arch == "alibi" else
                                                     "gelu_tanh"))
        if self.mlp_bias is None:
            object.__setattr__(self, "mlp_bias", self.mlp != "swiglu")
        if self.qk_norm not in ("", "head", "all"):
            raise ValueError(f"qk_norm must be '', 'head' or 'all', got {self.qk_norm!r}")
        if self.norm not in NORMS or self.mlp not in MLPS:
            raise ValueError(f"norm must be one of {NORMS} and mlp one of {MLPS}, got {self.norm!r}, {self.mlp!r}")
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "context_length"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"config {field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.arch == "llama" and self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"RoPE needs an even number of dims, at most head_dim {self.head_dim}, got {self.rope_dim}")

    # --- derived sizes -----------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:  # Dh
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:  # the dims of a head that RoPE turns
        return self.rotary_dim or self.head_dim

    @property
    def kv_mul(self) -> int:  # G: how many query heads read each KV head
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:  # H * Dh
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # KVH * Dh
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str | int = "float32") -> int:
        """KV cache bytes one token costs: K and V, every layer, every KV head: 2 * L * KVH * Dh * bytes per value.
        kv_dtype: "float32" (4 bytes), "float16" (2), "int8" (1, plus a float16 scale per 32: kv_cache.py), or
        a plain number of bytes per value. SmolLM2-135M: 46,080 / 23,040 / 12,240."""
        if not isinstance(kv_dtype, (int, float)):
            from .kv_cache import bytes_per_value     # (kv_cache imports this module)
            kv_dtype = bytes_per_value(kv_dtype, self.head_dim)
        return round(2 * self.n_layers * self.kv_dim * kv_dtype)

    @property
    def n_params(self) -> int:
        """Parameter count (the tied output head counted once, as model cards do)."""
        D, F, L = self.dim, self.ffn_dim, self.n_layers
        attn = D * self.q_dim + 2 * D * self.kv_dim + self.q_dim * D
        if self.attn_bias or self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim + (D if self.attn_bias else 0)
        if self.qk_norm:
            attn += 2 * self.head_dim if self.qk_norm == "head" else self.q_dim + self.kv_dim
        mlp = 3 * D * F if self.mlp == "swiglu" else 2 * D * F + (F + D if self.mlp_bias else 0)
        norms = 4 * D if self.norm == "layer" else 2 * D                  # a block's two (with biases)
        extra = 2 * D if self.norm == "layer" else D                      # the final norm
        if self.arch == "gpt2":
            extra += self.context_length * D                              # learned positions
        head = 0 if self.tie_embeddings else self.vocab_size * D
        return self.vocab_size * D + L * (attn + mlp + norms) + extra + head
