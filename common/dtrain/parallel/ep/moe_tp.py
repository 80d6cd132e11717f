"""MoE layers under tensor parallelism of the attention (train.tp > 1, expert TP 1), as torchtitan's
MoE sharding with expert parallelism on (torchtitan/models/common/MOE_SHARDING.md, "EP on"): the
tp ranks of a replica route disjoint shares of its tokens, so every token is routed and computed
once per tp group, and experts are never split by tp.

    sequence parallelism   the MoE layer's input is already this rank's sequence slice (the
                           residual stream between the TP regions): it runs on it, nothing moves
    without it             the input is replicated: the layer takes this rank's slice of the
                           sequence (backward: the gradients' all-gather) and all-gathers its
                           output (backward: this rank's slice), dtrain.parallel.tp.ops'
                           scatter_to_sequence / gather_sequence_to_replicated

The experts then see this rank's tokens only: with ep = 1 each rank holds every expert, with ep > 1
the tp ranks are part of the ep fold (dp_shard·cp·tp = efsdp·ep, dtrain.parallel.mesh) and the
all-to-all sends each token to its experts' rank. The router gate, the shared experts and (ep = 1)
the experts are replicated over tp but see different tokens there, so their gradients are partial
sums over tp (`split_tokens_over_tp` returns them for the trainer's partial-gradient reducer).
"""

from __future__ import annotations

import torch.nn as nn

from dtrain.model.moe import MoE
from dtrain.parallel.ep.trainer_ep import is_expert_param


def split_tokens_over_tp(part: nn.Module, tp_group, sequence_parallel: bool, ep: int) -> dict:
    """Route each token of every MoE layer of `part` on one tp rank (see the module docstring);
    returns the parameters whose gradients are partial sums over tp, name -> (group, None)."""
    from dtrain.parallel.tp import ops

    partial = {}
    for name, module in part.named_modules():
        if not isinstance(module, MoE):
            continue
        if not sequence_parallel:
            module.register_forward_pre_hook(
                lambda m, args: (ops.scatter_to_sequence(args[0], tp_group),)
            )
            module.register_forward_hook(
                lambda m, args, out: ops.gather_sequence_to_replicated(out, tp_group)
            )
        for pname, _ in module.named_parameters():
            full = f"{name}.{pname}"
            if ep > 1 and is_expert_param(full):  # on the experts' mesh: efsdp x ep (trainer_ep)
                continue
            partial[full] = (tp_group, None)
    return partial
