"""Every collective the hand-rolled TP issues, counted; and the volume they should add up to.

ops.py and layers.py reach torch.distributed only through the wrappers below, so a `CommCounter`
sees every byte, and each call is a `tp_comm:<op>` profiler range (bench.py takes the
communication share of a step from those ranges).

Volume convention: bytes one rank sends over the wire with ring algorithms (nccl-tests' "bus
bytes"). For a payload of S bytes over n ranks (S = the full, gathered size):

    all-reduce 2(n-1)/n * S        all-gather, reduce-scatter (n-1)/n * S

so sequence parallelism (all-gather + reduce-scatter) moves exactly what all-reduce moves.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain import dist as ddist

ACTIVATION, GRAD_SYNC = "activation", "grad_sync"  # per micro-batch traffic vs per-step grad sums

# the single-tensor collectives under either torch name: one shim, in dtrain.dist
_all_gather_single, _reduce_scatter_single = ddist.all_gather_single, ddist.reduce_scatter_single


def group_size(group) -> int:
    """Ranks in `group`; 1 when torch.distributed is not initialised (a lone tp=1 module)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def wire_bytes(op: str, payload_bytes: int, n: int) -> int:
    """Bytes one rank sends for `op` on a ring of n ranks (see the module docstring)."""
    factor = 2 if op == "all_reduce" else 1
    return factor * (n - 1) * payload_bytes // n


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter
    tag: str  # ACTIVATION | GRAD_SYNC
    payload_bytes: int  # the full (gathered / reduced) tensor
    group_size: int

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.op, self.payload_bytes, self.group_size)


class CommCounter:
    """`with CommCounter() as c: step()` -> c.calls, c.wire_bytes(tag), c.op_counts()."""

    _active: list["CommCounter"] = []

    def __init__(self):
        self.calls: list[Collective] = []

    def __enter__(self):
        CommCounter._active.append(self)
        return self

    def __exit__(self, *exc):
        CommCounter._active.remove(self)

    def wire_bytes(self, tag: str | None = None) -> int:
        return sum(c.wire_bytes for c in self.calls if tag is None or c.tag == tag)

    def payload_bytes(self, tag: str | None = None) -> int:
        return sum(c.payload_bytes for c in self.calls if tag is None or c.tag == tag)

    def op_counts(self) -> dict[str, int]:
        return dict(Counter(c.op for c in self.calls))


def _note(op: str, tag: str, payload: torch.Tensor, n: int) -> None:
    for counter in CommCounter._active:
        counter.calls.append(Collective(op, tag, payload.numel() * payload.element_size(), n))


class _ProfiledWork:
    """An async handle whose wait() is a profiler range: the exposed part of an overlapped collective."""

    def __init__(self, work):
        self.work = work

    def wait(self) -> None:
        with record_function("tp_comm:wait"):
            self.work.wait()


def all_reduce(t: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """In-place sum over `group`; returns a handle with wait() when async_op."""
    n = group_size(group)
    _note("all_reduce", tag, t, n)
    with record_function("tp_comm:all_reduce"):
        work = dist.all_reduce(t, group=group, async_op=async_op)
    return _ProfiledWork(work) if async_op else None


def all_reduce_flat(tensors: list[torch.Tensor], group, tag: str) -> None:
    """Sum `tensors` in place over `group` with one counted collective (one flat bucket)."""
    ddist.all_reduce_flat(tensors, group, lambda flat, g: all_reduce(flat, g, tag=tag))


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """`out` (n * inp.numel() elements) = every rank's `inp`, rank order, concatenated flat."""
    n = group_size(group)
    _note("all_gather", tag, out, n)
    with record_function("tp_comm:all_gather"):
        work = _all_gather_single(out, inp, group=group, async_op=async_op)
    return _ProfiledWork(work) if async_op else None


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, tag: str = ACTIVATION, async_op: bool = False):
    """`out` = this rank's 1/n slice (along dim 0) of the sum over ranks of `inp`."""
    n = group_size(group)
    _note("reduce_scatter", tag, inp, n)
    with record_function("tp_comm:reduce_scatter"):
        work = _reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return _ProfiledWork(work) if async_op else None


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
