"""Every collective the hand-rolled parallelism (tp/, cp/, ep/) issues, counted; one byte rule.

tp/tp_collectives.py and cp/exchange.py reach torch.distributed only through wrappers that `note`
each call, so a `CommCounter` sees every byte, and each call is a `<tp|cp>_comm:<op>` profiler range
(the
benchmarks take the communication share of a step from those ranges).

Volume convention (`wire_bytes`) and every per-layer byte formula: dtrain.parallel.traffic, the
one home both these counters' checks and the cost model read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dtrain.parallel.traffic import wire_bytes


def group_size(group) -> int:
    """Ranks in `group`; 1 when torch.distributed is not initialised (a lone tp=1 module)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | all_to_all_v | send
    tag: str  # what the bytes are for (tp: activation | grad_sync; cp: kv | kv_grad | heads)
    payload_bytes: int  # the full (gathered / reduced) tensor; a send's or all-to-all's input
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


def note(op: str, tag: str, payload: torch.Tensor, n: int) -> None:
    """Record one call in every active CommCounter."""
    note_bytes(op, tag, payload.numel() * payload.element_size(), n)


def note_bytes(op: str, tag: str, payload_bytes: int, n: int) -> None:
    """Record one call of `payload_bytes` (all_to_all_v: the bytes that leave the rank)."""
    for counter in CommCounter._active:
        counter.calls.append(Collective(op, tag, payload_bytes, n))


class ProfiledWork:
    """An async handle whose wait() is a profiler range: the exposed part of an overlapped
    collective."""

    def __init__(self, work, name: str = "tp_comm:wait"):
        self.work, self.name = work, name

    def wait(self) -> None:
        with record_function(self.name):
            for w in self.work if isinstance(self.work, list) else [self.work]:
                w.wait()
