"""Every collective the hand-rolled TP issues, counted; and the volume they should add up to
(`expected_wire_bytes`: dtrain.parallel.traffic.tp_layer_wire_bytes, the cost model's formulas too).

ops.py and layers.py reach torch.distributed only through the wrappers below, so a `CommCounter`
(dtrain.parallel.comm_counter: the counter and the byte convention shared with cp/) sees every byte,
and each call is a `tp_comm:<op>` profiler range (bench.py takes the communication share of a step
from those ranges).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain.parallel.comm_counter import (
    Collective,  # noqa: F401 (re-exported)
    CommCounter,  # noqa: F401 (re-exported)
    ProfiledWork,
    group_size,
    note,
    wire_bytes,  # noqa: F401 (re-exported)
)
from dtrain.parallel.traffic import ACTIVATION, GRAD_SYNC  # noqa: F401 (re-exported)
from dtrain.parallel.traffic import tp_layer_wire_bytes as expected_wire_bytes  # noqa: F401
from dtrain.run import dist as ddist

# the single-tensor collectives under either torch name: one shim, in dtrain.run.dist
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


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False
):
    """`out` (n * inp.numel() elements) = every rank's `inp`, rank order, concatenated flat."""
    n = group_size(group)
    note("all_gather", tag, out, n)
    with record_function("tp_comm:all_gather"):
        work = _all_gather_single(out, inp, group=group, async_op=async_op)
    return ProfiledWork(work) if async_op else None


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False
):
    """`out` = this rank's 1/n slice (along dim 0) of the sum over ranks of `inp`."""
    n = group_size(group)
    note("reduce_scatter", tag, inp, n)
    with record_function("tp_comm:reduce_scatter"):
        work = _reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return ProfiledWork(work) if async_op else None
