"""The Megatron TP layouts through PyTorch's DTensor API (`parallelize_module`): torchtitan's plan
for a Llama block applied to dtrain.model.gpt's Block. The trainer's `train.tp_impl=dtensor` and
tp-attention's DTensor baseline (the hand-rolled layers' reference) both use it:

    attn.wq/wk/wv, mlp.w1   ColwiseParallel          (replicated in, sharded heads out)
    attn.wo, mlp.w2         RowwiseParallel          (partial sums reduced; Shard(1) out with SP)
    attn_norm, mlp_norm     SequenceParallel         (SP only: norms on the local tokens)
    attn, mlp               PrepareModuleInput       (SP only: all-gather Shard(1) -> Replicate)
    an MoE mlp              not split                (SP: its input stays this rank's local
                                                     Shard(1) tokens; dtrain.parallel.ep.moe_tp)

In a whole GPT (`apply_dtensor_tp`) the embeddings, final norm and lm_head stay replicated on
every tp rank, as with the hand-rolled layers; with SP the first block takes the replicated
activations to this rank's sequence slice and the last block gathers them back. dtrain.model.gpt's
attention infers head counts from local shapes, so it runs on its local heads unchanged. DTensor
cannot split kv_heads < tp (the hand-rolled layers replicate them), so this needs
n_kv_head % tp == 0 (`supported`). On GPU this is the path to async TP and float8 TP (torchao's
Float8ColwiseParallel / Float8RowwiseParallel are drop-in styles here); neither is wired in yet.

DTensor leaves the gradients of the SequenceParallel norms Partial (a sum still to take over tp):
FSDP2 redistributes them to the parameter's placement, and without it the trainer's ParallelModel
does, after backward; nothing is marked for the hand-rolled reducer.
"""

from __future__ import annotations

import torch.nn as nn


def supported(n_kv_head: int, tp: int) -> bool:
    return n_kv_head % tp == 0


def tp_mesh(groups):
    """A 1-D DeviceMesh over a TPGroups' group (not necessarily the whole world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dist.get_backend(groups.group) == "nccl" else "cpu"
    return DeviceMesh.from_group(groups.group, device)


def _region_plan(prefix: str, col: list[str], row: str, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan = {f"{prefix}{name}": ColwiseParallel() for name in col}
    plan[f"{prefix}{row}"] = (
        RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    )
    if sequence_parallel and prefix:
        plan[prefix.rstrip(".")] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    return plan


def parallelize_block(module: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    """Shard a dtrain.model.gpt Block or Attention in place over a 1-D tp mesh (every rank of it
    must hold the same full weights). With SP the module takes and returns this rank's sequence
    slice,
    like the hand-rolled one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        SequenceParallel,
        parallelize_module,
    )

    if hasattr(module, "mlp"):  # a Block
        plan = _region_plan("attn.", ["wq", "wk", "wv"], "wo", sequence_parallel)
        if hasattr(module.mlp, "w1"):
            plan.update(_region_plan("mlp.", ["w1"], "w2", sequence_parallel))
        elif sequence_parallel:  # MoE: runs on this rank's tokens (dtrain.parallel.ep.moe_tp)
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        return parallelize_module(module, mesh, plan)
    if sequence_parallel:  # an Attention: the root itself gathers its sequence-sharded input
        parallelize_module(
            module,
            mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        )
    return parallelize_module(
        module, mesh, _region_plan("", ["wq", "wk", "wv"], "wo", sequence_parallel)
    )


def apply_dtensor_tp(
    model: nn.Module, mesh, sequence_parallel: bool, n_layer: int
) -> dict[str, tuple]:
    """Every block of `model` (a GPT or a pipeline stage, blocks keyed by their global index)
    sharded in place; returns the marked partial gradients: none (see module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    for name, block in model.blocks.named_children():
        parallelize_block(block, mesh, sequence_parallel)
        if (
            sequence_parallel and name == "0"
        ):  # replicated embeddings -> this rank's tokens (no communication)
            parallelize_module(
                block,
                mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_output=True,
                ),
            )
        if sequence_parallel and name == str(
            n_layer - 1
        ):  # all tokens again for the replicated head
            parallelize_module(
                block,
                mesh,
                PrepareModuleOutput(
                    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)
                ),
            )
    return {}
