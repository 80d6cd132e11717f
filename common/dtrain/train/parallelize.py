"""Apply a data-parallel strategy to a GPT (torchtitan's order: checkpointing, compile, sharding).

    single  the model on this rank's device
    ddp     DistributedDataParallel: full replica per rank, gradients all-reduced
    zero2   FSDP2 fully_shard per block then the root, reshard_after_forward=False: parameters
            stay gathered from forward until backward (no second all-gather), grads + optimizer
            state sharded
    zero3   the same with reshard_after_forward=True: parameters freed after each block's forward
            and all-gathered again in backward
    hsdp    zero3 on a 2-D mesh (replicate x shard): sharded within a group, replicated across
            groups (gradients reduce-scattered inside a group, all-reduced across groups)

The model must arrive on CPU; FSDP2 moves only each rank's shard to the mesh's device.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dtrain.train.config import TrainConfig


def _op_policy_context():
    """Selective op AC (torchtitan ``selective_ac_option="op"``): in each checkpointed block keep the
    outputs of SDPA and of every other matmul (1st, 3rd, ... in forward order: wq, wv, w1 of a
    GELU block), recompute the rest in backward (wk, wo, w2 and the element-wise ops). A fresh
    count per block call, one for the forward and one for the recompute, so both see the same
    numbering."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        keep.add(aten._scaled_dot_product_cudnn_attention.default)
    counts = {False: 0, True: 0}  # matmuls seen, forward / recompute

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str = "block") -> None:
    """Recompute in backward instead of keeping: each block's whole activations (``block``), or those
    the selective op policy does not save (``op``, ``_op_policy_context``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    extra = {"context_fn": _op_policy_context} if mode == "op" else {}
    for name, block in list(model.blocks.named_children()):  # a GPT's ModuleList or a stage's ModuleDict
        # no dropout: no RNG to replay
        setattr(model.blocks, name, checkpoint_wrapper(block, preserve_rng_state=False, **extra))


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (nn.Module.compile: module names and state-dict keys stay
    the same, so checkpoints, hooks and the precision map see the same model). Per block, as in
    torchtitan: the blocks are alike, so they share compiled code, and FSDP2's per-block hooks stay
    outside the compiled regions."""
    for block in model.blocks.children():  # a GPT's ModuleList or a pipeline stage's ModuleDict
        block.compile()


def device_mesh(train: TrainConfig, world_size: int, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    if train.strategy == "hsdp":
        shape = (train.hsdp_replicate, world_size // train.hsdp_replicate)
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def mixed_precision_policy(train: TrainConfig):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if train.precision == "bf16":  # bf16 compute and all-gather, fp32 gradient reduction
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, train: TrainConfig, mesh, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    reshard = train.strategy != "zero2"
    policy = mixed_precision_policy(train)
    blocks = list(model.blocks.children())  # a GPT's ModuleList or a pipeline stage's ModuleDict
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first thing in backward: keep them (torchtitan).
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    if train.prefetch:
        set_explicit_prefetch(model, blocks)
        if device.type == "cpu" and hasattr(model, "_set_unshard_async_op"):
            # CPU has no side streams, so FSDP2's default unshard (async_op=False) blocks until the
            # all-gather is done, prefetched or not. Async unshards return at once; the wait moves
            # to the block's pre-forward. (Private FSDPModule method, documented, torch >= 2.5.)
            model._set_unshard_async_op(True)


def set_explicit_prefetch(root: nn.Module, blocks: list[nn.Module]) -> None:
    """Issue block i+1's all-gather when block i starts forward (i-1's when i starts backward).

    Without this, on CPU each unshard is issued only when its block runs and waited on at once,
    so communication never overlaps compute; on GPU FSDP2 already prefetches one block implicitly
    and this makes it explicit (and deterministic)."""
    if blocks:
        root.set_modules_to_forward_prefetch([blocks[0]])
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def parallelize(model: nn.Module, train: TrainConfig, world_size: int, device: torch.device) -> nn.Module:
    """The model wrapped for `train.strategy`; returns the module to call in the loop."""
    if train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, train.activation_checkpointing)
    if train.compile:
        apply_compile(model)
    if train.strategy == "single":
        return model.to(device)
    if train.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model.to(device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    apply_fsdp(model, train, device_mesh(train, world_size, device), device)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 modifies the module in place, nothing to unwrap)."""
    return getattr(model, "module", model)
