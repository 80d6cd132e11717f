"""A small GPT in the nanoGPT mould, with torchtitan's module names.

Everything the experiments need from a model and nothing else: learned token + position
embeddings, pre-norm blocks (causal attention with optional GQA, GELU MLP), final norm, lm_head.
Parallelism lives elsewhere; this file only promises stable module names:

    tok_emb, pos_emb, blocks.{i}.attn_norm, blocks.{i}.attn.{wq,wk,wv,wo},
    blocks.{i}.mlp_norm, blocks.{i}.mlp.{w1,w2}, norm, lm_head

and a hook, ``linear_factory(name, in_features, out_features, bias)``, through which every linear
layer is built (FP8 training swaps linear classes per layer with it).

Parameter and FLOP accounting (`num_params`, `num_matmul_params`, `flops_per_token`) is computed
from the config alone, so cost models can size a 7B model without building it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtrain.flops import transformer_flops_per_token

LinearFactory = Callable[[str, int, int, bool], nn.Module]


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


def _make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-5)
    return nn.LayerNorm(cfg.d_model, eps=1e-5, bias=cfg.bias)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        d, kv = cfg.d_model, cfg.kv_dim
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_head // cfg.n_kv_head  # query heads per k/v head
        self.wq = make_linear(f"{prefix}.wq", d, d, cfg.bias)
        self.wk = make_linear(f"{prefix}.wk", d, kv, cfg.bias)
        self.wv = make_linear(f"{prefix}.wv", d, kv, cfg.bias)
        self.wo = make_linear(f"{prefix}.wo", d, d, cfg.bias)
        self.core = causal_attention  # the attention math; context parallelism swaps in its own (dtrain.parallel.cp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.core(self.wq(x), self.wk(x), self.wv(x), self.head_dim))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal SDPA on projections (B, T, n_q*hd), (B, T, n_kv*hd) x2 -> (B, T, n_q*hd).

    Head counts come from the shapes, not the config, so a tensor-parallel shard holding fewer
    query and k/v heads (tp_attention) runs exactly this code. GQA: query head h reads k/v head
    h // n_rep, n_rep = n_q / n_kv."""
    B, T, _ = q.shape
    q, k, v = (t.view(B, T, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.w1 = make_linear(f"{prefix}.w1", cfg.d_model, cfg.mlp_hidden, cfg.bias)
        self.w2 = make_linear(f"{prefix}.w2", cfg.mlp_hidden, cfg.d_model, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.attn_norm = _make_norm(cfg)
        self.attn = Attention(cfg, f"{prefix}.attn", make_linear)
        self.mlp_norm = _make_norm(cfg)
        self.mlp = MLP(cfg, f"{prefix}.mlp", make_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def default_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class GPT(nn.Module):
    """``forward(idx)`` returns logits (B, T, vocab); ``forward(idx, targets)`` returns only the
    scalar mean cross-entropy loss, computed in fp32 (targets of -100 are ignored). ``positions``
    (T,): the tokens' places in the sequence when `idx` holds only some of them (context
    parallelism's shards); default 0..T-1."""

    def __init__(self, cfg: GPTConfig, linear_factory: LinearFactory | None = None):
        super().__init__()
        self.cfg = cfg
        make_linear = linear_factory or default_linear
        # init_weights() draws from the RNG state the constructor started with, so a model built
        # on the meta device and initialised later gets exactly the weights of an eager build.
        rng_state = torch.get_rng_state()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, f"blocks.{i}", make_linear) for i in range(cfg.n_layer))
        self.norm = _make_norm(cfg)
        self.lm_head = make_linear("lm_head", cfg.d_model, cfg.vocab_size, False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if not self.tok_emb.weight.is_meta:
            torch.set_rng_state(rng_state)
            self.init_weights()

    @staticmethod
    def linear_names(cfg: GPTConfig) -> list[str]:
        """Fully qualified names of every linear layer, in construction order."""
        per_block = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2"]
        return [f"blocks.{i}.{n}" for i in range(cfg.n_layer) for n in per_block] + ["lm_head"]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in a fixed order. Call after ``to_empty()`` for a model
        built on the meta device; it also re-ties the embeddings, which ``to_empty`` unties.
        On CPU, seed + meta build + init_weights() gives bit-identical weights to seed + eager
        build (the constructor restores the CPU RNG state it started with before initialising)."""
        cfg = self.cfg
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        nn.init.normal_(self.tok_emb.weight, std=cfg.init_std)
        nn.init.normal_(self.pos_emb.weight, std=cfg.init_std)
        # GPT-2: residual projections are scaled down so the residual stream stays O(1) in depth.
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for name in self.linear_names(cfg):
            if name == "lm_head" and cfg.tie_embeddings:
                continue
            layer = self.get_submodule(name)
            std = residual_std if name.endswith((".wo", ".w2")) else cfg.init_std
            nn.init.normal_(layer.weight, std=std)
            if getattr(layer, "bias", None) is not None:
                nn.init.zeros_(layer.bias)
        for module in self.modules():
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()  # weight 1, bias 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device) if positions is None else positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


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
