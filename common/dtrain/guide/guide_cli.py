"""`dtrain guide [--results DIR] [--out PARALLELISM_GUIDE.md]`: regenerate the guide.

Calibrates the cost model from the run directories under --results (through dtrain.results.loader;
by default what the latest `dtrain capstone` read, dtrain.guide.inputs, so both give the same
guide),
computes the decision matrix, derives its rules, checks the model against the local runs, draws
the plots (into docs/guide/ beside the guide by default) and writes the markdown atomically.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import textwrap
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.core.terminal import WIDTH
from dtrain.costmodel.calibrate import calibrate_naming_skips, display_path
from dtrain.costmodel.hardware import load_profiles
from dtrain.results.loader import find_runs
from dtrain.results.metrics import write_text_atomic

from .inputs import default_inputs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "guide",
        help="regenerate PARALLELISM_GUIDE.md from measured results",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "--results",
        action="append",
        metavar="DIR",
        help="run dirs or folders above them (repeatable; default: what the latest "
        "capstone under results/capstone read, its runs and measured/; without "
        "one results/ and measured/)",
    )
    p.add_argument(
        "--no-results", action="store_true", help="datasheet/published values only, no runs read"
    )
    p.add_argument(
        "--out",
        default="PARALLELISM_GUIDE.md",
        help="markdown file to write (default PARALLELISM_GUIDE.md)",
    )
    p.add_argument("--plots-dir", help="where the PNGs go (default: docs/guide/ beside --out)")
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        choices=sorted(load_profiles()),
        metavar="GPU",
        help=f"GPU of the decision matrix: {', '.join(sorted(load_profiles()))} (default h100-sxm)",
    )
    p.set_defaults(func=run)


def _progress():
    """A rich progress bar on stderr for the matrix, on a terminal only (dtrain.core.terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from dtrain.core.terminal import rich_progress

    return rich_progress(
        TextColumn("decision matrix"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )


def check_outputs(
    out: str | Path, plots_dir: str | Path | None, with_local: bool
) -> tuple[Path, Path]:
    """Before any work (also `dtrain capstone`'s, before its experiments): the guide file can be
    written, and the plots folder holds no file of a plot's name that the guide did not write
    (``with_local``: runs are read, so the plot of the local runs may be drawn).
    Returns (guide path, plots folder)."""
    from dtrain.core.checks import check_output_file, check_path

    from .figures import check_plots_dir

    out = check_output_file("--out", str(out))
    folder = Path(plots_dir) if plots_dir else out.parent / "docs" / "guide"
    check_path("--plots-dir", str(folder))
    shown = f"--plots-dir {folder}" + ("" if plots_dir else " (the default, beside --out)")
    check_plots_dir(folder, with_local, shown)
    return out, folder


def generate(
    results: list[str] | None,
    out: str | Path,
    plots_dir: str | Path | None = None,
    gpu: str = "h100-sxm",
    quiet: bool = False,
) -> tuple[Path, list[Path]]:
    """Write the guide and its plots; returns (guide path, plot paths)."""
    from dtrain.costmodel.backtest import backtest

    from .figures import draw_all
    from . import long_context as lc
    from .long_context import long_search, long_tasks
    from . import moe_guide as moe
    from .matrix import compute_matrix
    from .render import render
    from .rules import derive_rules

    results = list(results or [])
    out, plots_dir = check_outputs(out, plots_dir, with_local=bool(results))
    for r in results:
        if not Path(r).exists():
            raise UserError(
                f"no such results path: {r}: run `dtrain capstone` first, pass --results DIR, "
                "or --no-results for a datasheet-only guide"
            )
    base = Path.cwd()
    runs = find_runs(results) if results else []
    report, messages = calibrate_naming_skips(results, base=base, gpu=gpu)
    for message in messages:  # named here and in the guide's header
        print(f"warning: {message}", file=sys.stderr)
    used = {r.path for r in report.runs}
    skipped = sorted(display_path(r.path, base) for r in runs if r.path not in used)
    bar = _progress()
    workers = min(len(os.sched_getaffinity(0)), 8)
    # one pool for the matrix and the long-context grid: the long searches are queued first (the
    # slowest first), so every core stays busy until both are done (fork: the workers start with the
    # model imported)
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        long_async = (
            pool.map_async(
                long_search, long_tasks(report.cluster, report.cluster_links, gpu), chunksize=1
            )
            if pool
            else None
        )
        moe_async = (
            pool.map_async(
                moe.moe_cell, moe.moe_tasks(report.cluster, report.cluster_links), chunksize=1
            )
            if pool
            else None
        )
        with bar:
            task = bar.add_task("matrix", total=None)
            cells = compute_matrix(
                report.cluster,
                report.cluster_links,
                gpu,
                pool=pool,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        backtest_async = (
            pool.apply_async(backtest, kwds={"rank": False}) if pool else None
        )  # beside the last searches
        long_cells = (
            lc.long_cells(long_async.get())
            if long_async
            else lc.compute_long(report.cluster, report.cluster_links, gpu)
        )
        moe_cells = (
            moe.moe_cells(moe_async.get())
            if moe_async
            else moe.compute_moe(report.cluster, report.cluster_links)
        )
        checks = []
        if (
            report.runs
        ):  # the local checks read runs with dtrain's model (torch): only when there are runs
            from .moe_check import all_checks

            checks = all_checks(report, base)
        # the plot shows the judged rows only: a loaded run's spread would only mislead
        plot_paths = draw_all(cells, [c for c in checks if c.judged], plots_dir, pool)
        backtest_rows = backtest_async.get() if backtest_async else None
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    label = ", ".join(display_path(Path(r), base) for r in results) or "(none: --no-results)"
    stored = keep_verdict(report, checks, plots_dir, label)
    text = render(
        report,
        cells,
        derive_rules(cells),
        checks,
        plot_paths,
        out,
        label,
        skipped,
        gpu,
        long_cells,
        backtest_rows,
        stored,
        moe_cells,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    if not quiet:
        for p in plot_paths:
            print(f"wrote plot {p}")
        print(
            f"wrote {out} ({len(cells)} matrix cells, {len(checks)} local checks, "
            f"{len(report.runs)} runs read)"
        )
    return out, plot_paths


def keep_verdict(report, checks: list, plots_dir: Path, label: str):
    """Store the local check's verdict when it could be made (``check.verdict``: enough rows ran
    on a quiet host) as the last valid one (``check.VERDICT_FILE`` beside the plots, listed in
    their manifest); else return the stored one, if the guide wrote it, for the guide to quote."""
    from .check import VERDICT_FILE, load_verdict, save_verdict, verdict
    from .figures import ours, record_file

    if not checks:
        return None
    dates = [str(ri.source.date) for ri in report.inputs if not ri.source.on_gpu]
    v = verdict(checks, max(dates, default="")[:10], label)
    if v is not None:
        record_file(plots_dir, save_verdict(plots_dir, v))
        return None
    return load_verdict(plots_dir) if ours(plots_dir, VERDICT_FILE) else None


def run(args) -> int:
    if args.no_results and args.results:
        raise UserError("--no-results and --results exclude each other")
    if args.no_results or args.results:
        results = [] if args.no_results else args.results
    else:  # what `dtrain capstone` gives its guide (dtrain.guide.inputs): one guide, either way
        results, said = default_inputs()
        print(
            textwrap.fill(said, WIDTH, break_on_hyphens=False, break_long_words=False),
            file=sys.stderr,
        )
    generate(results, args.out, args.plots_dir, args.gpu)
    return 0


if __name__ == "__main__":
    from dtrain.cli.main import main

    sys.exit(main(["guide", *sys.argv[1:]]))
