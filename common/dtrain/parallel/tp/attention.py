"""Tensor-parallel attention, MLP and transformer block, built from a full dtrain.model.gpt Block.

Heads are split across the tp ranks of a group: rank r computes query heads
[r*H/tp, (r+1)*H/tp) with a column-parallel QKV projection, runs causal SDPA on them alone
(dtrain.model.gpt.causal_attention, the single-device code), and the row-parallel output
projection sums the ranks' partial outputs. The MLP is column-parallel w1, GELU, row-parallel w2.
Each block therefore has two TP regions and, per forward+backward, four all-reduces (or with
sequence parallelism four all-gathers and four reduce-scatters).

GQA: with kv_heads >= tp each rank owns kv_heads/tp k/v heads. With kv_heads < tp (tp must be a
multiple) the k/v heads are replicated, one layout for the trainer and the benchmark: every tp
rank holds wk and wv whole (the model's own shape, so FSDP2 and DCP need nothing special) and
computes with the rows of the one k/v head its query heads read; its gradient is nonzero only in
those rows, and summed over the tp group after backward it is the full gradient on every rank.
With one k/v head this is exactly Megatron-LM's replicated layout; with 1 < kv_heads < tp a rank
keeps kv_heads - 1 heads it does not compute with (2·(kv_heads-1)·head_dim·d_model weights per
layer, counted by dtrain.train.memory_fit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtrain.core.errors import UserError
from dtrain.model.gpt import Attention, Block, MLP, causal_attention
from dtrain.parallel.feasibility import check_tp_heads
from dtrain.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    linears_async_grad_reduce,
)


@dataclass
class TPGroups:
    """This rank's place in tensor parallelism: its TP group, its index in it and the group size."""

    group: object  # ProcessGroup of the tp ranks (None when tp == 1 and not distributed)
    rank: int  # index within the group
    tp: int


_GROUP_CACHE: dict[tuple, object] = {}


def _new_group(ranks: list[int]):
    key = tuple(ranks)
    if key not in _GROUP_CACHE:  # gloo groups are slow to create; every rank creates the same ones
        _GROUP_CACHE[key] = dist.new_group(ranks)
    return _GROUP_CACHE[key]


def make_tp_groups(tp: int) -> TPGroups | None:
    """Split the world into consecutive blocks of tp ranks (collective: every rank must call it,
    in the same order). Returns None on ranks left over when tp does not divide the world size."""
    if not dist.is_initialized():
        if tp != 1:
            raise UserError(f"tp={tp} needs torch.distributed initialised with >= {tp} ranks")
        return TPGroups(None, 0, 1)
    world, me = dist.get_world_size(), dist.get_rank()
    if tp > world:
        raise UserError(f"tp={tp} is larger than world_size={world}: lower tp or raise world_size")
    mine = None
    for start in range(0, world - tp + 1, tp):
        ranks = list(range(start, start + tp))
        group = _new_group(ranks)
        if me in ranks:
            mine = TPGroups(group, me - start, tp)
    return mine


def kv_heads_of(rank: int, tp: int, n_kv_head: int) -> range:
    """Global k/v heads rank `rank` holds: its own share, or the one head it replicates."""
    if n_kv_head >= tp:
        per = n_kv_head // tp
        return range(rank * per, (rank + 1) * per)
    g = rank * n_kv_head // tp
    return range(g, g + 1)


class TensorParallelAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        *,
        bias: bool,
        groups: TPGroups,
        sequence_parallel: bool = False,
        fused_qkv: bool = False,
        async_grad_allreduce: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_tp_heads(n_head, n_kv_head, groups.tp)
        tp, self.groups = groups.tp, groups
        self.head_dim = d_model // n_head
        self.q_out = n_head // tp * self.head_dim
        heads = kv_heads_of(groups.rank, tp, n_kv_head)
        self.kv_out = len(heads) * self.head_dim  # k/v rows this rank computes with
        self.replicated_kv = n_kv_head < tp  # wk, wv whole on every rank (module docstring)
        self.kv_held = kv_held = n_kv_head * self.head_dim if self.replicated_kv else self.kv_out
        self.kv_rows = (
            slice(heads.start * self.head_dim, heads.stop * self.head_dim)
            if self.replicated_kv
            else None
        )
        self.fused_qkv, self.async_grad_allreduce = fused_qkv, async_grad_allreduce
        col = dict(
            bias=bias,
            group=groups.group,
            tp=tp,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
        )
        if fused_qkv:  # one GEMM: local rows [q | k | v]
            self.qkv = ColumnParallelLinear(
                d_model,
                tp * (self.q_out + 2 * kv_held),
                async_grad_allreduce=async_grad_allreduce,
                **col,
            )
            kv_layers = [(self.qkv, slice(self.q_out, None))]
        else:
            self.wq = ColumnParallelLinear(d_model, tp * self.q_out, **col)
            self.wk = ColumnParallelLinear(d_model, tp * kv_held, **col)
            self.wv = ColumnParallelLinear(d_model, tp * kv_held, **col)
            self.wk.rows = self.wv.rows = self.kv_rows
            kv_layers = [(self.wk, None), (self.wv, None)]
        self.wo = RowParallelLinear(
            d_model,
            d_model,
            bias=bias,
            group=groups.group,
            tp=tp,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
        )
        self.core = (
            causal_attention  # the attention math on the local heads; dtrain.parallel.cp swaps it
        )
        if self.replicated_kv:  # partial k/v gradients, summed over the tp group
            for layer, rows in kv_layers:
                for p in layer.parameters():
                    p.grad_allreduce = (groups.group, rows)

    @classmethod
    def from_full(cls, attn: Attention, groups: TPGroups, **options) -> "TensorParallelAttention":
        """This rank's shard of a single-device dtrain.model.gpt Attention."""
        hd = attn.head_dim
        d = attn.wq.weight.shape[1]
        n_head, n_kv = attn.wq.weight.shape[0] // hd, attn.wk.weight.shape[0] // hd
        w = attn.wq.weight
        tp_attn = cls(
            d,
            n_head,
            n_kv,
            bias=attn.wq.bias is not None,
            groups=groups,
            device=w.device,
            dtype=w.dtype,
            **options,
        )
        heads = kv_heads_of(groups.rank, groups.tp, n_kv)
        kv_rows = slice(None) if tp_attn.replicated_kv else slice(heads.start * hd, heads.stop * hd)
        q_rows = slice(groups.rank * tp_attn.q_out, (groups.rank + 1) * tp_attn.q_out)

        def rows(layer, sl):
            return layer.weight[sl], None if layer.bias is None else layer.bias[sl]

        parts = [rows(attn.wq, q_rows), rows(attn.wk, kv_rows), rows(attn.wv, kv_rows)]
        if tp_attn.fused_qkv:
            tp_attn.qkv.load_shard(
                torch.cat([p[0] for p in parts]),
                None if parts[0][1] is None else torch.cat([p[1] for p in parts]),
            )
        else:
            for layer, (weight, bias) in zip((tp_attn.wq, tp_attn.wk, tp_attn.wv), parts):
                layer.load_shard(weight, bias)
        with torch.no_grad():
            tp_attn.wo.weight.copy_(attn.wo.weight.chunk(groups.tp, dim=1)[groups.rank])
            if attn.wo.bias is not None:
                tp_attn.wo.bias.copy_(attn.wo.bias)
        return tp_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_qkv:
            q, k, v = self.qkv(x).split([self.q_out, self.kv_held, self.kv_held], dim=-1)
            if self.kv_rows is not None:  # replicated k/v: this rank's head
                k, v = k[..., self.kv_rows], v[..., self.kv_rows]
        elif self.async_grad_allreduce:  # one input-grad collective for q, k and v, overlapped
            q, k, v = linears_async_grad_reduce([self.wq, self.wk, self.wv], x)
        else:
            x = self.wq.enter(x)  # one entry (one backward all-reduce) shared by q, k and v
            q, k, v = self.wq.local(x), self.wk.local(x), self.wv.local(x)
        return self.wo(self.core(q, k, v, self.head_dim))


class TensorParallelMLP(nn.Module):
    def __init__(self, w1: ColumnParallelLinear, w2: RowParallelLinear):
        super().__init__()
        self.w1, self.w2 = w1, w2

    @classmethod
    def from_full(
        cls,
        mlp: MLP,
        groups: TPGroups,
        sequence_parallel: bool = False,
        async_grad_allreduce: bool = False,
    ) -> "TensorParallelMLP":
        g = dict(
            rank=groups.rank, tp=groups.tp, group=groups.group, sequence_parallel=sequence_parallel
        )
        w1 = ColumnParallelLinear.from_full(
            mlp.w1.weight, mlp.w1.bias, async_grad_allreduce=async_grad_allreduce, **g
        )
        w2 = RowParallelLinear.from_full(mlp.w2.weight, mlp.w2.bias, **g)
        return cls(w1, w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TensorParallelBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). With sequence parallelism x is
    this rank's slice of the sequence, and the norms run on it alone."""

    def __init__(
        self,
        attn_norm: nn.Module,
        attn: TensorParallelAttention,
        mlp_norm: nn.Module,
        mlp: TensorParallelMLP,
    ):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    @classmethod
    def from_full(
        cls,
        block: Block,
        groups: TPGroups,
        sequence_parallel: bool = False,
        fused_qkv: bool = False,
        async_grad_allreduce: bool = False,
    ) -> "TensorParallelBlock":
        norms = copy.deepcopy(block.attn_norm), copy.deepcopy(block.mlp_norm)  # replicated
        if sequence_parallel:  # each rank normalised only its tokens: grads are partial sums
            for p in (*norms[0].parameters(), *norms[1].parameters()):
                p.grad_allreduce = (groups.group, None)
        attn = TensorParallelAttention.from_full(
            block.attn,
            groups,
            sequence_parallel=sequence_parallel,
            fused_qkv=fused_qkv,
            async_grad_allreduce=async_grad_allreduce,
        )
        mlp = block.mlp  # an MoE layer stays whole: dtrain.parallel.ep.moe_tp splits its tokens
        if isinstance(block.mlp, MLP):
            mlp = TensorParallelMLP.from_full(
                block.mlp, groups, sequence_parallel, async_grad_allreduce
            )
        return cls(norms[0], attn, norms[1], mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
