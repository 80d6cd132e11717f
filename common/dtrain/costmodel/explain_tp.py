"""``dtrain plan --explain-tp``: the best plan against the best plan at TP 8, term by term, so a
plan that drops TP 8 (what tuned Megatron stacks run) says why: compute, the TP traffic left
exposed, the TP traffic hidden under the GEMMs (``tp_overlap``: TE's overlaps; AsyncTP's share),
what hiding it costs (the SMs the pipelined and bulk overlaps hold, the copies' HBM), the DP /
ZeRO traffic left exposed, the pipeline's bubble and transfers, and memory per GPU."""

from __future__ import annotations

from .hardware import GiB
from .search import Plan, SearchResult, search
from .timemodel import step_model
from .tp_overlap import TPOverlap

__all__ = ["EXPLAIN_TP", "tp_terms", "explain_tp_lines", "explain_tp", "explain_tp_json"]

EXPLAIN_TP = 8  # the TP degree tuned Megatron-class layouts run (one NVLink domain of 8 GPUs)

# (label, key) in print order; seconds per step but memory (GiB)
_ROWS = (
    ("compute", "compute"),
    ("TP comm exposed", "tp_exposed"),
    ("TP comm hidden", "tp_hidden"),
    ("TP overlap SM + HBM cost", "tp_cost"),
    ("DP/ZeRO comm exposed", "dp_exposed"),
    ("pipeline bubble + p2p", "pipeline"),
    ("step", "step"),
    ("memory per GPU (GiB)", "memory"),
)


def tp_split(res: SearchResult, plan: Plan) -> TPOverlap:
    """``plan``'s TP traffic split as ``StepModel.tp_overlap`` does; AsyncTP's hidden share is
    what it takes off the traffic."""
    steps = step_model(res.model, res.cluster, res.calib, res.precision, 2, res.stack)
    split = steps.tp_overlap(plan, plan.time.terms.gemm)
    if res.stack.async_tp:
        return TPOverlap(plan.time.tp_comm, split.exposed - plan.time.tp_comm)
    return split


def tp_terms(res: SearchResult, plan: Plan) -> dict[str, float]:
    """The terms of ``_ROWS`` for ``plan`` (seconds per step; memory in GiB)."""
    t = plan.time
    tp = tp_split(res, plan)
    return {
        "compute": t.compute + t.overhead,
        "tp_exposed": tp.exposed,
        "tp_hidden": tp.hidden,
        "tp_cost": tp.sm_cost + tp.copy_cost,
        "dp_exposed": t.dp_comm_exposed,
        "pipeline": t.bubble + t.pp_comm,
        "cp": t.cp_comm,
        "step": t.total,
        "memory": plan.memory.total / GiB,
    }


def explain_tp_lines(res: SearchResult, at_tp: Plan | None, tp: int = EXPLAIN_TP) -> list[str]:
    """The table (each line within 100 columns): best, best at ``tp``, and their difference; the
    terms that separate them, largest first."""
    best = res.best
    if best is None:
        return [f"explain-tp: no layout fits ({res.reason})"]
    if at_tp is None:
        return [f"explain-tp: no layout at tp={tp} fits or runs on this cluster and software"]
    a, b = tp_terms(res, best), tp_terms(res, at_tp)
    out = [
        f"explain-tp: the best plan against the best at tp={tp} (seconds per step; "
        f"{res.stack.describe()})",
        f"  best:      {best.describe()}",
        f"  tp={tp}:      {at_tp.describe()}",
        f"  {'term':<26}{'best':>12}{f'tp={tp}':>12}{'tp' + str(tp) + ' - best':>14}",
    ]
    for label, key in _ROWS:
        unit = "" if key == "memory" else " s"
        line = f"  {label:<26}{a[key]:>10.3f}{unit:2}{b[key]:>10.3f}{unit:2}"
        out.append(f"{line}{b[key] - a[key]:>+12.3f}{unit}")
    if a["cp"] or b["cp"]:
        out.append(f"  {'CP comm exposed':<26}{a['cp']:>10.3f} s{b['cp']:>10.3f} s")
    # what the step pays: the hidden traffic is shown, not paid (its cost is the row below it)
    terms = [(b[k] - a[k], label) for label, k in _ROWS if k not in ("step", "memory", "tp_hidden")]
    terms.sort(key=lambda x: -abs(x[0]))
    slower = b["step"] / a["step"] - 1
    said = ", ".join(f"{label} {d:+.3f} s" for d, label in terms[:3] if d)
    out.append(f"  tp={tp} is {slower:+.1%} per step; what separates them: {said or 'nothing'}")
    if not res.stack.tp_overlap and not res.stack.async_tp:
        out.append(
            "  no TP overlap priced: --tp-overlap (TransformerEngine's userbuffers) hides TP "
            "traffic under the GEMMs"
        )
    return out


def explain_tp(res: SearchResult, tp: int = EXPLAIN_TP) -> tuple[list[str], Plan | None]:
    """(``explain_tp_lines``, the best plan at ``tp``): searches again with tp pinned."""
    if res.best is None or res.best.tp == tp:
        at = res.best
    else:
        at = search(
            res.model,
            res.cluster,
            res.global_batch,
            res.calib,
            precision=res.precision,
            headroom=res.headroom,
            stack=res.stack,
            prune=True,
            fixed={"tp": tp},
        ).best
    return explain_tp_lines(res, at, tp), at


def explain_tp_json(res: SearchResult, tp: int = EXPLAIN_TP) -> dict:
    """``explain_tp`` for ``--json``: each plan's layout and terms (``tp_terms``)."""
    _, at = explain_tp(res, tp)
    return {
        "tp": tp,
        "best": None
        if res.best is None
        else {"layout": res.best.describe(), **tp_terms(res, res.best)},
        "at_tp": None if at is None else {"layout": at.describe(), **tp_terms(res, at)},
    }
