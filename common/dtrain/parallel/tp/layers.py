"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, section 3).

    ColumnParallelLinear   Y_i = X A_i^T + b_i    A split by output rows: rank i owns out/tp rows
    RowParallelLinear      Y = sum_i X_i B_i^T + b  B split by input columns; bias added once,
                                                  after the reduction

Without sequence parallelism the column layer enters the TP region with copy_to_region and the
row layer leaves it with reduce_from_region (one all-reduce forward, one backward). With it
(Korthikanti et al. 2022) the input arrives sharded along the sequence: all-gather on entry,
reduce-scatter on exit.

`async_grad_allreduce` fuses entry and GEMM into one autograd function whose backward starts
the input-gradient all-reduce (reduce-scatter with SP) and computes the weight gradient while it
runs (picotron's LinearWithAsyncAllReduce, Megatron's gradient_accumulation_fusion path).
`linears_async_grad_reduce` does the same for several layers sharing one input (separate q, k
and v: one collective of the summed input gradient, three weight-gradient GEMMs behind it).

Parameters may be plain tensors (this rank's shard) or DTensors on the tp mesh (the trainer's
layout, so FSDP2 and DCP see global shapes); the GEMMs always run on the local shard.

Parameters whose gradients are partial sums across ranks carry `param.grad_allreduce = (group,
rows)`; `allreduce_partial_grads(module)` sums them after backward (one bucket per group), the
one reducer of partial gradients (tp-attention and the trainer).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtrain.parallel.tp import tp_collectives, ops


def local_shard(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a parameter: a DTensor's local tensor (differentiable), else itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class _LinearsAsyncGradReduce(torch.autograd.Function):
    """y_i = enter(x) W_i^T + b_i for column layers sharing one input (one layer, or q, k and v),
    whose backward overlaps the input-grad collective with the weight-grad GEMMs.

    The input gradient sum_i grad_i W_i is computed first and its all-reduce (reduce-scatter
    with SP) started asynchronously; the weight and bias gradients are computed while it runs."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        # The gathered input is kept for the weight gradient (Megatron re-gathers it to save
        # memory).
        x_full = ops.all_gather_dim(x, 1, group) if sequence_parallel else x
        ctx.save_for_backward(x_full, *weights)
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel, [b is not None for b in biases]
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads_out):
        x_full, *weights = ctx.saved_tensors
        group, n = ctx.group, tp_collectives.group_size(ctx.group)
        grad_in = grads_out[0].matmul(weights[0])
        for grad, weight in zip(grads_out[1:], weights[1:]):
            grad_in = grad_in + grad.matmul(weight)
        work = None
        if (
            n > 1 and ctx.sp
        ):  # reduce-scatter along seq: seq-major so each rank's slice is contiguous
            grad_in = grad_in.transpose(0, 1).contiguous()
            grad_in_shard = grad_in.new_empty((grad_in.shape[0] // n, *grad_in.shape[1:]))
            work = tp_collectives.reduce_scatter(grad_in_shard, grad_in, group, async_op=True)
        elif n > 1:
            work = tp_collectives.all_reduce(grad_in, group, async_op=True)
        # Runs while the collective is in flight.
        x_flat = x_full.flatten(0, -2)
        param_grads = []
        for grad, has_bias in zip(grads_out, ctx.has_bias):
            grad = grad.flatten(0, -2)
            param_grads += [grad.t().matmul(x_flat), grad.sum(0) if has_bias else None]
        if work is not None:
            work.wait()
        if n > 1 and ctx.sp:
            grad_in = grad_in_shard.transpose(0, 1)
        return grad_in, None, None, *param_grads


def linears_async_grad_reduce(
    layers: list["ColumnParallelLinear"], x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Enter the TP region once and apply every layer (same group and SP setting) to `x`, with the
    input-grad collective overlapped with the weight-grad GEMMs. Under autocast the inputs are cast
    here, outside the autograd function, so its backward sees one dtype."""
    params = [t for layer in layers for t in layer.local_weight_and_bias()]
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, params = x.to(dtype), [None if t is None else t.to(dtype) for t in params]
    first = layers[0]
    return _LinearsAsyncGradReduce.apply(x, first.group, first.sequence_parallel, *params)


class ColumnParallelLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        group,
        tp: int,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        async_grad_allreduce: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by tp={tp}")
        if gather_output and (sequence_parallel or async_grad_allreduce):
            raise ValueError(
                "gather_output works only without sequence_parallel and async_grad_allreduce"
            )
        self.group, self.tp = group, tp
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        self.async_grad_allreduce = async_grad_allreduce
        # Replicated weight (the trainer's k/v heads when kv_heads < tp): this rank computes with
        # only these rows of it; None = all of its rows.
        self.rows: slice | None = None
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features // tp, **kw)) if bias else None

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        tp: int,
        group=None,
        **options,
    ):
        """Rank `rank`'s shard of a full (out, in) weight: rows [rank*out/tp, (rank+1)*out/tp)."""
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            bias=bias is not None,
            group=group,
            tp=tp,
            device=weight.device,
            dtype=weight.dtype,
            **options,
        )
        shard = lambda t: t.chunk(tp, dim=0)[rank]  # noqa: E731
        return layer.load_shard(shard(weight), None if bias is None else shard(bias))

    @torch.no_grad()
    def load_shard(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> "ColumnParallelLinear":
        """Set this rank's rows directly (fused or replicated layouts build their own)."""
        self.weight.copy_(weight)
        if self.bias is not None:
            self.bias.copy_(bias)
        return self

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into the TP region: every rank needs the whole input (several layers may share one
        entry)."""
        if self.sequence_parallel:
            return ops.gather_from_sequence(x, self.group)
        return ops.copy_to_region(x, self.group)

    def local_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (differentiable) weight and bias this rank computes with."""
        weight, bias = local_shard(self.weight), local_shard(self.bias)
        if self.rows is not None:
            weight, bias = weight[self.rows], None if bias is None else bias[self.rows]
        return weight, bias

    def local(self, x_entered: torch.Tensor) -> torch.Tensor:
        return F.linear(x_entered, *self.local_weight_and_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.async_grad_allreduce:
            return linears_async_grad_reduce([self], x)[0]
        y = self.local(self.enter(x))
        return ops.gather_from_hidden(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        group,
        tp: int,
        sequence_parallel: bool = False,
        input_is_parallel: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tp={tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.group, self.tp = group, tp
        self.sequence_parallel, self.input_is_parallel = sequence_parallel, input_is_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        if self.bias is not None and sequence_parallel:  # each rank saw only its tokens
            self.bias.grad_allreduce = (group, None)

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        tp: int,
        group=None,
        **options,
    ):
        """Rank `rank`'s shard of a full (out, in) weight: columns [rank*in/tp, (rank+1)*in/tp);
        full bias."""
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            bias=bias is not None,
            group=group,
            tp=tp,
            device=weight.device,
            dtype=weight.dtype,
            **options,
        )
        with torch.no_grad():
            layer.weight.copy_(weight.chunk(tp, dim=1)[rank])
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = ops.scatter_to_hidden(x, self.group)
        y = F.linear(
            x, local_shard(self.weight)
        )  # partial sums: the bias must wait for the reduction
        if self.sequence_parallel:
            y = ops.reduce_scatter_to_sequence(y, self.group)
        else:
            y = ops.reduce_from_region(y, self.group)
        return y if self.bias is None else y + local_shard(self.bias)


def partial_grads(module: nn.Module, prefix: str = "") -> dict[str, tuple]:
    """name -> (group, rows) of the parameters marked `grad_allreduce`: take it before anything
    replaces the parameters (FSDP2, DTensor conversion), which drops the mark."""
    return {
        prefix + n: p.grad_allreduce
        for n, p in module.named_parameters()
        if hasattr(p, "grad_allreduce")
    }


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@torch.no_grad()
def allreduce_partial_grads(module: nn.Module, specs: dict[str, tuple] | None = None) -> None:
    """Sum the partial gradients over their group: one flat bucket per group, in parameter order
    (identical on every rank). `specs` (from `partial_grads`, default: the module's own marks)
    names them; `rows` (a slice) limits the sum to those rows, e.g. the replicated k/v rows of a
    fused QKV weight. Local shards are summed, so it also works after FSDP2 has reduce-scattered
    the gradients over dp."""
    specs = partial_grads(module) if specs is None else specs
    buckets: dict[int, tuple] = {}
    for name, p in module.named_parameters():
        for wrapper in _WRAPPERS:
            name = name.replace(wrapper, "")
        spec = specs.get(name)
        if spec is None or p.grad is None or tp_collectives.group_size(spec[0]) == 1:
            continue
        group, rows = spec
        grad = local_shard(p.grad)
        buckets.setdefault(id(group), (group, []))[1].append(grad if rows is None else grad[rows])
    for group, grads in buckets.values():
        tp_collectives.all_reduce_flat(grads, group, tag=tp_collectives.GRAD_SYNC)
