"""Pipeline parallelism for the shared GPT with torch.distributed.pipelining.

The GPT is cut into `pp * pp_virtual` stages of consecutive blocks (uneven splits allowed: the
extra blocks go to the stages after the first, which also carries the embeddings); the first
stage owns the embeddings, the last the final norm and lm_head. A stage keeps the GPT's module
names (blocks is a ModuleDict keyed by the global block index), so a checkpoint written by any
pipeline layout loads into any other layout.

Schedules (train.pp_schedule) and stages per rank (train.pp_virtual):

    gpipe, 1f1b                  one stage per rank; rank r holds stage r (gpipe also runs
                                 with fewer micro-batches than stages, 1f1b needs >= pp)
    interleaved_1f1b             pp_virtual >= 2 stages per rank, looped: rank r holds r, r+pp, ...
    interleaved_zb               the same placement, zero-bubble (input/weight backward split)
    zbv                          exactly 2 stages per rank in a V: rank r holds r and 2pp-1-r

One optimizer step is one schedule step over the rank's whole local batch, cut into
grad_accum micro-batches; with scale_grads the gradients are the mean over micro-batches, which
is what gradient accumulation computes (loss / grad_accum per micro-step).

MoE: a stage's MoE layers' Switch auxiliary losses (model.moe.aux_loss_coef) are not in the last
stage's loss, so each stage attaches their sum to its output (`AttachAuxLoss`, Megatron's
MoEAuxLossAutoScaler): forward returns the output unchanged, backward also sends the aux loss a
gradient of 1 per micro-batch (the schedule's scale_grads then takes the mean, as the loss's). The
values are kept per micro-batch (`take_aux_losses`) so the reported loss adds every stage's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtrain.model.gpt import GPT, moe_layers
from dtrain.parallel.feasibility import SINGLE_STAGE


def split_layers(n_layer: int, stages: int) -> list[range]:
    """Consecutive block ranges per stage; the remainder goes to stages 1, 2, ... (stage 0 also
    carries the embeddings)."""
    base, extra = divmod(n_layer, stages)  # extra < stages, so stages 1..extra exist
    counts = [base + (1 if 1 <= s <= extra else 0) for s in range(stages)]
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def stages_of_rank(pp_rank: int, pp: int, schedule: str, virtual: int) -> list[int]:
    """Stage indices this pipeline rank holds, in schedule order."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


class AttachAuxLoss(torch.autograd.Function):
    """y = x in forward; in backward the aux loss gets d(loss)/d(aux) = 1 (it is added to the
    micro-batch's loss), x its output's gradient."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x  # unchanged, as Megatron's

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.aux_shape, dtype=torch.float32)


class PipelineStageModule(nn.Module):
    """Blocks `layers` of a GPT, with the embeddings if first and the norm + lm_head if last."""

    is_pipeline_stage = True  # holds only some of the GPT's parameters (checkpoint checks a subset)

    def __init__(self, gpt: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = gpt.cfg, first, last
        if first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        if last:
            self.norm, self.lm_head = gpt.norm, gpt.lm_head
        self.aux_losses: list[torch.Tensor] = []  # per micro-batch: this stage's MoE aux losses
        # forwards that train nothing: build_schedule sets 1 for the schedule's metadata inference
        # (its first step runs the stage once to learn the shapes); their MoE counts are dropped
        self.metadata_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        x = self.lm_head(self.norm(x)) if self.last else x
        if self.metadata_forwards:
            self.metadata_forwards -= 1
            for m in moe_layers(self):
                m.reset_stats()
            return x
        aux = [m.aux_loss for m in moe_layers(self) if m.aux_loss is not None]
        if aux and torch.is_grad_enabled():
            total = torch.stack([a.float() for a in aux]).sum()
            self.aux_losses.append(total.detach())
            x = AttachAuxLoss.apply(x, total)
        return x

    def take_aux_losses(self) -> list[torch.Tensor]:
        """This stage's aux losses since the last call, one per micro-batch forward."""
        taken, self.aux_losses = self.aux_losses, []
        return taken


def split_model(
    gpt: GPT, pp: int, pp_rank: int, schedule: str, virtual: int
) -> list[tuple[int, PipelineStageModule]]:
    """(stage index, stage module) for each stage this rank holds."""
    stages = pp * virtual  # check_pipeline: zbv has virtual = 2
    ranges = split_layers(gpt.cfg.n_layer, stages)
    return [
        (s, PipelineStageModule(gpt, ranges[s], s == 0, s == stages - 1))
        for s in stages_of_rank(pp_rank, pp, schedule, virtual)
    ]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss: mean token cross-entropy in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_schedule(
    parts: list[tuple[int, nn.Module]],
    num_stages: int,
    schedule: str,
    micro_batches: int,
    pp_group,
    device: torch.device,
):
    """The pipelining schedule driving this rank's stages."""
    from torch.distributed import pipelining as pl

    stages = [
        pl.PipelineStage(module, index, num_stages, device, group=pp_group)
        for index, module in parts
    ]
    for _, module in parts:  # no input_args: the first step infers the shapes with one forward
        module.metadata_forwards = 1
    cls = {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
        "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
        "zbv": pl.ScheduleZBVZeroBubble,
    }[schedule]
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
