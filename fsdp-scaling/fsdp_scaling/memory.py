"""Per-rank parameter, gradient and optimizer-state bytes: measured, and from the ZeRO formula.

Formula (Adam(W), fp32 master parameters, b = 4 bytes, S = shard degree, n = parameter tensors):

    strategy   S                       params        grads         optimizer
    ddp        1                       4*Psi         4*Psi         8*Psi + 4n
    zero2      world_size              4*Psi_r       4*Psi_r       8*Psi_r + 4n
    zero3      world_size              4*Psi_r       4*Psi_r       8*Psi_r + 4n
    hsdp       world_size / replicate  4*Psi_r       4*Psi_r       8*Psi_r + 4n

S is the ranks FSDP2 shards over, `ParallelModel.shard_degree`: the layout's dp_shard x cp
(dtrain.parallel.mesh, the one home of the degrees); 1 when parameters are whole (ddp).

Psi_r is rank r's share. Ideally Psi / S; FSDP2 shards every parameter along dim 0 in torch.chunk
pieces, so rank r holds rows [r*c, min((r+1)*c, d0)) with c = ceil(d0 / S) and Psi_r is the sum of
those rows times the row size (the last ranks can hold fewer). `formula_bytes` computes exactly
that from the shapes, so it should equal the measurement to the byte; `ideal_bytes` is Psi / S.
8*Psi_r is Adam's exp_avg and exp_avg_sq; 4n its per-tensor fp32 `step` counter.
These are bytes at rest (after a step). zero2 differs from zero3 in what is *transient*: it keeps
each block's gathered parameters from forward to backward; that shows in peak memory, not here.
With bf16 mixed precision the stored parameters stay fp32; only transient gathered copies are bf16.
With train.tp / train.pp the shapes are those of this rank's pipeline stages and tp shards, and S
is the FSDP shard degree over dp (1 for ddp); ideal is Psi / (S * tp * pp).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for a tensor (a DTensor's local shard)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def tp_local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape on one tp rank: the global shape divided along its tp-sharded dim
    (the hand-rolled TP's DTensors); FSDP's sharding is left to `formula_bytes`."""
    shape = list(p.shape)
    mesh = getattr(p, "device_mesh", None)
    for i, (name, placement) in enumerate(
        zip(mesh.mesh_dim_names if mesh else (), getattr(p, "placements", ()))
    ):
        if name == "tp" and placement.is_shard():
            shape[placement.dim] //= mesh.size(i)
    return tuple(shape)


def measure_params(model: nn.Module) -> int:
    return sum(local_bytes(p) for p in model.parameters())


def measure_grads(model: nn.Module) -> int:
    return sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def measure_optimizer(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def local_rows(d0: int, shards: int, index: int) -> int:
    """Rows of a dim-0 torch.chunk shard `index` of `shards` (FSDP2's layout)."""
    c = math.ceil(d0 / shards)
    return max(0, min(c, d0 - index * c))


def formula_bytes(
    shapes: list[tuple[int, ...]], shards: int, index: int, bytes_per_elem: int = 4
) -> dict:
    """{"params", "grads", "optimizer"} bytes for the shard `index` of `shards` (see module doc)."""
    elems = sum(local_rows(s[0], shards, index) * math.prod(s[1:]) for s in shapes)
    return {
        "params": bytes_per_elem * elems,
        "grads": bytes_per_elem * elems,
        "optimizer": 2 * 4 * elems + 4 * len(shapes),
    }


def ideal_bytes(num_params: int, num_tensors: int, shards: int, bytes_per_elem: int = 4) -> dict:
    psi = num_params / shards
    return {
        "params": round(bytes_per_elem * psi),
        "grads": round(bytes_per_elem * psi),
        "optimizer": round(8 * psi) + 4 * num_tensors,
    }
