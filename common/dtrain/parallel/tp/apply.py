"""Tensor-parallelize the shared GPT for the trainer with the hand-rolled Megatron blocks.

Each block becomes a TensorParallelBlock (separate wq/wk/wv, so module names stay those of
dtrain.model). Its sharded weights are then re-registered as DTensors on the tp mesh
(column-parallel Shard(0), row-parallel Shard(1)) holding the same local tensor: the forward
still runs the hand-rolled ops on the local shard, but FSDP2 can shard them further over dp
(2-D, as torchtitan does) and DCP saves them with their global shapes and names, so a checkpoint
loads into any other layout. Embeddings, norms and lm_head stay replicated on every tp rank
(their gradients are identical there: every tp rank computes the same thing outside the blocks).

kv_heads < tp: every tp rank holds wk and wv whole, as a Replicate DTensor (the model's own
shape, so FSDP2, which takes only 1-D TP placements, and DCP need nothing special), and computes
with the rows of the one k/v head its query heads read (`ColumnParallelLinear.rows`). Its
gradient is nonzero only in those rows; summed over the tp group it is the full gradient, on every
rank. With one k/v head this is exactly Megatron's replicated layout; with 1 < kv_heads < tp a
rank keeps kv_heads - 1 heads it does not compute with (2·(kv_heads-1)·head_dim·d_model weights
per layer, counted by dtrain.fit).

async_grad_allreduce: the column-parallel layers' input-grad collective overlaps their weight-grad
GEMMs (q, k, v share one collective: `linears_async_grad_reduce`), parameters unchanged.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dtrain.errors import UserError
from dtrain.model import GPTConfig
from dtrain.parallel.tp import comm
from dtrain.parallel.tp.attention import TensorParallelBlock, TPGroups, check_tp_heads, kv_heads_of
from dtrain.parallel.tp.layers import local_shard


def check_tp_model(cfg: GPTConfig, tp: int, sequence_parallel: bool = False,
                   async_grad_allreduce: bool = False) -> None:
    """The model shapes the trainer's TP can split; a one-line UserError otherwise."""
    if async_grad_allreduce and tp == 1:
        raise UserError("train.async_grad_allreduce=true needs train.tp > 1 (it overlaps the tensor-parallel "
                        "input-gradient collective)")
    if sequence_parallel and tp == 1:
        raise UserError("train.sequence_parallel=true needs train.tp > 1")
    if sequence_parallel and cfg.seq_len % tp:
        raise UserError(f"train.sequence_parallel: model.seq_len={cfg.seq_len} is not divisible by train.tp={tp}")
    if tp == 1:
        return
    try:
        check_tp_heads(cfg.n_head, cfg.n_kv_head, tp)
    except UserError as e:
        raise UserError(f"train.tp={tp}: {e}") from None
    if cfg.mlp_hidden % tp:
        raise UserError(f"train.tp={tp} does not divide the MLP width {cfg.mlp_hidden}: pick another tp")


def _replicate_kv(tp_attn, attn, groups: TPGroups) -> None:
    """kv_heads < tp: wk, wv whole on every rank, computing with this rank's k/v head rows; their
    gradients are partial sums over the tp group (`grad_allreduce`)."""
    hd = attn.head_dim
    heads = kv_heads_of(groups.rank, groups.tp, attn.wk.weight.shape[0] // hd)
    for name in ("wk", "wv"):
        full, layer = getattr(attn, name), getattr(tp_attn, name)
        layer.weight = nn.Parameter(full.weight.detach().clone())
        layer.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        layer.rows = slice(heads.start * hd, heads.stop * hd)
        for p in layer.parameters():
            p.grad_allreduce = (groups.group, None)


def _as_replicated(layer: nn.Module, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    for name, p in list(layer.named_parameters(recurse=False)):
        setattr(layer, name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)))


def _as_dtensor(layer: nn.Module, mesh, weight_dim: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layer.weight = nn.Parameter(DTensor.from_local(layer.weight.data, mesh, [Shard(weight_dim)], run_check=False))
    if layer.bias is not None:  # column bias is sharded with the rows; row bias is added after the sum
        placement = Shard(0) if weight_dim == 0 else Replicate()
        layer.bias = nn.Parameter(DTensor.from_local(layer.bias.data, mesh, [placement], run_check=False))


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False, n_layer: int | None = None,
             async_grad_allreduce: bool = False) -> list[str]:
    """Replace every block of `model` (a GPT or a pipeline stage) in place by its tp shard.

    With sequence parallelism the residual stream between blocks is this rank's slice of the
    sequence: the GPT's first block scatters it, its last block gathers it back for the
    (replicated) head. Returns the names of the parameters whose gradients are partial sums over
    the tp ranks (the norms inside the blocks and row-parallel biases under SP, replicated k/v
    weights): `sum_partial_grads` adds them."""
    from dtrain.parallel.tp import ops

    groups = TPGroups(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
    partial = []
    for name, block in list(model.blocks.named_children()):
        tp_block = TensorParallelBlock.from_full(block, groups, sequence_parallel=sequence_parallel, fused_qkv=False,
                                                 async_grad_allreduce=async_grad_allreduce)
        replicated_kv = block.attn.wk.weight.shape[0] // block.attn.head_dim < groups.tp
        if replicated_kv:
            _replicate_kv(tp_block.attn, block.attn, groups)
        partial += [f"blocks.{name}.{n}" for n, p in tp_block.named_parameters() if hasattr(p, "grad_allreduce")]
        if sequence_parallel and name == "0":
            tp_block.register_forward_pre_hook(lambda m, args: (ops.scatter_to_sequence(args[0], groups.group),))
        if sequence_parallel and n_layer is not None and name == str(n_layer - 1):
            tp_block.register_forward_hook(lambda m, args, out: ops.gather_sequence_to_replicated(out, groups.group))
        for layer in (tp_block.attn.wq, tp_block.mlp.w1) + (() if replicated_kv else (tp_block.attn.wk, tp_block.attn.wv)):
            _as_dtensor(layer, tp_mesh, 0)
        if replicated_kv:
            _as_replicated(tp_block.attn.wk, tp_mesh)
            _as_replicated(tp_block.attn.wv, tp_mesh)
        for layer in (tp_block.attn.wo, tp_block.mlp.w2):
            _as_dtensor(layer, tp_mesh, 1)
        setattr(model.blocks, name, tp_block)
    return partial


@torch.no_grad()
def sum_partial_grads(part: nn.Module, names: set[str], tp_group) -> None:
    """All-reduce over tp the gradients of the named parameters (one flat bucket; local shards,
    so it also works after FSDP2 has reduce-scattered them over dp)."""
    grads = [local_shard(p.grad) for n, p in part.named_parameters() if _plain_name(n) in names and p.grad is not None]
    comm.all_reduce_flat(grads, tp_group, tag=comm.GRAD_SYNC)


def _plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")
