"""What `dtrain plan` prints as text: the choice and its step term by term (compute, throughput,
memory, the eager stack's dispatch floor), the backtest's error band around it, why the
runners-up lost, a given layout against it and what ``--software`` costs."""

from __future__ import annotations

from .explain import runners_up, explain
from .hardware import GiB
from .plan_flops import flops
from .plan_header import batch_text, describe_cluster, describe_model, describe_power
from .plan_wrap import wrapped
from .search import SearchResult
from .token_flops import EXECUTED_CONVENTION, FLOP_CONVENTION
from .uncertainty import PLAN_BAND, ErrorBand


def text_report(
    res: SearchResult,
    top: int,
    notes: list[str],
    runs: list[str] = (),
    band: ErrorBand = PLAN_BAND,
) -> list[str]:
    """The report; ``runs``: what dtrain's trainer does with the choice (``runnable_text``);
    ``band``: the backtest's error band the ties and the memory risk are judged by."""
    out = [
        f"model:    {describe_model(res.model)}",
        f"cluster:  {describe_cluster(res.cluster)}",
        *([f"power:    {power}"] if (power := describe_power(res.cluster)) else []),
        f"batch:    {batch_text(res)}, {res.precision}",
        f"stack:    {res.stack.describe()} (--attention, --kernels, --loss, --tp-overlap, "
        "--async-tp, --fp8-all-gather, --grad-reduce, --optimizer-states, --dp-sync: the run's "
        "software moves the cost; --software: the layouts it runs)",
        *notes,
        "",
    ]
    if res.best is None:
        return out + [res.reason]
    out += [f"choice:   {res.best.describe()}", *plan_lines(res.best, res_usable(res), res)]
    out += uncertainty_lines(res, top, band) + list(runs)
    why = explain(res, top, band.time)[1:]
    return out + (["", "why the runners-up lost:"] + [f"  - {line}" for line in why] if why else [])


def uncertainty_lines(res: SearchResult, top: int, band: ErrorBand = PLAN_BAND) -> list[str]:
    """The choice against the backtest's error band: runners-up it cannot tell from the best (a
    tie), and memory within the memory check's band of the HBM (may run out of memory)."""
    best, out = res.best, []
    ties = [
        p for p in runners_up(res, top) if band.tie(best.time.tokens_per_s, p.time.tokens_per_s)
    ]
    if ties:
        out.append(
            f"  tie         {len(ties)} runner-up(s) within {band.time_text()}: measure them"
        )
    hbm = res.cluster.gpu.hbm_bytes
    if band.memory_risk(best.memory.total, hbm):
        out.append(
            f"  memory risk at the memory check's {band.memory_low:+.0%} (vs reported peaks) "
            f"the peak is {band.memory_worst(best.memory.total) / GiB:.0f} GiB > "
            f"{hbm / GiB:g} GiB HBM"
        )
    return out


def res_usable(res: SearchResult) -> float:
    return res.cluster.gpu.hbm_bytes * (1 - res.headroom) / GiB


def flops_lines(res: SearchResult, p) -> list[str]:
    """Throughput, model TFLOP/s and MFU with their convention named, and beside them the TFLOP/s
    the kernels execute against the measured GEMM peak."""
    t, f = p.time, flops(res, p)
    return wrapped(
        "  throughput  ",
        f"{t.tokens_per_s:,.0f} tokens/s; {t.tflops_per_gpu:.0f} TFLOP/s per GPU of model FLOPs, "
        f"MFU {t.mfu:.1%} ({FLOP_CONVENTION}); executed {f['executed_tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU ({EXECUTED_CONVENTION}, recompute={p.recompute}); measured GEMM peak "
        f"{f['gemm_peak_tflops']:.0f} TFLOP/s ({f['peak_tflops']:.0f} dense x e_max "
        f"{f['gemm_e_max']:.2f})",
    )


def memory_parts(t) -> str:
    """The memory-bound passes a step time names apart (``StepTime.grad_accum``,
    ``fsdp_copy_out``), as the compute line's "(of it ...)"."""
    parts = [
        f"{name} {s:.3f}"
        for name, s in (
            ("gradient accumulation", t.grad_accum),
            ("FSDP2 copy-out", t.fsdp_copy_out),
        )
        if s
    ]
    return f" (of it {', '.join(parts)})" if parts else ""


def plan_lines(p, usable_gib: float, res: SearchResult | None = None) -> list[str]:
    """The step breakdown, throughput and memory of one plan (``res``: its search, for the FLOP
    rates)."""
    t, m = p.time, p.memory
    c = t.terms
    return [
        f"  step time   {t.total:.3f} s = compute {t.compute:.3f} + TP comm {t.tp_comm:.3f} + PP "
        f"comm {t.pp_comm:.3f} + bubble {t.bubble:.3f} + exposed DP comm {t.dp_comm_exposed:.3f} "
        f"(of {t.dp_comm:.3f}"
        + (
            f"; {t.dp_contention:.3f} of it the SMs and HBM the overlapped part takes"
            if t.dp_contention
            else ""
        )
        + ")"
        + (f" + fixed overhead {t.overhead:.3f}" if t.overhead else "")
        + ("; launch-bound: the dispatch floor below, not this sum" if t.launch_bound else ""),
        f"  compute     {t.compute:.3f} s = GEMMs {c.gemm:.3f} + attention {c.attention:.3f} + "
        f"memory-bound {c.memory:.3f}"
        + memory_parts(t)
        + f" + output layer & loss {c.head:.3f} + recompute "
        f"{c.recompute:.3f} + optimizer {c.optimizer:.3f} (busiest GPU; costmodel/compute.py)",
        *(
            flops_lines(res, p)
            if res is not None
            else [
                f"  throughput  {t.tokens_per_s:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per "
                f"GPU (model FLOPs), MFU {t.mfu:.1%}"
            ]
        ),
        f"  memory/GPU  {m.total / GiB:.1f} GiB of {usable_gib:.1f} GiB usable: params "
        f"{m.params / GiB:.1f}, grads {m.grads / GiB:.1f}, optimizer {m.optimizer / GiB:.1f}, "
        f"activations {m.activations / GiB:.1f}, ZeRO-3 buffers {m.buffers / GiB:.1f}",
        *eager_lines(t, res.stack if res is not None else None),
    ]


def eager_lines(t, stack=None) -> list[str]:
    """The eager stack's launch terms (costmodel/eager.py): its dispatch floor and optimizer."""
    if not t.kernels:
        return []
    opt = (stack.optimizer if stack is not None else None) or "foreach"
    bound = (
        "launch-bound: the host, not the GPU, sets the step"
        if t.launch_bound
        else (f"GPU-bound: the GPU's work is {t.total / t.dispatch_floor:.1f}x the floor")
    )
    return [
        f"  dispatch    floor {t.dispatch_floor:.3f} s = {t.kernels:,} kernel launches (+ FSDP2's "
        f"hooks) x the host's issue time per launch (costmodel/eager.yaml); {bound}",
        f"  optimizer   {opt} AdamW + gradient clipping {t.terms.optimizer:.3f} s over the rank's "
        "shard (costmodel/eager.py)",
    ]


def layout_text(
    res: SearchResult, gap: float | None, spec: str, usable_gib: float, tight: bool = False
) -> list[str]:
    head = f'your layout "{spec}"'
    if res.best is None:
        return [f"{head}: {res.reason}"]
    out = [f"{head}: best completion {res.best.describe()}", *plan_lines(res.best, usable_gib, res)]
    if tight:
        out.append(
            "  caution     fits only in the HBM that --headroom keeps free when choosing: it runs "
            "by this count, with little margin for allocator fragmentation"
        )
    if gap is not None:
        sw = res.stack.software
        best = "the unconstrained best" if sw == "any" else f"the best layout {sw} runs"
        out.append(
            f"  vs best     {gap:.1f}% slower than {best}"
            + (f" (a tie: within {PLAN_BAND.time_text()})" if gap / 100 <= PLAN_BAND.time else "")
            if gap > 0.05
            else f"  vs best     this is {best} (within 0.05%)"
        )
    return out


def framework_gap(res: SearchResult, free: SearchResult) -> float | None:
    """How much faster (%) the best layout of every framework ("any") is than the best of
    ``res``'s software."""
    if res.best is None or free.best is None:
        return None
    return 100 * (free.best.time.tokens_per_s / res.best.time.tokens_per_s - 1)


def framework_text(res: SearchResult, free: SearchResult) -> list[str]:
    """One line: what the framework's restriction costs against the unrestricted search
    (``--software``)."""
    gap, sw = framework_gap(res, free), res.stack.software
    if gap is None:
        return (
            []
            if free.best is None
            else [
                f"framework: no layout {sw} runs fits; the best of any framework is "
                f"{free.best.describe()}"
            ]
        )
    if gap <= 0.05:
        return [f"framework: {sw}'s best is the best of any framework (within 0.05%)"]
    return [
        f"framework: the best layout of any framework, {free.best.describe()}, is {gap:.1f}% "
        f"faster than {sw}'s best ({len(res.ranked)} of its layouts fit)"
    ]
