"""The guide's *Predicted vs measured (local runs)* section: the local checks' table, the verdict
over the judged rows (or why none could be made under this load, and the last valid one), and the
host they ran on."""

from __future__ import annotations

from dtrain.costmodel.calibrate import CalibrationReport

from .check import (
    GOAL,
    MAX_LOAD,
    MAX_LOAD_SPREAD,
    MIN_JUDGED_SHARE,
    VERDICT_FILE,
    Check,
    Verdict,
    verdict,
)
from .markdown import md_cell


def _host(report: CalibrationReport) -> str:
    envs = [r.env for r in report.runs if not str(r.env.get("device", "")).startswith("cuda")]
    if not envs:
        return ""
    e = envs[0]
    return (
        f" Host: {e.get('cpu_count', '?')} CPU cores shared by all ranks (and by other work on "
        f"the machine), torch {e.get('torch', '?')}, {e.get('backend', '?')}."
    )


def _distinct(checks: list[Check]) -> str:
    """How many distinct runs the rows check, and the copied run folders counted once."""
    runs = {c.run: c.copies for c in checks}
    copies = [p for c in runs.values() for p in c]
    named = ", ".join(f"`{p}`" for p in copies[:3])
    named += f" and {len(copies) - 3} more" if len(copies) > 3 else ""
    return f" The rows check {len(runs)} distinct run{'s' * (len(runs) != 1)}" + (
        f"; {len(copies)} more folder{'s' * (len(copies) != 1)} repeating a run's guide inputs "
        f"({named}) were counted once."
        if copies
        else "."
    )


def _verdict_line(checks: list[Check], stored: Verdict | None) -> str:
    """The bold verdict over the judged rows, or why there is none under this load and the last
    valid one (``stored``, with its date)."""
    v = verdict(checks)
    if v is not None:
        return f"Goal: within {GOAL:.0%}. **{v.text}.**"
    judged = sum(c.judged for c in checks)
    loads = sorted(c.load[0] for c in checks if c.load)
    seen = f" (load x{loads[0]:.1f}-{loads[-1]:.1f} during the runs)" if loads else ""
    last = (
        f"The last valid verdict, made on runs of {stored.date or 'an earlier date'} "
        f"({stored.results}): **{stored.text}.**"
        if stored
        else f"No earlier verdict is stored (`docs/guide/{VERDICT_FILE}`): rerun `dtrain capstone` "
        "on a quiet host."
    )
    return (
        f"Goal: within {GOAL:.0%}. **The check could not be made under this load:** only {judged} "
        f"of {len(checks)} rows ran on a host quiet enough to judge{seen}, fewer than "
        f"{MIN_JUDGED_SHARE:.0%}. " + last
    )


def checks_table(
    checks: list[Check], report: CalibrationReport, stored: Verdict | None = None
) -> list[str]:
    """The predicted-vs-measured section; rows that ran on a loaded host (``Check.judged``) are
    shown but not judged, and ``stored`` is the last valid verdict, quoted when this one cannot be
    made."""
    out = ["## Predicted vs measured (local runs)", ""]
    if not checks:
        return out + [
            "No local run could be predicted (none of fsdp-scaling, fp8-train or tp-attention, or "
            "no allreduce-bench link). Run `dtrain capstone`.",
            "",
        ]
    judged = [c for c in checks if c.judged]
    spread = [c for c in judged if c.predicted_range]
    loaded = ""
    if spread:
        in_spread = sum(c.within_spread for c in judged)
        widths = sorted(
            (c.predicted_range[1] - c.predicted_range[0]) / c.predicted_s for c in spread
        )
        loaded = (
            " Predictions carry the load other processes put on the cores during each run "
            "(measured, "
            "`dtrain.run.hostload`); across its 10th-90th percentile they move by "
            f"{widths[len(widths) // 2]:.0%} "
            f"(median; up to {widths[-1]:.0%}), and {in_spread} of {len(judged)} judged rows reach "
            "the goal somewhere "
            "in that spread."
        )
    skipped = len(checks) - len(judged)
    not_judged = (
        f" {skipped} row{'s' * (skipped != 1)} ran on a loaded host (load factor above "
        f"x{MAX_LOAD:g}, or its 90th percentile above {MAX_LOAD_SPREAD:g}x its 10th): shown, not "
        "judged."
        if skipped
        else ""
    )
    out += [
        "The cost model's step time for each local run, with this machine as the 'cluster' (peak "
        "= the measured CPU matmul probe, links = allreduce-bench's α–β fit of each collective). "
        + _verdict_line(checks, stored)
        + _distinct(checks)
        + not_judged
        + loaded
        + _host(report),
        "",
        "| experiment | run | what | measured | predicted | error | inputs | where the difference "
        "sits |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for c in checks:
        if not c.judged:
            out.append(
                f"| {c.experiment} | `{c.run}` | {c.what} | {c.measured_s * 1e3:.1f} ms | "
                f"{c.predicted_s * 1e3:.1f} ms | {c.error:+.0%} (not judged) | "
                f"{md_cell(c.basis)} | "
                f"{md_cell(c.not_judged)} |"
            )
            continue
        mark = "" if c.within_goal else " ✗"
        where = "; ".join(
            x for x in (c.detail, c.miss_reason(judged) and "miss: " + c.miss_reason(judged)) if x
        )
        rng = (
            f" ({c.predicted_range[0] * 1e3:.0f}–{c.predicted_range[1] * 1e3:.0f})"
            if c.predicted_range
            else ""
        )
        out.append(
            f"| {c.experiment} | `{c.run}` | {c.what} | {c.measured_s * 1e3:.1f} ms | "
            f"{c.predicted_s * 1e3:.1f} ms{rng} | {c.error:+.0%}{mark} | {md_cell(c.basis)} |"
            + (f" {md_cell(where)} |" if where else " |")
        )
    out += [
        "",
        "Each miss names its likeliest cause in the last column: load that varied during the run "
        "(the row reaches the goal within its spread), run-to-run noise (identical runs on the "
        "shared cores differ by more than the goal), in-training gloo communication slower than "
        "allreduce-bench's isolated α–β (compare the profiled and predicted communication), "
        "fp8-train's per-step tooling (NaN guard hooks, health and debug statistics: not training "
        "compute, so not modelled), or per-step framework work of the distributed trainer "
        "(DDP/FSDP/TP hooks, FP8 casts) that the probe's single-process step does not have. "
        "Compute is predicted from the gemm-probe (GEMM curve over the runs' shapes + the "
        "measured fixed step overhead of the same model at its real size, each timed with its "
        "waits for a CPU taken out and between runs of the reference matmul, so that load "
        "cancels; scaled by the load factor measured during each run, or without one by the run's "
        "own matmul probe, and by the busy threads per core when a run has more ranks than the "
        "host has cores) when the results hold one; in brackets, the prediction at the 10th and "
        "90th percentile of the run's load. DP communication hides behind compute only on cores "
        "the ranks' compute leaves free (gloo copies and reduces on the CPU, as NCCL's kernels "
        "take SMs on a GPU), so the measured overlap is scaled by that share; an FP8 factor is a "
        "whole-step tokens/s ratio and divides the whole step. TP communication and the PP bubble "
        "carry the measured/modelled factor of the OTHER runs that measured them (leave-one-out, "
        "never the row's own run; the inputs column says how many). The model was built for GPU "
        "clusters; these rows test its mechanics (FLOPs, bytes, α–β, overlap), not GPU numbers.",
        "",
    ]
    return out
