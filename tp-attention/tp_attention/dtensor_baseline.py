"""The same TP layouts through PyTorch's DTensor API, as the baseline the hand-rolled code is
timed against (torchtitan's plan for a Llama block, applied to dtrain.model's Block):

    attn.wq/wk/wv, mlp.w1   ColwiseParallel          (replicated in, sharded heads out)
    attn.wo, mlp.w2         RowwiseParallel          (partial sums reduced; Shard(1) out with SP)
    attn_norm, mlp_norm     SequenceParallel         (SP only: norms on the local tokens)
    attn, mlp               PrepareModuleInput       (SP only: all-gather Shard(1) -> Replicate)

dtrain.model's attention infers head counts from local shapes, so after parallelize_module it
runs on its local heads unchanged. DTensor cannot split kv_heads < tp, so the baseline needs
n_kv_head % tp == 0 (`supported`).
"""
from __future__ import annotations

import torch.nn as nn


def supported(n_kv_head: int, tp: int) -> bool:
    return n_kv_head % tp == 0


def tp_mesh(groups):
    """A 1-D DeviceMesh over this rank's TP group (not necessarily the whole world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dist.get_backend(groups.group) == "nccl" else "cpu"
    return DeviceMesh.from_group(groups.group, device)


def _region_plan(prefix: str, col: list[str], row: str, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {f"{prefix}{name}": ColwiseParallel() for name in col}
    plan[f"{prefix}{row}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if sequence_parallel and prefix:
        plan[prefix.rstrip(".")] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def parallelize(module: nn.Module, groups, sequence_parallel: bool) -> nn.Module:
    """Shard a dtrain.model Block or Attention in place with DTensor (every rank of the group
    must hold the same full weights). With SP the module takes and returns this rank's
    sequence slice, like the hand-rolled one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

    mesh = tp_mesh(groups)
    if hasattr(module, "mlp"):  # a Block
        plan = {**_region_plan("attn.", ["wq", "wk", "wv"], "wo", sequence_parallel),
                **_region_plan("mlp.", ["w1"], "w2", sequence_parallel)}
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        return parallelize_module(module, mesh, plan)
    if sequence_parallel:  # an Attention: the root itself gathers its sequence-sharded input
        parallelize_module(module, mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                            desired_input_layouts=(Replicate(),)))
    return parallelize_module(module, mesh, _region_plan("", ["wq", "wk", "wv"], "wo", sequence_parallel))
