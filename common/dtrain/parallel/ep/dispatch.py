"""Dispatch and combine of expert parallelism, counted and profiled (dtrain.parallel.comm_counter's
convention; the byte formulas: dtrain.parallel.traffic's ``ep_*``).

An MoE layer hands its dispatcher its routed rows sorted by expert and the rows per expert
(``counts``, E). ``AllToAllDispatch`` then, over the ep group (ranks r = 0..ep-1 holding experts
r·E/ep .. (r+1)·E/ep - 1):

1. exchanges the counts (an even all-to-all of E int64: each rank learns how many rows every rank
   sends each of its local experts);
2. sends each rank its experts' rows (``all_to_all_v``: uneven splits; autograd's backward is the
   reverse all-to-all of the gradients);
3. regroups what arrived from (source rank, local expert) order into local-expert order, runs the
   local experts as one grouped GEMM, restores the order;
4. sends the results back (the combine, the same all-to-all reversed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain.parallel.comm_counter import note, note_bytes
from dtrain.parallel.traffic import COMBINE, COUNTS, DISPATCH, ep_uneven_wire_bytes


def _all_to_all_v(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, tag: str):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    note_bytes("all_to_all_v", tag, ep_uneven_wire_bytes(in_splits, rank, 1, row_bytes), n)
    with record_function(f"ep_comm:{tag}"):
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
        )
    return out


class AllToAllV(torch.autograd.Function):
    """Uneven all-to-all with its reverse as backward: rows in_splits[j] to rank j, out_splits[j]
    from rank j."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, tag, back_tag):
        ctx.splits, ctx.group, ctx.back_tag = (out_splits, in_splits), group, back_tag
        return _all_to_all_v(x, out_splits, in_splits, group, tag)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = _all_to_all_v(grad.contiguous(), in_splits, out_splits, ctx.group, ctx.back_tag)
        return back, None, None, None, None, None


class AllToAllDispatch:
    """The MoE layer's dispatcher under expert parallelism (see the module docstring); returns the
    combined rows, in the order they came, and the rows this rank's experts computed."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(ep, E/ep): row j = the rows rank j sends each of this rank's experts."""
        counts = counts.to(torch.int64).contiguous()
        received = torch.empty_like(counts)
        note("all_to_all", COUNTS, counts, self.ep)
        with record_function("ep_comm:counts"):
            dist.all_to_all_single(received, counts, group=self.group)
        return received.view(self.ep, -1)

    # eager under torch.compile (train.compile): data-dependent splits and collectives; the
    # compiled block runs around it
    @torch.compiler.disable
    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts):
        received = self.exchange_counts(counts)
        in_splits = counts.view(self.ep, -1).sum(1).tolist()
        out_splits = received.sum(1).tolist()
        got = AllToAllV.apply(rows, out_splits, in_splits, self.group, DISPATCH, DISPATCH + "_grad")
        # (source, expert) blocks -> (expert, source) blocks: each local expert's rows together
        local = received.shape[1]
        block = torch.repeat_interleave(
            torch.arange(received.numel(), device=rows.device), received.flatten().to(rows.device)
        )  # each received row's (source, expert) block index
        key = (block % local) * self.ep + block // local  # its (expert, source) block index
        perm = torch.argsort(key, stable=True)
        out = experts(got[perm], received.sum(0).tolist())
        if out.grad_fn is None and got.requires_grad:
            # no rows reached this rank's experts (their output is a fresh empty tensor): keep it
            # in the graph, so backward runs the dispatch's reverse all-to-all here too, which the
            # other ranks wait for
            out = out + got[perm] * 0
        restored = out[torch.argsort(perm)]
        back = AllToAllV.apply(
            restored, in_splits, out_splits, self.group, COMBINE, COMBINE + "_grad"
        )
        return back, sum(out_splits)
