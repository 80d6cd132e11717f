"""Tensor-parallelize the shared GPT for the trainer with the hand-rolled Megatron blocks.

Each block becomes a TensorParallelBlock (separate wq/wk/wv, so module names stay those of
dtrain.model.gpt). Its sharded weights are then re-registered as DTensors on the tp mesh
(column-parallel Shard(0), row-parallel Shard(1)) holding the same local tensor: the forward
still runs the hand-rolled ops on the local shard, but FSDP2 can shard them further over dp
(2-D, as torchtitan does) and DCP saves them with their global shapes and names, so a checkpoint
loads into any other layout. Embeddings, norms and lm_head stay replicated on every tp rank
(their gradients are identical there: every tp rank computes the same thing outside the blocks).

kv_heads < tp: wk and wv are whole on every tp rank (attention.py's one layout), here as
Replicate DTensors (the model's own shape, so FSDP2, which takes only 1-D TP placements, and DCP
need nothing special).

An MoE feed-forward is not split (expert TP 1): the block keeps it whole, and
dtrain.parallel.ep.moe_tp gives each tp rank its share of the tokens.

async_grad_allreduce: the column-parallel layers' input-grad collective overlaps their weight-grad
GEMMs (q, k, v share one collective: `linears_async_grad_reduce`), parameters unchanged.
"""

from __future__ import annotations

import torch.nn as nn

from dtrain.parallel.tp.attention import TensorParallelBlock, TensorParallelMLP, TPGroups
from dtrain.parallel.tp.layers import partial_grads


def _as_replicated(layer: nn.Module, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    for name, p in list(layer.named_parameters(recurse=False)):
        setattr(
            layer,
            name,
            nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)),
        )


def _as_dtensor(layer: nn.Module, mesh, weight_dim: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layer.weight = nn.Parameter(
        DTensor.from_local(layer.weight.data, mesh, [Shard(weight_dim)], run_check=False)
    )
    if (
        layer.bias is not None
    ):  # column bias is sharded with the rows; row bias is added after the sum
        placement = Shard(0) if weight_dim == 0 else Replicate()
        layer.bias = nn.Parameter(
            DTensor.from_local(layer.bias.data, mesh, [placement], run_check=False)
        )


def apply_megatron_tp(
    model: nn.Module,
    tp_mesh,
    sequence_parallel: bool = False,
    n_layer: int | None = None,
    async_grad_allreduce: bool = False,
) -> dict[str, tuple]:
    """Replace every block of `model` (a GPT or a pipeline stage) in place by its tp shard.

    With sequence parallelism the residual stream between blocks is this rank's slice of the
    sequence: the GPT's first block scatters it, its last block gathers it back for the
    (replicated) head. Returns the parameters whose gradients are partial sums over the tp
    ranks (the norms inside the blocks and row-parallel biases under SP, replicated k/v
    weights), name -> (group, rows), for `layers.allreduce_partial_grads`."""
    from dtrain.parallel.tp import ops

    groups = TPGroups(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
    partial = {}
    for name, block in list(model.blocks.named_children()):
        tp_block = TensorParallelBlock.from_full(
            block,
            groups,
            sequence_parallel=sequence_parallel,
            async_grad_allreduce=async_grad_allreduce,
        )
        partial.update(
            partial_grads(tp_block, prefix=f"blocks.{name}.")
        )  # before the DTensor swap drops the marks
        if sequence_parallel and name == "0":
            tp_block.register_forward_pre_hook(
                lambda m, args: (ops.scatter_to_sequence(args[0], groups.group),)
            )
        if sequence_parallel and n_layer is not None and name == str(n_layer - 1):
            tp_block.register_forward_hook(
                lambda m, args, out: ops.gather_sequence_to_replicated(out, groups.group)
            )
        attn = tp_block.attn
        kv = (attn.wk, attn.wv)
        # an MoE layer is not split by tp (dtrain.parallel.ep.moe_tp)
        dense = isinstance(tp_block.mlp, TensorParallelMLP)
        w1, w2 = ((tp_block.mlp.w1,), (tp_block.mlp.w2,)) if dense else ((), ())
        for layer in (attn.wq, *w1) + (() if attn.replicated_kv else kv):
            _as_dtensor(layer, tp_mesh, 0)
        for layer in kv if attn.replicated_kv else ():
            _as_replicated(layer, tp_mesh)
        for layer in (attn.wo, *w2):
            _as_dtensor(layer, tp_mesh, 1)
        setattr(model.blocks, name, tp_block)
    return partial
