"""The GPU timeline of one profiled training step: which records are GPU work, how busy the GPU
was, and where it sat idle.

GPU accounting comes from the profiler's kernel records (``kernel_records``), not its per-name
averages: those also hold the GPU user annotations that ``record_function`` scopes leave on the GPU
timeline (``Optimizer.step#AdamW.step`` spans every optimizer kernel), which the first checks
summed with the kernels and so reported a GPU busy 120-128% of the step. ``gpu_busy_s`` is the
union of the kernel intervals (at most the step), ``gpu_kernel_sum_s`` their sum; the two differ
only where kernels of different streams overlap, which ``streams`` shows.

``gap_profile`` says where the rest of the step went: the idle gaps between busy stretches, by
length, and the longest with the kernels on either side. The eager steps of 2026-11-27 seemed to
leave the GPU idle 11-34 ms a step although the host had issued every op long before: their records
lacked every kernel named after a lambda (``annotation_name``), so most of that "idle" was GPU work
not counted. The gaps' places tell a launch gap from a wait on the host or a synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.gpucheck.kernels import _category

GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class KernelRecord:
    name: str
    start_ns: int
    end_ns: int
    stream: int


def kernel_records(events) -> list[KernelRecord]:
    """The GPU work among the profiler's kineto events (``prof.profiler.kineto_results.events()``):
    kernels, copies and memsets, without GPU user annotations; one record per distinct
    (name, start, end, stream), so a record reported twice counts once."""
    seen: dict[tuple, KernelRecord] = {}
    for e in events:
        if e.device_type().name != "CUDA" or not _gpu_work(e):
            continue
        r = KernelRecord(
            e.name(), e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id()
        )
        seen.setdefault((r.name, r.start_ns, r.end_ns, r.stream), r)
    return list(seen.values())


def _gpu_work(e) -> bool:
    """A GPU event that is work, not an annotation. torch 2.11's events have neither
    ``activity_type`` nor (before 2.5) ``is_user_annotation``: then an annotation is known by its
    name (``annotation_name``)."""
    annotation = getattr(e, "is_user_annotation", None)
    if annotation is not None and annotation():
        return False
    activity = getattr(e, "activity_type", None)
    if activity is not None:
        return str(activity()).lower().split(".")[-1] in GPU_ACTIVITIES
    return not annotation_name(e.name())


def annotation_name(name: str) -> bool:
    """True for a ``record_function`` scope's name (``Optimizer.step#AdamW.step``,
    ``ProfilerStep#3``, ``## forward ##``), False for a kernel's. A '#' alone does not tell them
    apart: the profiler names a kernel built from a lambda by its demangled C++ name, '#' and all
    (``...direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const...``:
    every dtype cast, GELU, most reductions). The records of 2026-11-27 (RECORDS_VERSION 1) took
    '#' for an annotation and so dropped those kernels; a kernel's name has a space, '(', '<' or
    '::', a scope's none of them."""
    if name.startswith(("ProfilerStep", "## ")):
        return True
    return "#" in name and not any(mark in name for mark in (" ", "(", "<", "::"))


# the kernel records' version in a profile case (``stepprof``'s "kernel_records"): 1 (absent) the
# 2026-11-27 records, which dropped every kernel named after a lambda (``annotation_name``); 2 all
RECORDS_VERSION = 2


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def account(records: list[KernelRecord]) -> dict:
    """GPU seconds and launches per category, their sum, the busy union, and per-stream seconds."""
    by_cat: dict[str, float] = {}
    launches: dict[str, int] = {}
    streams: dict[str, float] = {}
    for r in records:
        cat = _category(r.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + (r.end_ns - r.start_ns) / 1e9
        launches[cat] = launches.get(cat, 0) + 1
        streams[str(r.stream)] = streams.get(str(r.stream), 0.0) + (r.end_ns - r.start_ns) / 1e9
    return {
        "gpu_s_by_category": by_cat,
        "kernels_by_category": launches,
        "kernels": sum(launches.values()),
        "gpu_kernel_sum_s": sum(by_cat.values()),
        "gpu_busy_s": union_ns([(r.start_ns, r.end_ns) for r in records]) / 1e9,
        "streams": streams,
    }


TOP_KERNELS = 25


def top_kernels(records: list[KernelRecord], top: int = TOP_KERNELS) -> dict:
    """The kernels that took the most GPU time, by name (trimmed to 160 characters): launches and
    seconds each, largest first. A category's total says how much; this says which kernels (the
    eager FP8 step's elementwise time is 1.3x what its casts' bytes price at membound's rate)."""
    by_name: dict[str, list] = {}
    for r in records:
        row = by_name.setdefault(r.name[:160], [0, 0.0])
        row[0] += 1
        row[1] += (r.end_ns - r.start_ns) / 1e9
    rows = sorted(by_name.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
    return {
        "top_kernels": [
            {"name": n, "category": _category(n), "launches": c, "s": s} for n, (c, s) in rows
        ]
    }


# gap lengths the histogram counts, in microseconds: < 2, 2-10, 10-50, 50-500, >= 500
GAP_EDGES_US = (2, 10, 50, 500)
LARGEST_GAPS = 10


def _gap_bin(gap_ns: int) -> str:
    us = gap_ns / 1e3
    lo = 0
    for edge in GAP_EDGES_US:
        if us < edge:
            return f"{lo}-{edge}us"
        lo = edge
    return f">={lo}us"


def gap_profile(records: list[KernelRecord], largest: int = LARGEST_GAPS) -> dict:
    """The idle gaps between the GPU's busy stretches (the union of the records' intervals, every
    stream), from the first record's start to the last one's end: their number and seconds, a
    histogram by length (``GAP_EDGES_US``; each bin's count and seconds), and the ``largest``
    gaps with the names of the record that ends before each and the one that starts after."""
    spans: list[list] = []  # [start, end, name ending the stretch last, name starting it]
    for r in sorted(records, key=lambda r: (r.start_ns, r.end_ns)):
        if spans and r.start_ns <= spans[-1][1]:
            if r.end_ns >= spans[-1][1]:
                spans[-1][1], spans[-1][2] = r.end_ns, r.name
        else:
            spans.append([r.start_ns, r.end_ns, r.name, r.name])
    gaps = [(b[0] - a[1], a[2], b[3]) for a, b in zip(spans, spans[1:])]
    bins: dict[str, dict] = {}
    for g, _, _ in gaps:
        row = bins.setdefault(_gap_bin(g), {"count": 0, "s": 0.0})
        row["count"] += 1
        row["s"] += g / 1e9
    top = sorted(gaps, key=lambda g: -g[0])[:largest]
    return {
        "gaps": len(gaps),
        "gap_s": sum(g for g, _, _ in gaps) / 1e9,
        "span_s": (spans[-1][1] - spans[0][0]) / 1e9 if spans else 0.0,
        "gap_bins": bins,
        "largest_gaps": [{"gap_s": g / 1e9, "after": a, "before": b} for g, a, b in top],
    }
