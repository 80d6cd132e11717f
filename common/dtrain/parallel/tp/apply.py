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

import torch
import torch.nn as nn

from dtrain.errors import UserError
from dtrain.model import GPTConfig
from dtrain.parallel.tp import comm
from dtrain.parallel.tp.attention import TensorParallelBlock, TPGroups, check_tp_heads
from dtrain.parallel.tp.layers import local_shard


def check_tp_model(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """The model shapes the trainer's TP can split; a one-line UserError otherwise."""
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


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False, n_layer: int | None = None) -> list[str]:
    """Replace every block of `model` (a GPT or a pipeline stage) in place by its tp shard.

    With sequence parallelism the residual stream between blocks is this rank's slice of the
    sequence: the GPT's first block scatters it, its last block gathers it back for the
    (replicated) head. Returns the names of the parameters whose gradients are partial sums over
    the tp ranks (the norms inside the blocks, row-parallel biases): `sum_partial_grads` adds them."""
    from dtrain.parallel.tp import ops

    groups = TPGroups(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
    partial = []
    for name, block in list(model.blocks.named_children()):
        tp_block = TensorParallelBlock.from_full(block, groups, sequence_parallel=sequence_parallel, fused_qkv=False)
        partial += [f"blocks.{name}.{n}" for n, p in tp_block.named_parameters() if hasattr(p, "grad_allreduce")]
        if sequence_parallel and name == "0":
            tp_block.register_forward_pre_hook(lambda m, args: (ops.scatter_to_sequence(args[0], groups.group),))
        if sequence_parallel and n_layer is not None and name == str(n_layer - 1):
            tp_block.register_forward_hook(lambda m, args, out: ops.gather_sequence_to_replicated(out, groups.group))
        for layer in (tp_block.attn.wq, tp_block.attn.wk, tp_block.attn.wv, tp_block.mlp.w1):
            _as_dtensor(layer, tp_mesh, 0)
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
