"""Per-tensor FP8 scale factors: current scaling and delayed scaling (TransformerEngine's formulas).

    scale = (fmt.max / amax) / 2**margin

Current scaling uses the tensor's own amax (one extra reduction before every cast, always in
range). Delayed scaling uses an amax *history* of the previous steps (max or most recent), so
the cast needs no reduction first; a tensor that suddenly grows past its history overflows
(E5M2) or saturates (E4M3) until the history catches up. An amax of 0 or a non-finite amax keeps
the previous scale, as TE does, so one bad step cannot poison the scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dtrain.train import Callback
from fp8_train.formats import Format

AMAX_ALGOS = ("max", "most_recent")


def scale_from_amax(
    amax: torch.Tensor | float, fmt: Format, margin: int = 0, previous: torch.Tensor | float = 1.0
) -> torch.Tensor:
    amax = torch.as_tensor(amax, dtype=torch.float32)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    scale = (fmt.max / amax) / (2.0**margin)
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(usable, scale, previous)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)


class CurrentScaler(nn.Module):
    """scale = f(amax of the tensor being cast). Keeps the last scale only for logging."""

    kind = "current"

    def __init__(self, fmt: Format, margin: int = 0):
        super().__init__()
        self.fmt, self.margin = fmt, margin
        self.register_buffer("scale", torch.ones(()), persistent=True)
        self.register_buffer("last_amax", torch.zeros(()), persistent=True)

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        amax = amax_of(x)
        self.last_amax.copy_(amax)
        self.scale.copy_(scale_from_amax(amax, self.fmt, self.margin, self.scale))
        return self.scale.clone()


class DelayedScaler(nn.Module):
    """scale = f(max (or most recent) of the last `history_len` amaxes, margin).

    `scale_for(x)` returns the scale computed from the history *before* x, then records x's amax:
    the step-t cast uses what steps < t saw. The history is a buffer, so checkpoints keep it."""

    kind = "delayed"
    # Ranks see different activations and gradients; TE reduces the amaxes over the data-parallel
    # group so every rank keeps the same history and scale. Without it a DCP checkpoint (which saves
    # one rank's copy of a replicated buffer, whichever its planner picks) resumes the others off
    # course. With a group, amaxes wait in `pending` for AmaxReduction's one all-reduce at the
    # step's end.
    amax_group = None

    def __init__(self, fmt: Format, margin: int = 0, history_len: int = 16, algo: str = "max"):
        super().__init__()
        if algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo={algo!r} is not one of {AMAX_ALGOS}")
        if history_len < 1:
            raise ValueError(f"amax_history_len={history_len} must be >= 1")
        self.fmt, self.margin, self.algo = fmt, margin, algo
        self.register_buffer("amax_history", torch.zeros(history_len), persistent=True)
        self.register_buffer("scale", torch.ones(()), persistent=True)
        self.register_buffer("last_amax", torch.zeros(()), persistent=True)
        self.pending: list[torch.Tensor] = []

    def history_amax(self) -> torch.Tensor:
        if self.algo == "most_recent":
            return self.amax_history[0]
        return self.amax_history.max()

    def record(self, amax: torch.Tensor) -> None:
        """Push one amax (newest first) and recompute the scale for the next cast."""
        if self.amax_group is not None:
            self.pending.append(amax.detach().float().reshape(()))
            return
        self.push(amax)

    def push(self, amax: torch.Tensor) -> None:
        self.last_amax.copy_(amax)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = amax
        self.scale.copy_(scale_from_amax(self.history_amax(), self.fmt, self.margin, self.scale))

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.clone()
        self.record(amax_of(x))
        self.last_used = scale  # what this cast used (the debug tool reads it instead of tracking)
        return scale


class AmaxReduction(Callback):
    """A Trainer callback: at each step's end (before any checkpoint), one all-reduce (max) over
    `group` of every amax the step recorded, then each DelayedScaler's history and scale; as TE's
    delayed scaling does over the data-parallel group. With one micro-batch per step each scaler
    records once per step, so the numerics equal a reduction at every cast."""

    def __init__(self, model: nn.Module, group):
        super().__init__()
        self.group = group
        self.scalers = [m for m in model.modules() if isinstance(m, DelayedScaler)]
        for m in self.scalers:
            m.amax_group = group

    def on_step_end(self, trainer, step, metrics) -> None:
        if not self.scalers:
            return
        amax = torch.stack(
            [torch.stack(m.pending).max() if m.pending else torch.zeros(()) for m in self.scalers]
        )
        seen = torch.tensor([1.0 if m.pending else 0.0 for m in self.scalers])
        both = torch.cat([amax, seen]).to(self.scalers[0].scale.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)  # "seen" by max: by any rank
        for m, a, s in zip(self.scalers, both[: len(self.scalers)], both[len(self.scalers) :]):
            m.pending.clear()
            if s > 0:
                m.push(a)


def make_scaler(
    kind: str, fmt: Format, margin: int = 0, history_len: int = 16, algo: str = "max"
) -> nn.Module:
    if kind == "current":
        return CurrentScaler(fmt, margin)
    if kind == "delayed":
        return DelayedScaler(fmt, margin, history_len, algo)
    raise ValueError(f"unknown scaling {kind!r}: expected 'delayed' or 'current'")
