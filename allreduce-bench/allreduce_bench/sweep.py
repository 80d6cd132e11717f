"""The measurement loop: every link class x dtype x collective x size x mode, timed like nccl-tests.

Per case: warmup, then `iters` back-to-back ops between one world barrier and the end of the
last op (dtrain.model.timing.Stopwatch: CUDA events on GPU, wall clock on CPU), divided by `iters`.
Those per-rank times are reduced over ranks (SUM/MAX/MIN) into avg/min/max; bandwidths use the
average, as nccl-tests does by default. Then one fresh, checked execution counts wrong elements.
"""

from __future__ import annotations

import dataclasses

import math
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from allreduce_bench import alltoallv, busbw, collectives, groups
from allreduce_bench.spec import NCCL_TYPE_NAMES, BenchSpec, torch_dtype
from dtrain.core.errors import UserError
from dtrain.model.timing import Stopwatch, synchronize

_UNSUPPORTED = (
    "invalid scalar type",
    "unsupported",
    "not supported",
    "does not support",
    "cannot use reduceop",
    "can't be cast",
)


@contextmanager
def unsupported_as_user_error(collective: str, dtype: str, redop: str, backend: str):
    """A dtype/op the backend refuses is the user's to change: one line, not a traceback. Every
    rank refuses the same case before any data moves, so all ranks stop together."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if not any(p in first.lower() for p in _UNSUPPORTED):
            raise
        raise UserError(
            f"backend={backend} cannot run {collective} on dtype={dtype} with redop={redop} "
            f"({first[:120]}): use dtypes=[float32] or another redop"
        ) from None


def time_per_op(case: collectives.Case | None, warmup: int, iters: int, device) -> float:
    """Seconds per op on this rank; a rank outside the measured groups (case None) only joins the
    barrier."""
    if case is not None:
        for _ in range(warmup):
            case.run()
        synchronize(device)
    watch = Stopwatch(device, barrier=True)
    watch.start()
    if case is None:
        return 0.0
    for _ in range(iters):
        case.run()
    return watch.stop() / iters


def over_ranks(seconds: float, member: bool, wrong: int, device) -> tuple[float, float, float, int]:
    """(avg, min, max) of the members' per-op times, and the wrong elements summed over ranks."""
    dev = device if device.type == "cuda" else "cpu"
    total = torch.tensor(
        [seconds if member else 0.0, float(member), float(wrong)], dtype=torch.float64, device=dev
    )
    dist.all_reduce(total)
    extremes = torch.tensor(
        [seconds, -seconds] if member else [-math.inf, -math.inf], dtype=torch.float64, device=dev
    )
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    s, members, w = total.tolist()
    hi, neg_lo = extremes.tolist()
    return s / members, -neg_lo, hi, int(w)


def _progress(total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from dtrain.core.terminal import rich_progress

    return rich_progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        show=enabled,
        transient=True,
    )


def run(ctx, spec: BenchSpec, hosts: list[str]) -> dict:
    """All cases on all ranks; rank 0 writes one `collective` record per measured case.
    `hosts`: every rank's host, which decides the link classes (groups.plan)."""
    classes, not_measured = groups.plan(hosts)
    link_groups = groups.build(classes)
    for lg in link_groups:
        if any(c in busbw.ROOTED for c in spec.collectives) and spec.root >= lg.size:
            raise UserError(
                f"root={spec.root} is not a rank of the {lg.link_class} groups ({lg.size} ranks): "
                f"use root=0..{lg.size - 1}"
            )
    todo = [
        (lg, dt, c)
        for lg in link_groups
        for dt in spec.dtypes
        for c in spec.collectives
        if not (c == "sendrecv" and lg.size < 2)
    ]
    skipped = sorted(
        {
            f"sendrecv on {lg.link_class} (1 rank per group)"
            for lg in link_groups
            if "sendrecv" in spec.collectives and lg.size < 2
        }
    )
    wrong_cases = []
    with _progress(len(todo) * len(spec.sizes), ctx.is_main) as progress:
        task = progress.add_task("collectives", total=len(todo) * len(spec.sizes))
        for lg, dtype_name, collective in todo:
            dtype = torch_dtype(dtype_name)
            elem = torch.empty(0, dtype=dtype).element_size()
            for size in spec.sizes:
                lay = (
                    alltoallv.layout(size, elem, lg.size)
                    if collective == "all_to_all_v"
                    else busbw.layout(collective, size, elem, lg.size)
                )
                progress.update(
                    task, description=f"{lg.link_class} {collective} {dtype_name} {lay.nbytes} B"
                )
                for mode in spec.modes:
                    in_place = mode == "in_place"
                    if not busbw.supports(collective, in_place):
                        continue
                    member = lg.group is not None
                    with unsupported_as_user_error(collective, dtype_name, spec.redop, ctx.backend):
                        case = (
                            collectives.build(
                                collective,
                                lay,
                                dtype,
                                ctx.device,
                                lg.group,
                                spec.redop,
                                spec.root,
                                in_place,
                                spec.routing,
                            )
                            if member
                            else None
                        )
                        seconds = time_per_op(case, spec.timing_warmup, spec.iters, ctx.device)
                        corrupt = (
                            spec.inject_wrong in (collective, "all")
                            and member
                            and dist.get_rank(lg.group) == 0
                        )
                        wrong = (
                            collectives.check(case, lg.size, spec.redop, corrupt)
                            if member and spec.check
                            else 0
                        )
                    avg, lo, hi, wrong = over_ranks(seconds, member, wrong, ctx.device)
                    if wrong:
                        wrong_cases.append(
                            f"{collective} {lg.link_class} {dtype_name} {lay.nbytes} B {mode}: "
                            f"{wrong} wrong"
                        )
                    rooted = collective in busbw.ROOTED
                    bus_GBps = busbw.busbw_GBps(collective, lay.nbytes, avg, lg.size)
                    # TensorBoard: one curve per case, message size in bytes on the x axis
                    tag = f"busbw_GBps/{lg.link_class}/{collective}/{dtype_name}/{mode}"
                    ctx.writer.scalar(tag, bus_GBps, lay.nbytes)
                    ctx.writer.record(
                        "collective",
                        link_class=lg.link_class,
                        collective=collective,
                        mode=mode,
                        nbytes=lay.nbytes,
                        count=lay.count,
                        dtype=dtype_name,
                        type=NCCL_TYPE_NAMES[dtype_name],
                        redop=spec.redop if collective in busbw.REDUCING else "none",
                        root=spec.root if rooted else -1,
                        group_size=lg.size,
                        groups=lg.count,
                        bus_factor=busbw.bus_factor(collective, lg.size),
                        iters=spec.iters,
                        warmup=spec.timing_warmup,
                        time_us=avg * 1e6,
                        time_min_us=lo * 1e6,
                        time_max_us=hi * 1e6,
                        algbw_GBps=busbw.algbw_GBps(lay.nbytes, avg),
                        busbw_GBps=bus_GBps,
                        wrong=wrong if spec.check else None,
                    )
                progress.advance(task)
    if wrong_cases:  # records are written; no summary: the run is not a result
        raise RuntimeError(
            f"correctness check failed in {len(wrong_cases)} case(s): " + "; ".join(wrong_cases[:5])
        )
    if ctx.is_main and skipped:
        print("skipped: " + ", ".join(skipped), file=sys.stderr, flush=True)
    return {
        "num_hosts": len(set(hosts)),
        "simulated_nodes": spec.simulate_nodes,
        "link_classes": [
            {"link_class": lg.link_class, "group_size": lg.size, "groups": lg.count}
            for lg in link_groups
        ],
        "not_measured": not_measured,
        "skipped": skipped,
        **(
            {
                "alltoallv": {
                    **dataclasses.asdict(spec.routing),
                    "imbalance": {
                        lg.link_class: alltoallv.imbalance(
                            alltoallv.send_matrix(spec.routing, lg.size)
                        )
                        for lg in link_groups
                    },
                }
            }
            if "all_to_all_v" in spec.collectives
            else {}
        ),
    }
