"""The trainer's model-parallel path: a GPT split by pp and tp, data-parallel over the rest.

Applied in torchtitan's order, per pipeline stage: pipeline split -> tensor parallelism ->
activation checkpointing -> compile -> FSDP2 over the dp mesh dimension (2-D with tp). With pp > 1, zero3
and hsdp keep parameters gathered between forward and backward (as zero2 does). Data parallelism
over dp ranks is FSDP2 for zero2 / zero3 / hsdp and, for ddp, one all-reduce of every gradient
over the dp group after backward (DDP does not take DTensor parameters).

`ModelParallel.forward_backward(batches)` runs one optimizer step's micro-batches (gradient
accumulation, or one pipeline schedule step) and returns this rank's mean loss (None on ranks
that do not hold the last stage).
"""
from __future__ import annotations

import dataclasses
from collections import ChainMap

import torch
import torch.distributed as dist
import torch.nn as nn

from dtrain.model import GPT
from dtrain.parallel import pipeline
from dtrain.parallel.mesh import ParallelDims
from dtrain.parallel.tp.apply import apply_tp, sum_partial_grads
from dtrain.parallel.tp.layers import local_shard
from dtrain.train.config import TrainConfig
from dtrain.train.parallelize import apply_activation_checkpointing, apply_compile, apply_fsdp


class OptimizerParts:
    """One AdamW per model part (pipeline stage), driven as one optimizer (torchtitan's container).
    Parameters are grouped by mesh inside each, so no foreach kernel mixes DTensor meshes."""

    def __init__(self, parts: list[nn.Module], **adamw):
        self.optimizers = [torch.optim.AdamW(_groups_by_mesh(part), **adamw) for part in parts]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        return ChainMap(*(opt.state for opt in self.optimizers))

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _mesh_key(p: torch.Tensor) -> str:
    mesh = getattr(p, "device_mesh", None)
    return "plain" if mesh is None else str(mesh.mesh_dim_names)


def _groups_by_mesh(part: nn.Module) -> list[dict]:
    groups: dict[str, list] = {}
    for p in part.parameters():
        groups.setdefault(_mesh_key(p), []).append(p)
    return [{"params": ps} for ps in groups.values()]


class ModelParallel:
    def __init__(self, gpt: GPT, train: TrainConfig, dims: ParallelDims, device: torch.device):
        self.train, self.dims, self.device = train, dims, device
        dims.build_mesh(device.type)
        self.pp_rank = dims.coordinate("pp")
        if dims.pp > 1:
            staged = pipeline.split_model(gpt, dims.pp, self.pp_rank, train.pp_schedule, train.pp_virtual)
        else:
            staged = [(0, gpt)]
        self.num_stages = dims.pp * train.pp_virtual if dims.pp > 1 else 1
        dp_mesh = dims.dp_mesh()
        self.fsdp = dp_mesh is not None and train.sharded
        # With pp, parameters stay gathered from forward to backward (torchtitan's default): a
        # stage runs many micro-batches per step, and the zero-bubble schedules' weight-gradient
        # pass runs outside FSDP's backward hooks, so it needs them still unsharded.
        fsdp_train = dataclasses.replace(train, strategy="zero2") if dims.pp > 1 else train
        self.partial_grads: list[set[str]] = []  # per part: SP and replicated-k/v grads summed over tp
        for _, part in staged:
            partial = []
            if dims.tp > 1:
                partial = apply_tp(part, dims.submesh("tp"), train.sequence_parallel, gpt.cfg.n_layer,
                                   train.async_grad_allreduce)
            self.partial_grads.append(set(partial))
            if train.activation_checkpointing != "none":
                apply_activation_checkpointing(part, train.activation_checkpointing)
            if train.compile:
                apply_compile(part)
            if self.fsdp:
                apply_fsdp(part, fsdp_train, dp_mesh, device)
            else:
                part.to(device)
        self.parts = [part for _, part in staged]
        self.holds_last = any(index == self.num_stages - 1 for index, _ in staged)
        self.holds_first = any(index == 0 for index, _ in staged)
        self.schedule = None
        if dims.pp > 1:
            self.schedule = pipeline.build_schedule(staged, self.num_stages, train.pp_schedule, train.grad_accum,
                                                    dims.submesh("pp").get_group(), device)

    @property
    def module(self) -> nn.Module:
        """One module whose parameters() are this rank's (the single part, or all parts in a list)."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast) -> torch.Tensor | None:
        if self.schedule is None:
            losses = []
            for x, y in batches:
                with autocast():
                    loss = self.parts[0](x, y)
                (loss / len(batches)).backward()
                losses.append(loss.detach())
        else:
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            losses = [] if self.holds_last else None
            args = (x,) if self.holds_first else ()
            with autocast():
                self.schedule.step(*args, target=y if self.holds_last else None, losses=losses,
                                   return_outputs=False)
            losses = [t.detach() for t in losses] if losses is not None else None
        for part, names in zip(self.parts, self.partial_grads):
            if names:
                sum_partial_grads(part, names, self.dims.submesh("tp").get_group())
        if self.train.strategy == "ddp" and self.dims.dp > 1:
            self._all_reduce_grads()
        return torch.stack(losses).float().mean() if losses else None

    @torch.no_grad()
    def _all_reduce_grads(self) -> None:
        """ddp over the dp group: average every local gradient (one flat bucket)."""
        grads = [local_shard(p.grad) for part in self.parts for p in part.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dims.dp_mesh().get_group())
        flat /= self.dims.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Global L2 norm of all gradients across every rank, then clip (torch's clip_grad_norm_ rule).

        Each rank sums the squares of its local gradient pieces, weighted by 1 / (number of
        ranks holding an identical copy of that piece), so the world-wide sum counts each
        element once: a piece sharded over n mesh ranks has world / (pp * n) copies."""
        dims = self.dims
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = [p.grad for part in self.parts for p in part.parameters() if p.grad is not None]
        for g in grads:
            shards = 1
            for dim, placement in enumerate(getattr(g, "placements", ())):
                if not placement.is_replicate():  # Shard, or FSDP's _StridedShard (not a Shard subclass)
                    shards *= g.device_mesh.size(dim)
            copies = dims.world_size // (dims.pp * shards)
            total += local_shard(g).double().pow(2).sum() / copies
        if dims.world_size > 1:
            dist.all_reduce(total)
        norm = float(total.sqrt())
        if max_norm is not None:
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                for g in grads:
                    local_shard(g).mul_(coef)
        return norm
