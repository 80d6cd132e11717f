"""How much other processes slowed our own while we measured, from the kernel's scheduler
statistics.

A timing on shared cores measures the load of the moment as much as the code. Linux keeps, per
thread, the time it ran on a CPU and the time it was ready to run but waited for one
(``/proc/<pid>/task/<tid>/schedstat``: "run-queue delay"). For CPU-bound work the **contention
factor** (cpu + wait) / cpu is how many times longer it took than on cores it had to itself;
sleeping (a rank waiting for a collective) counts in neither, so communication does not disturb it.

Both sum over the busy threads only (ready to run for a quarter of the interval, `delta`).

* `Contention` times a piece of work in this process: wall seconds and the factor, so
  ``wall / factor`` is what it would have taken without the wait (``dtrain.costmodel.gemm_probe``).
* `Sampler` (a thread) sums both times over the threads of our process tree (the capstone and the
  ranks it started) every `interval` s into a JSON-lines timeline, one object per sample:
  ``{"t": end time (time.time()), "dt": s, "cpu": s, "wait": s}``. `load_factor` gives the factor
  over a time window (a run's timed steps), its 10th-90th percentile over the samples, and divides
  out the oversubscription a run causes itself (more busy threads than cores), which the local
  checks count on their own. Nothing is spun or timed to learn it: sampling adds no load.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    t: float  # end of the interval, time.time()
    dt: float  # interval, s
    cpu: float  # s our threads ran
    wait: float  # s our threads were ready but waited for a CPU


@dataclass(frozen=True)
class LoadFactor:
    median: float  # over the window: (cpu + wait) / cpu of all samples together, / oversubscription
    low: float  # 10th percentile of the samples' factors
    high: float  # 90th percentile
    samples: int


def per_thread(pid: int | str = "self") -> dict[str, tuple[int, int]]:
    """{thread id: (ns on CPU, ns waiting for a CPU)} of one process ({} once it is gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran, waited, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[tid] = (int(ran), int(waited))
    return out


def thread_times(pid: int | str = "self") -> tuple[int, int]:
    """(ns on CPU, ns waiting for a CPU) summed over the threads of one process; (0, 0) once it
    is gone."""
    times = per_thread(pid).values()
    return sum(c for c, _ in times), sum(w for _, w in times)


BUSY = 0.25  # a thread counts when it ran or waited to run for this share of the interval


def delta(before: dict, after: dict, interval_ns: float, always=()) -> tuple[int, int]:
    """CPU and wait ns between two snapshots, summed over the threads that were busy: ready to
    run (on a CPU or waiting for one) for at least BUSY of the interval, plus `always`. Threads
    born in between count from zero. A thread that wakes now and then (a heartbeat, the sampler
    itself) waits for a CPU behind the busy ones at every wake-up: its short waits would inflate
    the factor of the work."""
    cpu = wait = 0
    for k, (c, w) in after.items():
        c0, w0 = before.get(k, (0, 0))
        if (c - c0) + (w - w0) >= BUSY * interval_ns or k in always:
            cpu, wait = cpu + max(c - c0, 0), wait + max(w - w0, 0)
    return cpu, wait


def available() -> bool:
    return thread_times()[0] > 0


def factor(cpu: float, wait: float) -> float:
    return (cpu + wait) / cpu if cpu > 0 else 1.0


class Contention:
    """Times one piece of work in this process: `with Contention() as c: work()`, then `c.wall` (s),
    `c.factor` and `c.idle` = wall / factor (1 where schedstat is missing)."""

    def __enter__(self) -> Contention:
        self._times = per_thread()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        me = str(threading.get_native_id())  # the thread that ran the work counts, however briefly
        self.factor = factor(*delta(self._times, per_thread(), self.wall * 1e9, always=(me,)))
        self.idle = self.wall / self.factor


def tree(root: int) -> list[int]:
    """`root` and every process below it, alive now."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(name)] = int(
                stat[stat.rfind(")") + 2 :].split()[1]
            )  # after "pid (comm) state"
    out = []
    for pid in parent:
        p, hops = pid, 0
        while p and p != root and hops < 64:
            p, hops = parent.get(p, 0), hops + 1
        if p == root:
            out.append(pid)
    return out


class Sampler:
    """Appends a `Sample` of our process tree to `path` every `interval` s until stopped (a
    context manager)."""

    def __init__(self, path: str | Path, interval: float = 0.25, root: int | None = None):
        self.path, self.interval, self.root = Path(path), interval, root or os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hostload", daemon=True)

    def __enter__(self) -> Sampler:
        if available():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _read(self) -> dict[tuple[int, str], tuple[int, int]]:
        return {(pid, tid): v for pid in tree(self.root) for tid, v in per_thread(pid).items()}

    def _loop(self) -> None:
        before, t = self._read(), time.time()
        with open(self.path, "a") as out:
            while not self._stop.wait(self.interval):
                now, t2 = self._read(), time.time()
                # a thread born in this interval counts from zero; one that ended loses its last
                # interval
                cpu, wait = delta(before, now, (t2 - t) * 1e9)
                out.write(
                    json.dumps(
                        {
                            "t": round(t2, 3),
                            "dt": round(t2 - t, 3),
                            "cpu": round(cpu / 1e9, 4),
                            "wait": round(wait / 1e9, 4),
                        }
                    )
                    + "\n"
                )
                out.flush()
                before, t = now, t2


def read(path: str | Path) -> list[Sample]:
    """The samples of a timeline file ([] when there is none; a torn line is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
            out.append(Sample(float(d["t"]), float(d["dt"]), float(d["cpu"]), float(d["wait"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def load_factor(
    samples: list[Sample], start: float, end: float, busy: float = 1.0, cores: int | None = None
) -> LoadFactor | None:
    """The contention factor over [start, end] of a job of `busy` CPU-bound threads on `cores`
    cores, its own oversubscription (busy / cores, at least 1) divided out; None when no sample
    with CPU work overlaps the window. When the job waited for CPUs (median above 1.05), the
    spread's top also allows for ranks that wait on each other: a rank whose peer was descheduled
    sleeps in the collective, which is no wait of its own, so the job can lose up to the cores it
    did not get, min(busy, cores) x time / cpu."""
    inside = [s for s in samples if s.t > start and s.t - s.dt < end and s.cpu > 0.02 * s.dt]
    if not inside:
        return None
    cores = cores or os.cpu_count() or 1
    over = max(busy / cores, 1.0)
    each = sorted(max(factor(s.cpu, s.wait) / over, 1.0) for s in inside)
    q = statistics.quantiles(each, n=10, method="inclusive") if len(each) > 1 else [each[0]] * 9
    cpu = sum(s.cpu for s in inside)
    total = max(factor(cpu, sum(s.wait for s in inside)) / over, 1.0)
    high = max(q[-1], total)
    if total > 1.05:
        high = max(high, min(busy, cores) * sum(s.dt for s in inside) / cpu)
    return LoadFactor(total, min(q[0], total), high, len(each))
