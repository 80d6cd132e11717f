"""`dtrain backtest`: the cost model against published GPU training runs (``backtest_runs.yaml``,
the development set): its flags, the table with its summary (text) and the JSON; ``--measured``
runs ``backtest_measured.py`` instead (``--moe``, added by ``moe_backtest.py``: the MoE rows).
"""

from __future__ import annotations

import json
import textwrap

from dtrain.core import terminal

from .backtest import ERROR_GOAL, GAP_GOAL, WITHIN, WITHIN_SHARE, BacktestRow, backtest, summary
from .backtest_fit import fit_with_margin
from .published_runs import load_rows


def text_lines(rows: list[BacktestRow], loso: bool = True) -> list[str]:
    """The table and its summary; ``loso``: the rows were predicted leave-one-source-out (else
    with the defaults)."""
    s = summary(rows)
    out = [
        "run (its figures on the line under its name)",
        f"{'reported':>8} {'predicted':>9} {'error':>6} {'memory GiB':>18} {'gap':>6} "
        "dominant term",
    ]
    for r in rows:
        rep = f"({r.reported_memory_gib:g})" if r.reported_memory_gib else ""
        mem = f"{r.memory_gib:5.1f}/{r.hbm_gib:<4g}{' ' if r.fits else '!'}{rep:>7}"
        if r.expect_oom:
            said = "predicted not to fit" if not r.fits else "NOT predicted: the model says it fits"
            out += [r.name, f"{'OOM':>8} {'':>9} {'':>6} {mem:>18} {'':>6} {said}"]
            continue
        gap = f"{r.gap_to_best:6.1%}" if r.candidates else ""
        out += [
            r.name,
            f"{r.reported_tps:8.0f} {r.predicted_tps:9.0f} {r.error:+6.0%} {mem:>18} {gap:>6} "
            f"{r.dominant}",
        ]
    how = (
        "dp_overlap and link_efficiency fitted on the OTHER sources (leave-one-source-out)"
        if loso
        else "the defaults, fitted to every row (in sample)"
    )
    gaps = [r.gap_to_best for r in rows if r.candidates and not r.expect_oom]
    ranked = (
        f"published layout within {GAP_GOAL:.0%} of the best its software runs: "
        f"{s['within_10pct_of_best']} of {s['ranked']} (a gap is the model's prediction, not a "
        f"measurement: one within the median |error| {s['median_abs_error']:.1%} is a tie, and "
        f"the largest ({max(gaps):.0%}) say as much about what the model misses in an expert "
        "layout as about a faster one: measure before switching)"
        if s["ranked"] and gaps
        else "layouts not ranked (--no-rank)"
    )
    out += [
        "",
        f"tokens/s per GPU; each row predicted with {how}; memory per GPU predicted / HBM ('!': "
        "over) (reported, where the source gives it); gap = how much slower the published layout "
        "is predicted to be than the best layout its own software runs (the row's software, "
        "costmodel/software.py); dominant = the step's largest predicted term.",
        "median |error| by source: " + ", ".join(f"{g} {v:.0%}" for g, v in s["by_group"].items()),
        f"median |error| {s['median_abs_error']:.1%} (goal <= {ERROR_GOAL:.0%}: "
        f"{'met' if s['error_goal_met'] else 'NOT met'}); within {WITHIN:.0%}: "
        f"{s['within_15pct']} of {s['rows']} (goal >= {WITHIN_SHARE:.0%}: "
        f"{'met' if s['within_goal_met'] else 'NOT met'}); predicted to fit: {s['fit']} of "
        f"{s['ran']} layouts that ran ({'met' if s['fit_goal_met'] else 'NOT met'}); "
        f"{s['oom_predicted']} of {s['oom_rows']} reported OOM predicted not to fit; {ranked}",
    ]
    out.append(fit_line(rows if loso else []))
    if s["memory_rows"]:
        lo, hi = s["memory_error_range"]
        out.append(
            f"memory against the {s['memory_rows']} rows that report it (torchtitan: max "
            f"reserved, fragmentation included): median {s['memory_median_error']:+.0%}, "
            f"{lo:+.0%} to {hi:+.0%}, {s['memory_within_10pct']} within 10%"
        )
    return out


def fit_line(rows: list[BacktestRow]) -> str:
    """The all-rows fit (the defaults), how near the grid's runner-up comes, and the folds' of
    ``rows`` (predicted leave-one-source-out; none: in sample)."""
    rows_all = list(load_rows())
    best, margin = fit_with_margin(rows_all)
    folds: dict[tuple, set] = {}
    for r in rows:
        if r.fitted:
            folds.setdefault((r.fitted["dp_overlap"], r.fitted["link_efficiency"]), set()).add(
                r.group
            )
    other = margin["runner_up"]
    line = (
        f"the fit to every row (the defaults): dp_overlap {best['dp_overlap']:g}, link_efficiency "
        f"{best['link_efficiency']:g}, mean squared log error {margin['mse']:.5f}; the grid's "
        f"next, {other['dp_overlap']:g} / {other['link_efficiency']:g}: "
        f"{margin['runner_up_mse']:.5f} ({margin['runner_up_mse'] / margin['mse'] - 1:+.1%})"
    )
    if folds:
        line += "; the leave-one-source-out folds: " + ", ".join(
            f"{ov:g} / {eff:g} for {len(g)}" for (ov, eff), g in sorted(folds.items())
        )
    return line


def add_parser(sub) -> None:
    p = sub.add_parser(
        "backtest",
        help="the cost model against published GPU training runs",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--in-sample",
        action="store_true",
        help="predict every row with the defaults (fitted to all rows) instead of "
        "leave-one-source-out",
    )
    p.add_argument(
        "--no-rank", action="store_true", help="skip the search for each row's rank (faster)"
    )
    p.add_argument(
        "--measured",
        nargs="?",
        const="measured",
        metavar="DIR",
        help="instead: this project's own CUDA runs under DIR (default measured/): predicted vs "
        "measured step time, peak memory and step-profile terms (costmodel/backtest_measured.py)",
    )
    p.set_defaults(func=run)


def run(a) -> int:
    if getattr(a, "measured", None) is not None:
        from .backtest_measured_text import run as run_measured

        return run_measured(a.measured, a.json)
    rows = backtest(loo=not a.in_sample, rank=not a.no_rank)
    if a.json:
        fitted, margin = fit_with_margin(list(load_rows()))
        print(
            json.dumps(
                {
                    "rows": [dict(vars(r), error=r.error, dominant=r.dominant) for r in rows],
                    "summary": summary(rows),
                    "fit_all_rows": fitted,
                    "fit_margin": margin,
                },
                indent=2,
                sort_keys=True,
            )
        )
    else:
        width = terminal.width()
        for line in text_lines(rows, loso=not a.in_sample):
            print(
                "\n".join(
                    textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False)
                    if len(line) > width
                    else [line]
                )
            )
    return 0
