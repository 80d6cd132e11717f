"""Tensor-parallelize the shared GPT for the trainer with the hand-rolled Megatron blocks.

Each block becomes a TensorParallelBlock (separate wq/wk/wv, so module names stay those of
dtrain.model). Its sharded weights are then re-registered as DTensors on the tp mesh
(column-parallel Shard(0), row-parallel Shard(1)) holding the same local tensor: the forward
still runs the hand-rolled ops on the local shard, but FSDP2 can shard them further over dp
(2-D, as torchtitan does) and DCP saves them with their global shapes and names, so a checkpoint
loads into any other layout. Embeddings, norms and lm_head stay replicated on every tp rank
(their gradients are identical there: every tp rank computes the same thing outside the blocks).
"""
from __future__ import annotations

import torch.nn as nn

from dtrain.errors import UserError
from dtrain.model import GPTConfig
from dtrain.parallel.tp.attention import TensorParallelBlock, TPGroups, check_tp_heads


def check_tp_model(cfg: GPTConfig, tp: int) -> None:
    """The model shapes the trainer's TP can split; a one-line UserError otherwise."""
    if tp == 1:
        return
    try:
        check_tp_heads(cfg.n_head, cfg.n_kv_head, tp)
    except UserError as e:
        raise UserError(f"train.tp={tp}: {e}") from None
    if cfg.n_kv_head < tp:
        raise UserError(f"train.tp={tp} > model.n_kv_head={cfg.n_kv_head}: the trainer shards k/v heads "
                        "(replicated k/v heads are only in the tp-attention experiment); lower train.tp")
    if cfg.mlp_hidden % tp:
        raise UserError(f"train.tp={tp} does not divide the MLP width {cfg.mlp_hidden}: pick another tp")


def _as_dtensor(layer: nn.Module, mesh, weight_dim: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layer.weight = nn.Parameter(DTensor.from_local(layer.weight.data, mesh, [Shard(weight_dim)], run_check=False))
    if layer.bias is not None:  # column bias is sharded with the rows; row bias is added after the sum
        placement = Shard(0) if weight_dim == 0 else Replicate()
        layer.bias = nn.Parameter(DTensor.from_local(layer.bias.data, mesh, [placement], run_check=False))


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Replace every block of `model` (a GPT or a pipeline stage) in place by its tp shard."""
    groups = TPGroups(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
    for name, block in list(model.blocks.named_children()):
        tp_block = TensorParallelBlock.from_full(block, groups, fused_qkv=False)
        for layer in (tp_block.attn.wq, tp_block.attn.wk, tp_block.attn.wv, tp_block.mlp.w1):
            _as_dtensor(layer, tp_mesh, 0)
        for layer in (tp_block.attn.wo, tp_block.mlp.w2):
            _as_dtensor(layer, tp_mesh, 1)
        setattr(model.blocks, name, tp_block)
