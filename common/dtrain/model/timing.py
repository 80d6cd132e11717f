"""Timing that means the same thing on CPU and GPU.

GPU: CUDA events around each iteration (device time, no host-launch noise).
CPU: a barrier across ranks (when distributed) then the wall clock, so every rank measures the
same interval. Warmup iterations are run and discarded; statistics are over the rest.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class TimingStats:
    samples_s: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_s)

    @property
    def min(self) -> float:
        return min(self.samples_s)

    @property
    def max(self) -> float:
        return max(self.samples_s)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.samples_s)

    def to_dict(self) -> dict:
        return {
            "median_s": self.median,
            "mean_s": self.mean,
            "min_s": self.min,
            "max_s": self.max,
            "std_s": self.std,
            "iters": len(self.samples_s),
        }


def synchronize(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """start()/stop() around a region; stop() returns seconds (synchronizing on GPU).

    `barrier`: True = barrier over all ranks before each start; a ProcessGroup = over its ranks
    only (a tensor-parallel group timing while the other ranks wait)."""

    def __init__(self, device: torch.device | str | None = None, barrier=False):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device = device
        self.group = None if isinstance(barrier, bool) else barrier
        self.barrier = (
            barrier if isinstance(barrier, bool) else barrier is not None
        ) and dist.is_initialized()

    def start(self) -> None:
        if self.barrier:
            dist.barrier(group=self.group)
        if self.cuda:
            self._start, self._end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 10,
    device: torch.device | str | None = None,
    barrier=False,
) -> TimingStats:
    """Time `fn` per call: `warmup` discarded calls, then `iters` timed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    watch = Stopwatch(device, barrier)
    samples = []
    for _ in range(iters):
        watch.start()
        fn()
        samples.append(watch.stop())
    return TimingStats(samples)


def queued_s(
    fn: Callable[[], object], device: torch.device | str, target_s: float = 5e-3, repeats: int = 3
) -> float:
    """Seconds per call of ``fn`` launched back to back: CUDA events around R calls (R chosen so
    a timing lasts ~``target_s``), the median of ``repeats`` such timings over R. The time a
    kernel costs inside a training step, where the CPU has already queued the next one (timing
    each call alone adds the launch gap, 10-30 us)."""
    for _ in range(3):
        fn()
    one = time_fn(fn, warmup=0, iters=1, device=device).median
    reps = int(min(max(target_s / max(one, 1e-7), 3), 400))
    return (
        statistics.median(
            time_fn(
                lambda: [fn() for _ in range(reps)], warmup=0, iters=repeats, device=device
            ).samples_s
        )
        / reps
    )
