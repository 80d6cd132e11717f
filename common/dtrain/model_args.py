"""The GPT's configuration and what follows from it alone: parameter and FLOP counts.

Without torch, so the command-line checks and the cost model can size and check a 7B model without
importing the framework that builds it (``dtrain.model`` builds it, and re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from dtrain.flops import transformer_flops_per_token


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # None = n_head (multi-head); fewer = grouped-query attention
    d_model: int = 128
    mlp_ratio: int = 4
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    bias: bool = False  # biases in the block linears and LayerNorm (never in lm_head)
    tie_embeddings: bool = False  # lm_head shares the token-embedding matrix
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "mlp_ratio"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r} must be an integer >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"unknown norm {self.norm!r}: expected 'rmsnorm' or 'layernorm'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.d_model

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """The preset with `overrides` applied, checked as one whole model. Overriding n_head
        without n_kv_head keeps the preset's kind of attention: multi-head stays multi-head
        (n_kv_head follows n_head) instead of silently becoming GQA with the preset's k/v heads."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
        preset = PRESETS[name]
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown model key {unknown[0]!r}: known keys are {', '.join(f.name for f in fields(cls))}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "n_head" in overrides and "n_kv_head" not in overrides and preset.n_kv_head == preset.n_head:
            overrides["n_kv_head"] = None
        return replace(preset, **overrides)


# GPT-2 shapes keep GPT-2's conventions (LayerNorm with bias, tied embeddings, vocab 50257 padded
# to 50304) so their sizes match the names. "1b" and "7b" use modern conventions (RMSNorm, no bias,
# untied, vocab 32000); "7b" has Llama-2-7B's shape but a GELU 4x MLP instead of SwiGLU (8/3 x
# 3 matrices), which makes it 6.73B parameters instead of 6.74B.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=8, d_model=256),
    "125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768,
                      norm="layernorm", bias=True, tie_embeddings=True),
    "350m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024,
                      norm="layernorm", bias=True, tie_embeddings=True),
    "1b": GPTConfig(vocab_size=32000, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "7b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, d_model=4096),
}


def num_params(cfg: GPTConfig, *, exclude_embeddings: bool = False) -> int:
    """Parameter count of GPT(cfg), equal to ``sum(p.numel() for p in model.parameters())``.

    ``exclude_embeddings`` drops the position embedding and the token embedding; with tied
    embeddings the shared matrix is kept, since it does the lm_head's matmul (as in nanoGPT)."""
    d, V, T = cfg.d_model, cfg.vocab_size, cfg.seq_len
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    biases = (2 * d + 2 * cfg.kv_dim + cfg.mlp_hidden + d) if cfg.bias else 0
    per_layer = 2 * norm + biases + _matmul_params_per_layer(cfg)
    total = V * d + T * d + cfg.n_layer * per_layer + norm + (0 if cfg.tie_embeddings else d * V)
    if exclude_embeddings:
        total -= T * d + (0 if cfg.tie_embeddings else V * d)
    return total


def _matmul_params_per_layer(cfg: GPTConfig) -> int:
    d = cfg.d_model
    return 2 * d * d + 2 * d * cfg.kv_dim + 2 * d * cfg.mlp_hidden  # wq, wo; wk, wv; w1, w2


def num_matmul_params(cfg: GPTConfig) -> int:
    """Weights of all linear layers, lm_head included (even when tied: its matmul still runs).
    Embedding lookups, norms and biases do no matmul and are left out, like torchtitan, which
    subtracts the token embedding from N."""
    return cfg.n_layer * _matmul_params_per_layer(cfg) + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token of GPT(cfg): ``transformer_flops_per_token`` (6·N_matmul +
    12·L·H·hd·T, lm_head included when tied, full non-causal attention), equal to torchtitan's
    ``6*N + 12*L*H*Q*T`` and to ``6 * num_matmul_params(cfg) + attention``."""
    return transformer_flops_per_token(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.mlp_hidden,
                                       cfg.vocab_size, seq_len or cfg.seq_len, False, cfg.head_dim)
