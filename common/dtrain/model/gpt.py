"""A small GPT in the nanoGPT mould, with torchtitan's module names.

Everything the experiments need from a model and nothing else: learned token + position
embeddings, pre-norm blocks (causal attention with optional GQA, GELU MLP), final norm, lm_head.
Parallelism lives elsewhere; this file only promises stable module names:

    tok_emb, pos_emb, blocks.{i}.attn_norm, blocks.{i}.attn.{wq,wk,wv,wo},
    blocks.{i}.mlp_norm, blocks.{i}.mlp.{w1,w2}, norm, lm_head

With ``cfg.moe`` (model.moe.experts > 0) the MLP of every layer from ``dense_layers`` on is the
MoE feed-forward of dtrain.model.moe (``blocks.{i}.mlp.router.gate``,
``blocks.{i}.mlp.experts.{w1,w2}``, ``blocks.{i}.mlp.shared.{w1,w2}``); its Switch auxiliary loss,
when on, is added to the loss.

and a hook, ``linear_factory(name, in_features, out_features, bias)``, through which every linear
layer is built (FP8 training swaps linear classes per layer with it).

The config (`GPTConfig`, `PRESETS`) and the parameter accounting (`num_params`,
`num_matmul_params`) live in dtrain/model/args.py, the FLOP count (`flops_per_token`) in
dtrain/model/flops.py, both without torch, so cost models and command-line checks can size a 7B
model without building it; this module re-exports them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtrain.model.flops import flops_per_token  # noqa: F401 (re-exported)
from dtrain.model.moe import MoE, init_moe
from dtrain.model.args import (
    PRESETS,  # noqa: F401 (re-exported)
    GPTConfig,
    num_matmul_params,  # noqa: F401 (re-exported)
    num_params,  # noqa: F401 (re-exported)
)

LinearFactory = Callable[[str, int, int, bool], nn.Module]


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
        # the attention math; context parallelism swaps in its own (dtrain.parallel.cp)
        self.core = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.core(self.wq(x), self.wk(x), self.wv(x), self.head_dim))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int
) -> torch.Tensor:
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
    def __init__(self, cfg: GPTConfig, prefix: str, make_linear: LinearFactory, layer: int = 0):
        super().__init__()
        self.attn_norm = _make_norm(cfg)
        self.attn = Attention(cfg, f"{prefix}.attn", make_linear)
        self.mlp_norm = _make_norm(cfg)
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            self.mlp = MoE(cfg.moe, cfg.d_model, cfg.mlp_hidden, make_linear, f"{prefix}.mlp")
        else:
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
            Block(cfg, f"blocks.{i}", make_linear, i) for i in range(cfg.n_layer)
        )
        self.norm = _make_norm(cfg)
        self.lm_head = make_linear("lm_head", cfg.d_model, cfg.vocab_size, False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if not self.tok_emb.weight.is_meta:
            torch.set_rng_state(rng_state)
            self.init_weights()

    @staticmethod
    def linear_names(cfg: GPTConfig) -> list[str]:
        """Fully qualified names of every linear layer, in construction order (an MoE layer's
        linears are its router gate and shared experts; its experts are not linears)."""
        attn = ["attn.wq", "attn.wk", "attn.wv", "attn.wo"]
        names = []
        for i in range(cfg.n_layer):
            mlp = ["mlp.w1", "mlp.w2"]
            if cfg.moe is not None and cfg.moe.is_moe_layer(i):
                shared = ["mlp.shared.w1", "mlp.shared.w2"] if cfg.moe.shared_experts else []
                mlp = ["mlp.router.gate", *shared]
            names += [f"blocks.{i}.{n}" for n in attn + mlp]
        return names + ["lm_head"]

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
            if name.endswith((".router.gate", ".shared.w1", ".shared.w2")):
                continue  # init_moe, in its own order
            layer = self.get_submodule(name)
            std = residual_std if name.endswith((".wo", ".w2")) else cfg.init_std
            nn.init.normal_(layer.weight, std=std)
            if getattr(layer, "bias", None) is not None:
                nn.init.zeros_(layer.bias)
        for module in self.modules():
            if isinstance(module, MoE):
                init_moe(module, cfg.init_std, residual_std)
        for module in self.modules():
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()  # weight 1, bias 0

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(
            torch.arange(T, device=idx.device) if positions is None else positions
        )
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if self.cfg.moe is not None and self.cfg.moe.aux_loss_coef:
            loss = loss + sum(m.aux_loss for m in moe_layers(self) if m.aux_loss is not None)
        return loss


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model (or of a pipeline stage, wrapped or not), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
