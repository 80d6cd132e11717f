"""Every collective the hand-rolled TP issues, counted; and the volume they should add up to.

ops.py and layers.py reach torch.distributed only through the wrappers below, so a `CommCounter`
(dtrain.parallel.comm: the counter and the byte convention shared with cp/) sees every byte, and
each call is a `tp_comm:<op>` profiler range (bench.py takes the communication share of a step
from those ranges).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain import dist as ddist
from dtrain.parallel.comm import Collective, CommCounter, ProfiledWork, group_size, note, wire_bytes  # noqa: F401

ACTIVATION, GRAD_SYNC = "activation", "grad_sync"  # per micro-batch traffic vs per-step grad sums

# the single-tensor collectives under either torch name: one shim, in dtrain.dist
_all_gather_single, _reduce_scatter_single = ddist.all_gather_single, ddist.reduce_scatter_single


def all_reduce(t: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """In-place sum over `group`; returns a handle with wait() when async_op."""
    n = group_size(group)
    note("all_reduce", tag, t, n)
    with record_function("tp_comm:all_reduce"):
        work = dist.all_reduce(t, group=group, async_op=async_op)
    return ProfiledWork(work) if async_op else None


def all_reduce_flat(tensors: list[torch.Tensor], group, tag: str) -> None:
    """Sum `tensors` in place over `group` with one counted collective (one flat bucket)."""
    ddist.all_reduce_flat(tensors, group, lambda flat, g: all_reduce(flat, g, tag=tag))


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """`out` (n * inp.numel() elements) = every rank's `inp`, rank order, concatenated flat."""
    n = group_size(group)
    note("all_gather", tag, out, n)
    with record_function("tp_comm:all_gather"):
        work = _all_gather_single(out, inp, group=group, async_op=async_op)
    return ProfiledWork(work) if async_op else None


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """`out` = this rank's 1/n slice (along dim 0) of the sum over ranks of `inp`."""
    n = group_size(group)
    note("reduce_scatter", tag, inp, n)
    with record_function("tp_comm:reduce_scatter"):
        work = _reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return ProfiledWork(work) if async_op else None


# ---------------------------------------------------------------- analytic volume

def expected_wire_bytes(*, batch: int, seq: int, d_model: int, n_head: int, n_kv_head: int, tp: int,
                        sequence_parallel: bool, module: str = "block", norm: str = "rmsnorm",
                        bias: bool = False, elem_bytes: int = 4) -> dict[str, int]:
    """Closed-form wire bytes per rank for one forward+backward of one TP layer, by tag.

    activation  each TP region (attention; MLP in a block) enters and leaves once per pass:
                without SP an all-reduce of b*s*h in forward (leave) and backward (enter), with
                SP an all-gather and a reduce-scatter of b*s*h in each pass.
    grad_sync   the replicated parameters whose grads are partial sums, in one all-reduce over
                the TP group: with SP the norm weights, LayerNorm biases and row-parallel biases;
                with kv_heads < tp the whole wk and wv (+ biases) every rank holds.
    """
    regions = 2 if module == "block" else 1
    act = batch * seq * d_model * elem_bytes
    if sequence_parallel:
        activation = regions * 2 * (wire_bytes("all_gather", act, tp) + wire_bytes("reduce_scatter", act, tp))
    else:
        activation = regions * 2 * wire_bytes("all_reduce", act, tp)
    partial = 0  # elements
    if sequence_parallel and tp > 1:
        norms = 2 if module == "block" else 0
        per_norm = d_model * (2 if norm == "layernorm" and bias else 1)
        partial += norms * per_norm + (regions * d_model if bias else 0)
    if n_kv_head < tp:
        partial += 2 * n_kv_head * (d_model // n_head) * (d_model + bias)
    return {ACTIVATION: activation, GRAD_SYNC: wire_bytes("all_reduce", partial * elem_bytes, tp)}
