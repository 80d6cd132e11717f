"""Context parallelism's communication, counted and profiled (dtrain.parallel.comm_counter's
convention), and the volume it must add up to.

    ring_exchange(t, group, tag)          send t to the next rank of the ring, receive the previous
                                          rank's (async: returns an Exchange, wait() gives it)
    all_to_all(x, group, scatter, gather) Ulysses' swap (autograd: backward is the reverse swap)
    expected_wire_bytes(impl, ...)        what one attention layer's forward + backward must send
                                          (dtrain.parallel.traffic.cp_layer_wire_bytes, the formulas
                                          the cost model prices too; ulysses_kv_heads: GQA's k/v
                                          heads repeated for Ulysses, from there too)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain.parallel.comm_counter import ProfiledWork, group_size, note
from dtrain.parallel.traffic import cp_layer_wire_bytes as expected_wire_bytes  # noqa: F401
from dtrain.parallel.traffic import ulysses_kv_heads  # noqa: F401

KV, KV_GRAD, HEADS = (
    "kv",
    "kv_grad",
    "heads",
)  # ring: k/v blocks and their gradients; ulysses: all-to-alls
_P2P_TAGS = {KV: 11, KV_GRAD: 12}  # a k/v block and a gradient block may be in flight at once


def rank_in(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class Exchange:
    """An exchange in flight: wait() returns what the previous rank sent."""

    def __init__(self, work: ProfiledWork | None, sent: torch.Tensor, received: torch.Tensor):
        self.work, self.sent, self.received = work, sent, received  # `sent` stays alive until done

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.received


def ring_exchange(t: torch.Tensor, group, tag: str) -> Exchange:
    """Start sending `t` to rank r+1 of the ring while receiving rank r-1's tensor of the same
    shape."""
    n, r = group_size(group), rank_in(group)
    t = t.contiguous()
    received = torch.empty_like(t)
    note("send", tag, t, n)
    peer = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
    with record_function("cp_comm:send_recv"):
        ops = [
            dist.P2POp(dist.isend, t, peer((r + 1) % n), group, tag=_P2P_TAGS[tag]),
            dist.P2POp(dist.irecv, received, peer((r - 1) % n), group, tag=_P2P_TAGS[tag]),
        ]
        works = dist.batch_isend_irecv(ops)
    return Exchange(ProfiledWork(works, "cp_comm:wait"), t, received)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = group_size(group)
    send = torch.stack([c.contiguous() for c in x.chunk(n, scatter_dim)])  # piece i goes to rank i
    received = torch.empty_like(send)
    note("all_to_all", HEADS, send, n)
    with record_function("cp_comm:all_to_all"):
        dist.all_to_all_single(received, send, group=group)
    return torch.cat(
        list(received.unbind(0)), gather_dim
    )  # rank j's piece for this rank, j = 0, 1, ...


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad, group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut `x` in group-size pieces along `scatter_dim`, send piece i to rank i, and concatenate
    the pieces received along `gather_dim` in rank order."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)
