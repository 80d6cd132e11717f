"""How much communication hides behind compute: interval arithmetic over a profiler trace.

A trace is reduced to (start, end, kind) intervals, kind "comm" or "compute". Both kinds are first
merged into disjoint unions (nested or concurrent events must not count twice), then

    comm_s          = |U_comm|                 time some collective was in flight
    overlapped_s    = |U_comm ∩ U_compute|     ... while compute was also running
    exposed_comm_s  = comm_s - overlapped_s    ... while nothing else ran: the cost data parallelism
                                               adds
    overlap_fraction = overlapped_s / comm_s   (None when there was no communication)

`intervals_from_trace` picks the intervals out of a Chrome trace exported by torch.profiler:
  GPU   comm = kernels whose name contains "nccl"; compute = every other kernel.
  CPU   comm = gloo's "gloo:*" ranges (gloo runs collectives on worker threads); compute = aten ops
        on the training thread (the union of nested ops is the time the thread computed; time it
        spent blocked in work.wait() is in no aten op).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Disjoint, sorted union of [start, end) intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two disjoint sorted unions (two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_stats(intervals: Iterable[tuple[float, float, str]], steps: int = 1) -> dict:
    """comm / overlapped / exposed seconds per step (inputs in seconds) and the overlap fraction."""
    intervals = list(intervals)
    unknown = {k for _, _, k in intervals} - {"comm", "compute"}
    if unknown:
        raise ValueError(f"interval kinds must be 'comm' or 'compute', got {sorted(unknown)}")
    comm = merge((s, e) for s, e, k in intervals if k == "comm")
    compute = merge((s, e) for s, e, k in intervals if k == "compute")
    comm_s, overlapped_s = total(comm), total(intersect(comm, compute))
    return {
        "comm_s": comm_s / steps,
        "compute_s": total(compute) / steps,
        "overlapped_s": overlapped_s / steps,
        "exposed_comm_s": (comm_s - overlapped_s) / steps,
        "overlap_fraction": overlapped_s / comm_s if comm_s > 0 else None,
    }


_NOT_COMPUTE = (
    "c10d::",
    "record_param_comms",
    "wait",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "allreduce",
    "all_reduce",
    "broadcast",
    "barrier",
    "gloo:",
)


def intervals_from_trace(
    trace: dict, main_tid: int | None = None
) -> list[tuple[float, float, str]]:
    """(start_s, end_s, kind) from a Chrome trace; main_tid = the training thread (CPU compute)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out = []
    if kernels:  # GPU run: the device timeline is the truth
        for e in kernels:
            s = e["ts"] / 1e6
            out.append(
                (s, s + e["dur"] / 1e6, "comm" if "nccl" in e["name"].lower() else "compute")
            )
        return out
    for e in events:
        name, s = e["name"], e["ts"] / 1e6
        if name.startswith("gloo:"):
            out.append((s, s + e["dur"] / 1e6, "comm"))
        elif (
            e.get("cat") == "cpu_op"
            and name.startswith("aten::")
            and (main_tid is None or e.get("tid") == main_tid)
            and not any(w in name.lower() for w in _NOT_COMPUTE)
        ):
            out.append((s, s + e["dur"] / 1e6, "compute"))
    return out


def read_trace(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


_P2P = ("gloo:send", "gloo:recv", "c10d::send", "c10d::recv", "nccl:send", "nccl:recv")


def step_breakdown(trace: dict, main_tid: int | None, steps: int = 1) -> dict:
    """Where one step's time goes on this rank (CPU traces; seconds per step):

        compute_s      main-thread aten ops (as in intervals_from_trace)
        tp_comm_s      the hand-rolled TP collectives' `tp_comm:*` ranges (blocking: all exposed)
        cp_comm_s      context parallelism's `cp_comm:*` ranges (issuing the ring's sends, waiting
                       for them, the all-to-alls): what the attention compute did not hide
        ep_comm_s      expert parallelism's `ep_comm:*` ranges (the token counts, the dispatch and
                       combine all-to-alls, forward and backward: blocking, all exposed)
        pp_p2p_s       pipeline send/recv issued on the main thread (with cp: the ring's, in
                       cp_comm_s)
        dp_comm_s      every other collective (gradient sync, loss and norm reductions) while no
                       TP collective was in flight, and its part not hidden behind compute
        dp_comm_exposed_s
        idle_s         the rest of the step: with pp, the pipeline bubble (waiting for other
                       stages); without, optimizer bookkeeping and Python
    Step time is the main thread's span over the profiled steps."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    span = lambda e: (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)  # noqa: E731
    main = [e for e in events if main_tid is None or e.get("tid") == main_tid]
    if not main:
        return {}
    compute = merge((s, e) for s, e, k in intervals_from_trace(trace, main_tid) if k == "compute")
    tp = merge(span(e) for e in main if e["name"].startswith("tp_comm:"))
    cp = merge(span(e) for e in main if e["name"].startswith("cp_comm:"))
    ep = merge(span(e) for e in main if e["name"].startswith("ep_comm:"))
    p2p = merge(span(e) for e in main if e["name"].startswith(_P2P))
    # the trainer runs cp only without pp: every send/recv is the ring's (some outlast their cp
    # range)
    if cp:
        cp, p2p = merge([*cp, *p2p]), []
    other_comm = merge(
        span(e) for e in events if e["name"].startswith("gloo:") and not e["name"].startswith(_P2P)
    )
    tp_total = total(tp)
    dp = merge(iv for iv in _subtract(other_comm, merge([*tp, *cp, *ep])))
    dp_exposed = _subtract(dp, compute)
    start, end = min(e["ts"] for e in main) / 1e6, max(e["ts"] + e["dur"] for e in main) / 1e6
    busy = total(merge([*compute, *tp, *cp, *ep, *p2p, *dp_exposed]))
    return {
        "step_s": (end - start) / steps,
        "compute_s": total(compute) / steps,
        "tp_comm_s": tp_total / steps,
        "cp_comm_s": total(cp) / steps,
        "ep_comm_s": total(ep) / steps,
        "pp_p2p_s": total(p2p) / steps,
        "dp_comm_s": total(dp) / steps,
        "dp_comm_exposed_s": total(dp_exposed) / steps,
        "idle_s": max(0.0, end - start - busy) / steps,
    }


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b, both disjoint sorted unions."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out
