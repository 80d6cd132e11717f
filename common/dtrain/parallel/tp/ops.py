"""The conjugate communication operators of Megatron-style tensor parallelism.

Each is an autograd function whose backward is the forward of its partner:

    copy_to_region          fwd identity                  bwd all-reduce        (enter a TP region)
    reduce_from_region      fwd all-reduce                bwd identity          (leave a TP region)
    gather_from_hidden      fwd all-gather last dim       bwd keep own slice
    scatter_to_hidden       fwd keep own slice            bwd all-gather last dim
    gather_from_sequence    fwd all-gather dim 1 (seq)    bwd reduce-scatter dim 1   (SP enter)
    reduce_scatter_to_sequence  fwd reduce-scatter dim 1  bwd all-gather dim 1       (SP leave)
    scatter_to_sequence     fwd keep own seq slice        bwd all-gather dim 1       (into SP)
    gather_sequence_to_replicated  fwd all-gather dim 1   bwd keep own seq slice     (out of SP)

The last two bracket a stack of SP blocks whose surroundings run replicated on every tp rank
(the trainer's embeddings and head): the replicated gradient is the same on every rank, so
leaving SP keeps a slice of it instead of summing tp copies.

Activations are (batch, seq, hidden). With one rank in the group every operator is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.tp import tp_collectives


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (in rank order)."""
    n = tp_collectives.group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    tp_collectives.all_gather(out, x, group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over ranks and keep this rank's slice along `dim`."""
    n = tp_collectives.group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    tp_collectives.reduce_scatter(out, x, group)
    return out.movedim(0, dim)


def own_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_collectives.group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[_rank(group)].contiguous()


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    if tp_collectives.group_size(group) > 1:
        tp_collectives.all_reduce(x, group)
    return x


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A copy: autograd may hand the same grad tensor to other consumers (a residual add does).
        return all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # Summed in place (Megatron does the same): x is a fresh matmul output nobody saved.
        ctx.mark_dirty(x)
        return all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, -1, ctx.group), None


class _ScatterToHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_slice(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, -1, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, 1, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_slice(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


class _GatherSequenceToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # all_gather_dim returns a movedim view of its buffer; this is the last block's output, and
        # FSDP2 warns about a wrapped module that returns a view ("returned a view tensor", once per
        # rank): hand it a tensor of its own (one copy of the residual stream per step)
        return all_gather_dim(x, 1, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, 1, ctx.group), None


def copy_to_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def gather_from_hidden(x, group):
    return _GatherFromHidden.apply(x, group)


def scatter_to_hidden(x, group):
    return _ScatterToHidden.apply(x, group)


def gather_from_sequence(x, group):
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x, group):
    return _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x, group):
    return _ScatterToSequence.apply(x, group)


def gather_sequence_to_replicated(x, group):
    return _GatherSequenceToReplicated.apply(x, group)
