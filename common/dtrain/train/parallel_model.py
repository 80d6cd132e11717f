"""The model the training loop drives, whatever the layout: this rank's parts (pipeline stages, or
the one whole model), built by dtrain.train.parallelize.

    forward_backward(batches)  one optimizer step's micro-batches (gradient accumulation, or one
                               pipeline-schedule step), then the gradient sums the layout needs;
                               returns this rank's mean loss (None on ranks without the last stage)
    global_loss(local)         the loss every rank reports: the mean over the ranks holding the
                               last stage (tp copies of it are equal, dp replicas and cp ranks,
                               each holding as many tokens, are averaged)
    clip_grad_norm(max_norm)   the global L2 norm of all gradients, clipped (DTensor-aware)

One optimizer per part (`OptimizerParts`), driven as one.
"""

from __future__ import annotations

import contextlib
from collections import ChainMap

import torch
import torch.distributed as dist
import torch.nn as nn

from dtrain.parallel.mesh import ParallelDims
from dtrain.parallel.tp.layers import allreduce_partial_grads, local_shard
from dtrain.run import dist as ddist
from dtrain.train.config import TrainConfig


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


@torch.no_grad()
def clip_grad_norm(
    grads: list[torch.Tensor],
    max_norm: float | None,
    world_size: int,
    pp: int,
    device: torch.device,
) -> float:
    """Global L2 norm of `grads` across every rank, then clip (torch's clip_grad_norm_ rule).

    Each rank sums the squares of its local gradient pieces, weighted by 1 / (number of ranks
    holding an identical copy of that piece), so the world-wide sum counts each element once: a
    piece sharded over n mesh ranks (FSDP2, TP) has world / (pp * n) copies; a plain tensor
    (single, DDP, a tp-replicated parameter) is sharded over nothing. When every piece is on every
    rank (single, DDP: the same on every rank of a layout) no collective is needed."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        shards = 1
        for dim, placement in enumerate(getattr(g, "placements", ())):
            if (
                not placement.is_replicate()
            ):  # Shard, or FSDP's _StridedShard (not a Shard subclass)
                shards *= g.device_mesh.size(dim)
        by_copies.setdefault(world_size // (pp * shards), []).append(local_shard(g))
    reduce = world_size > 1 and set(by_copies) != {world_size}
    total = torch.zeros((), dtype=torch.float64, device=device)
    for copies, local in by_copies.items():
        total += torch.stack(torch._foreach_norm(local)).double().pow(2).sum() / (
            copies if reduce else 1
        )
    if reduce:
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None and max_norm / (norm + 1e-6) < 1:
        torch._foreach_mul_(
            [t for local in by_copies.values() for t in local], max_norm / (norm + 1e-6)
        )
    return norm


class ParallelModel:
    def __init__(
        self,
        staged: list[tuple[int, nn.Module]],
        partial_grads: list[dict],
        train: TrainConfig,
        dims: ParallelDims,
        device: torch.device,
        *,
        fsdp: bool,
        all_reduce_grads: bool,
        cp_impl: str | None = None,
        seq_len: int | None = None,
    ):
        self.train, self.dims, self.device = train, dims, device
        self.cp_impl = cp_impl  # ring | ulysses | torch; None without cp
        self.cp = None
        if cp_impl is not None:
            from dtrain.parallel.cp.trainer_cp import ContextParallel

            self.cp = ContextParallel(cp_impl, dims.submesh("cp"), seq_len, device)
        self.fsdp = fsdp  # FSDP2 shards the parts over dp
        self.all_reduce_grads = all_reduce_grads  # replicas the loop all-reduces (no DDP wrapper)
        self.parts = [part for _, part in staged]
        self.partial_grads = partial_grads  # per part: name -> (group, rows), summed over tp
        self.num_stages = dims.pp * train.pp_virtual if dims.pp > 1 else 1
        self.holds_last = any(index == self.num_stages - 1 for index, _ in staged)
        self.holds_first = any(index == 0 for index, _ in staged)
        self.schedule = None
        if dims.pp > 1:
            from dtrain.parallel import pipeline

            self.schedule = pipeline.build_schedule(
                staged,
                self.num_stages,
                train.pp_schedule,
                train.grad_accum,
                dims.submesh("pp").get_group(),
                device,
            )

    @property
    def shard_degree(self) -> int:
        """Ranks FSDP2 shards a parameter over (shard x cp); 1 when parameters are whole."""
        return self.dims.dp_shard * self.dims.cp if self.fsdp else 1

    @property
    def shard_index(self) -> int:
        """This rank's shard among them (the flattened (shard, cp) coordinate)."""
        return (
            self.dims.coordinate("shard") * self.dims.cp + self.dims.coordinate("cp")
            if self.fsdp
            else 0
        )

    @property
    def module(self) -> nn.Module:
        """One module whose parameters() are this rank's (the single part, or all parts in a
        list)."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)

    def forward_backward(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast, scale=None
    ) -> torch.Tensor | None:
        """`scale(loss)`: a grad scaler's (fp16), applied before backward."""
        batches = [
            (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            for x, y in batches
        ]
        if self.schedule is None:
            losses, model = [], self.parts[0]
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1  # DDP: all-reduce only after the last micro-batch
                with (
                    (
                        model.no_sync()
                        if hasattr(model, "no_sync") and not last
                        else contextlib.nullcontext()
                    ),
                    self._tokens(x, y) as (x, y, positions),
                ):
                    with autocast():
                        loss = (
                            model(x, y) if positions is None else model(x, y, positions=positions)
                        )
                    scaled = loss / len(batches)
                    (scale(scaled) if scale else scaled).backward()
                losses.append(loss.detach())
        else:
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            losses = [] if self.holds_last else None
            args = (x,) if self.holds_first else ()
            with autocast():
                self.schedule.step(
                    *args,
                    target=y if self.holds_last else None,
                    losses=losses,
                    return_outputs=False,
                )
            losses = [t.detach() for t in losses] if losses is not None else None
            losses = self._add_stage_aux_losses(losses, len(batches))
        self._sync_grads()
        return torch.stack(losses).float().mean() if losses else None

    def _add_stage_aux_losses(self, losses: list | None, micro_batches: int) -> list | None:
        """With pp, the MoE aux losses of this rank's stages (dtrain.parallel.pipeline), each a
        mean over the step's micro-batches, join the loss this rank reports: `global_loss` sums
        every rank's, so the reported loss holds every stage's (as GPT.forward's does)."""
        aux = [a for part in self.parts for a in part.take_aux_losses()]
        if not aux:
            return losses
        extra = torch.stack(aux).sum() / micro_batches
        if not losses:
            return [extra]
        return [t.float() + extra for t in losses]

    @contextlib.contextmanager
    def _tokens(self, x: torch.Tensor, y: torch.Tensor):
        """(x, y, positions) this rank trains on: the whole micro-batch (positions None), or with cp
        its sequence shard, forward and backward inside the cp context."""
        if self.cp is None:
            yield x, y, None
        else:
            with self.cp.batch(x, y) as shard:
                yield shard

    @torch.no_grad()
    def _sync_grads(self) -> None:
        """The sums autograd does not do: partial gradients over tp (the hand-rolled layers' marked
        ones; DTensor's Partial ones, which FSDP2 would otherwise redistribute), and replicas over
        dp when no DDP wrapper does it (model split by tp / pp)."""
        for part, specs in zip(self.parts, self.partial_grads):
            if specs:
                allreduce_partial_grads(part, specs)
        for p in self.parameters():
            if p.grad is not None and any(
                pl.is_partial() for pl in getattr(p.grad, "placements", ())
            ):
                p.grad = p.grad.redistribute(placements=p.placements)
        if self.dims.ep > 1:  # the experts' efsdp average is ep / tp x the data mean (trainer_ep)
            from dtrain.parallel.ep.trainer_ep import expert_grad_scale

            scale = expert_grad_scale(self.dims.tp, self.dims.ep)
            for p in self._expert_params():
                if p.grad is not None and scale != 1:
                    local_shard(p.grad).mul_(scale)
        if self.all_reduce_grads:
            grads = [local_shard(p.grad) for p in self.parameters() if p.grad is not None]
            ddist.all_reduce_flat(
                grads, self.dims.replica_group(), divisor=self.dims.dp_replicate * self.dims.cp
            )

    def parameters(self) -> list[torch.Tensor]:
        return [p for part in self.parts for p in part.parameters()]

    def _expert_params(self) -> list[torch.Tensor]:
        from dtrain.parallel.ep.trainer_ep import is_expert_param

        return [p for part in self.parts for n, p in part.named_parameters() if is_expert_param(n)]

    def global_loss(self, local: torch.Tensor | None) -> float:
        total = (
            (local if local is not None else torch.zeros(()))
            .to(self.device, torch.float32)
            .reshape(())
        )
        if self.dims.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total) / (self.dims.world_size // self.dims.pp)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return clip_grad_norm(grads, max_norm, self.dims.world_size, self.dims.pp, self.device)
