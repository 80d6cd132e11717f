"""The guide's *Backtest against published runs* section: ``dtrain backtest``'s figures and
table."""

from __future__ import annotations

from .markdown import md_cell


def backtest_section(rows: list | None = None) -> list[str]:
    """``dtrain backtest``: the model against the published development runs (data shipped in the
    repo); ``rows``: its ``backtest(rank=False)``, when the caller computed it beside the matrix."""
    from dtrain.costmodel.backtest import ERROR_GOAL, WITHIN, WITHIN_SHARE, backtest, summary

    rows = backtest(rank=False) if rows is None else rows
    s = summary(rows)
    out = [
        "## Backtest against published runs",
        "",
        "`dtrain backtest`: each published GPU training run of "
        "`common/dtrain/costmodel/backtest_runs.yaml` (the development set: model shape, GPUs, "
        "layout, batch and software stack as printed in the cited source; what a source leaves "
        "out is stated under `assumed`) predicted term by term. The kernel rates come from kernel "
        "benchmarks (`costmodel/kernels.yaml`), not from these rows; the two numbers fitted to "
        "rows, the share of overlapped DP traffic that its NCCL kernel's SMs leave to compute "
        "(the HBM its copies take is priced apart) and the share of a link's rate collectives "
        "reach, are fitted (least squares) for each source on the OTHER sources only "
        "(leave-one-source-out). Every other published run is held out for independent validation "
        "and is not used. `dtrain backtest` also ranks each published layout among the search's.",
        "",
        f"**Median |error| {s['median_abs_error']:.1%}** (goal ≤ {ERROR_GOAL:.0%}: "
        f"{'met' if s['error_goal_met'] else 'not met'}); **{s['within_15pct']} of {s['rows']} "
        f"within {WITHIN:.0%}** (goal ≥ {WITHIN_SHARE:.0%}: "
        f"{'met' if s['within_goal_met'] else 'not met'}); **{s['fit']} of {s['ran']} layouts "
        f"that ran predicted to fit**; {s['oom_predicted']} of {s['oom_rows']} reported "
        "out-of-memory predicted not to fit.",
        "",
        "Median |error| by source: "
        + ", ".join(f"{g} {v:.0%}" for g, v in s["by_group"].items())
        + ".",
        "",
    ]
    if s["memory_rows"]:
        lo, hi = s["memory_error_range"]
        out += [
            f"Memory against the {s['memory_rows']} rows whose source prints its peak "
            "(torchtitan: max reserved, fragmentation included; in brackets below): median "
            f"{s['memory_median_error']:+.0%}, {lo:+.0%} to {hi:+.0%}, {s['memory_within_10pct']} "
            "within 10%.",
            "",
        ]
    out += [
        "| run | published layout | reported tokens/s/GPU | predicted | error | memory / HBM "
        "(GiB) | largest term | source |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        mem = (
            f"{r.memory_gib:.0f} / {r.hbm_gib:g}"
            + ("" if r.fits else " (does not fit)")
            + (f" [{r.reported_memory_gib:g}]" if r.reported_memory_gib else "")
        )
        if r.expect_oom:
            out.append(
                f"| {md_cell(r.name)} | {r.layout} | OOM | | | {mem} | | {md_cell(r.source)} |"
            )
            continue
        out.append(
            f"| {md_cell(r.name)} | {r.layout} | {r.reported_tps:,.0f} | {r.predicted_tps:,.0f} | "
            f"{r.error:+.0%} | {mem} | {md_cell(r.dominant)} | {md_cell(r.source)} |"
        )
    return out + [""]
