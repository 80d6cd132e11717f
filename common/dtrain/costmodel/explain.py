"""Why ``search`` chose its best plan, in sentences (``dtrain plan`` prints them): why each
runner-up lost, the best plan without context parallelism when the best uses it, and which faster
designs do not fit."""

from __future__ import annotations

from .collectives import group_link
from .hardware import GiB, Cluster
from .stack_memory import memory_for
from .search import Plan, SearchResult, describe_layout
from .timemodel import step_time


def _ms(seconds: float) -> str:
    if seconds == 0:
        return "0 ms/step"
    return f"{seconds * 1e3:.0f} ms/step" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms/step"


def _why_slower(p: Plan, best: Plan, cluster: Cluster) -> str:
    """One clause naming the step-time component that grew most against ``best``."""
    a, b = p.time, best.time
    deltas = {
        k: getattr(a, k) - getattr(b, k)
        for k in ("compute", "dp_comm_exposed", "tp_comm", "cp_comm", "pp_comm", "bubble")
    }
    part = max(deltas, key=deltas.get)
    if part == "cp_comm":
        how = {"ulysses": "all-to-alls", "torch": "K/V all-gathers not hidden by attention"}.get(
            p.cp_impl, "ring sends not hidden by attention"
        )
        return f"cp={p.cp}: context-parallel {how} cost {_ms(a.cp_comm)} vs {_ms(b.cp_comm)}"
    if part == "tp_comm":
        if p.tp > cluster.node_size:
            return (
                f"tp={p.tp} crosses nodes: TP all-reduce over IB costs {_ms(a.tp_comm)} "
                f"vs {_ms(b.tp_comm)}"
            )
        return f"tp={p.tp}: TP all-reduces cost {_ms(a.tp_comm)} vs {_ms(b.tp_comm)}"
    if part == "bubble":
        frac = (p.pp - 1) / (p.virtual_stages * p.grad_accum)
        return (
            f"pp={p.pp}: pipeline bubble (p-1)/(v*m) = {frac:.1%} costs {_ms(a.bubble)} "
            f"vs {_ms(b.bubble)}"
        )
    if part == "pp_comm":
        return f"pp={p.pp}: stage-to-stage sends cost {_ms(a.pp_comm)} vs {_ms(b.pp_comm)}"
    if part == "dp_comm_exposed":
        link = group_link(cluster, p.dp, p.tp).name or "link"
        return (
            f"ZeRO-{p.zero_stage} over dp={p.dp} ({link}) exposes {_ms(a.dp_comm_exposed)} of DP "
            f"traffic vs {_ms(b.dp_comm_exposed)}"
        )
    if p.recompute != best.recompute:
        return f"recompute={p.recompute} adds {_ms(deltas['compute'])} of re-run forward"
    return f"compute costs {_ms(deltas['compute'])} more"


def explain(result: SearchResult, k: int = 5, tie: float | None = None) -> list[str]:
    """Sentences: the best plan; why each of the next ``k`` distinct designs (tp, pp, ZeRO stage,
    recompute) lost; and which designs would have been faster but do not fit in memory. ``tie``:
    a runner-up at most this share slower is called a tie with the best (the model's error)."""
    if result.best is None:
        return [result.reason]
    best = result.best
    out = [
        f"best: {best.describe()}: {best.time.tokens_per_s:,.0f} tokens/s, MFU "
        f"{best.time.mfu:.1%}, {best.memory.total / GiB:.1f} GiB/GPU"
    ]
    for p in runners_up(result, k):
        loss = 1 - p.time.tokens_per_s / best.time.tokens_per_s
        mark = f"a tie within the model's error ({tie:.1%}); " if tie and loss <= tie else ""
        out.append(
            f"{p.describe()}: {loss:.1%} slower; {mark}{_why_slower(p, best, result.cluster)}"
        )
    return out + _without_cp(result) + _faster_but_too_big(result, k)


def _without_cp(result: SearchResult) -> list[str]:
    """Why context parallelism, when the best plan uses it: the best plan without it, or why none
    fits."""
    best = result.best
    if best.cp <= 1:
        return []
    s = result.model.seq_len
    plain = next((p for p in result.ranked if p.cp == 1), None)
    if plain is not None:
        loss = 1 - plain.time.tokens_per_s / best.time.tokens_per_s
        return [
            f"cp={best.cp} splits each {s:,}-token sequence over {best.cp} GPUs ({s // best.cp:,} "
            f"tokens each): without context parallelism the best plan, {plain.describe()}, is "
            f"{loss:.1%} slower ({_why_slower(plain, best, result.cluster)})"
        ]
    need = [
        (str(w), lay)
        for lay, w in result.rejected_with_reasons
        if lay.cp == 1 and str(w).startswith("does not")
    ]
    smallest = min(
        need, key=lambda x: float(x[0].split("needs ")[1].split(" GiB")[0]), default=None
    )
    why = (
        f": the smallest ({describe_layout(smallest[1])}) {smallest[0][len('does not fit: ') :]}"
        if smallest
        else ""
    )
    return [
        f"cp={best.cp} splits each {s:,}-token sequence over {best.cp} GPUs ({s // best.cp:,} "
        f"tokens each, activations / {best.cp}): without context parallelism no layout fits in "
        f"memory{why}"
    ]


def runners_up(result: SearchResult, k: int) -> list[Plan]:
    """The fastest plan of each next design; a design that only trades memory at equal speed
    (ZeRO-0 vs ZeRO-1, same tp/pp/recompute) is not listed twice."""
    if k <= 0:  # --top 0: the choice alone
        return []
    best = result.ranked[0]
    seen = {(best.tp, best.pp, best.zero_stage, best.recompute)}
    speeds = {(best.tp, best.pp, best.recompute, best.time.tokens_per_s)}
    out = []
    for p in result.ranked[1:]:
        design = (p.tp, p.pp, p.zero_stage, p.recompute)
        speed = (p.tp, p.pp, p.recompute, p.time.tokens_per_s)
        if design not in seen and speed not in speeds:
            out.append(p)
            if len(out) == k:
                break
        seen.add(design)
        speeds.add(speed)
    return out


def _faster_but_too_big(result: SearchResult, k: int) -> list[str]:
    """Designs (tp, pp, recompute) whose memory-rejected variants would beat the best, with the
    smallest memory among those faster variants."""
    target = result.best.time.tokens_per_s
    act = result.calib.fp8_memory_factor.value if result.precision == "fp8" else 1.0
    groups: dict[tuple, list] = {}  # design -> [max tokens/s, min bytes, smallest layout]
    for lay, why in result.rejected_with_reasons:
        if not why.startswith("does not fit"):
            continue
        tps = step_time(
            result.model, lay, result.cluster, result.calib, result.precision, stack=result.stack
        ).tokens_per_s
        if tps <= target:
            continue
        need = memory_for(result.model, lay, result.stack, act, result.precision).total
        g = groups.setdefault((lay.cp, lay.tp, lay.pp, lay.recompute), [0.0, float("inf"), lay])
        g[0] = max(g[0], tps)
        if need < g[1]:
            g[1:] = [need, lay]
    usable = result.cluster.gpu.hbm_bytes * (1 - result.headroom) / GiB
    return [
        f"dp={lay.dp}{f' cp={lay.cp}' * (lay.cp > 1)} tp={lay.tp} pp={lay.pp} "
        f"recompute={lay.recompute} would be up to {tps / target - 1:.1%} faster but does not "
        f"fit: the smallest faster variant ({describe_layout(lay)}) needs {need / GiB:.1f} GiB > "
        f"{usable:.1f} GiB usable"
        for tps, need, lay in sorted(groups.values(), key=lambda g: -g[0])[:k]
    ]
