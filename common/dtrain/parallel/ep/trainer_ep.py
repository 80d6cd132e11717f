"""Expert parallelism in the trainer (train.ep): every MoE layer of a part keeps its ep rank's
slice of the experts and dispatches over the ep group; FSDP2 then shards those experts over the
efsdp group (`shard_experts`), the rest of the model over the data ranks as before.

The expert weights are DTensors over the experts' mesh (ep: Shard(0); FSDP2 adds efsdp), as
torchtitan's, so the global gradient norm counts each expert once and DCP saves the whole (E, ., .)
tensors: a checkpoint resumes on another ep.

Gradients: an expert's gradient on its ep rank is already the sum over the ep group's tokens (the
combine's backward brings every rank's), so the efsdp average (over dp_shard·cp·tp / ep ranks)
leaves it ep / tp times the data-parallel mean (the tp ranks of a replica route disjoint shares of
its tokens, moe_tp.py); `EXPERT_PARAMS` names the parameters the trainer scales by
`expert_grad_scale` = tp / ep.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtrain.model.gpt import moe_layers
from dtrain.parallel.ep.dispatch import AllToAllDispatch

EXPERT_PARAMS = (".experts.w1", ".experts.w2")


def is_expert_param(name: str) -> bool:
    return name.endswith(EXPERT_PARAMS)


def expert_grad_scale(tp: int, ep: int) -> float:
    """What the experts' gradients are multiplied by after their efsdp average (ep > 1)."""
    return tp / ep


@torch.no_grad()
def apply_expert_parallel(part: nn.Module, ep_mesh) -> int:
    """Make each MoE layer's expert weights DTensors sharded over the ep ranks (dim 0: this rank
    keeps its E/ep experts, the global shape stays (E, ., .), so a checkpoint reshards to another
    ep as DCP reshards any DTensor) and swap in the all-to-all dispatch; returns the MoE layers
    changed."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = moe_layers(part)
    for moe in layers:
        local = moe.moe.experts // ep
        for name in ("w1", "w2"):
            full = getattr(moe.experts, name)
            piece = full[rank * local : (rank + 1) * local].clone()
            dt = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False)
            setattr(moe.experts, name, nn.Parameter(dt))
        moe.dispatcher = AllToAllDispatch(ep_mesh.get_group(), ep)
    return len(layers)


def shard_experts(part: nn.Module, efsdp_mesh, mp_policy, reshard: bool) -> None:
    """FSDP2 over the efsdp ranks for each MoE layer's experts (before the blocks are wrapped, so
    a block's FSDP unit leaves them out)."""
    from torch.distributed.fsdp import fully_shard

    for moe in moe_layers(part):
        fully_shard(
            moe.experts, mesh=efsdp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard
        )
