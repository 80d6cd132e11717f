"""The guide's plots, drawn from the matrix cells and the local checks (PNG, deterministic)."""
from __future__ import annotations

from pathlib import Path

from dtrain import plots

from .check import GOAL, Check
from .matrix import GPU_COUNTS, IB_GBITS, MODELS, Cell, model_label


REF_IB, REF_GPUS = 400, 1024
PARTS = ("compute", "TP comm", "PP comm", "bubble", "exposed DP comm")


def _save(fig, path: Path) -> Path:
    return plots.save(fig, path, quiet=True, dpi=110, reproducible=True)


def _mfu_lines(cells: list[Cell], path: Path, x: str, keep, ticks, xlabel: str, title: str) -> Path:
    """Predicted MFU of the best layout against one swept axis (`x`): colour = model, line = node type,
    each in its own legend beside the plot."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    fig, axes = plots.figure(width=7.0, height=4.5)
    ax = axes[0][0]
    palette = plots.sns.color_palette("colorblind", len(MODELS))
    styles = (("NVLink", "-"), ("PCIe", "--"))
    for color, p in zip(palette, MODELS):
        for topo, style in styles:
            pts = sorted((getattr(c, x), c.mfu) for c in cells if c.params == p and c.topology == topo
                         and keep(c) and c.fits)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", markersize=4, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set(xlabel=xlabel, ylabel="predicted MFU (% of peak)", title=title)
    models = ax.legend([Line2D([], [], color=c, marker="o", markersize=4) for c in palette],
                       [model_label(p) for p in MODELS], title="model", loc="upper left",
                       bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, title_fontsize=8, frameon=False)
    ax.add_artist(models)
    ax.legend([Line2D([], [], color="0.3", ls=st) for _, st in styles], [t for t, _ in styles], title="node",
              loc="lower left", bbox_to_anchor=(1.01, 0.0), borderaxespad=0.0, fontsize=8, title_fontsize=8,
              frameon=False)
    return _save(fig, path)


def mfu_vs_gpus(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(cells, path, "gpus", lambda c: c.ib_gbit == REF_IB, GPU_COUNTS, "GPUs",
                      f"Best layout's MFU (IB {REF_IB} Gbit/s per GPU)")


def mfu_vs_ib(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(cells, path, "ib_gbit", lambda c: c.gpus == REF_GPUS, IB_GBITS, "InfiniBand per GPU (Gbit/s)",
                      f"{REF_GPUS} GPUs: MFU vs inter-node bandwidth")


def step_breakdown(cells: list[Cell], path: Path) -> Path:
    """One horizontal bar per model (its best layout), split into the step's parts."""
    from matplotlib.ticker import PercentFormatter

    fig, axes = plots.figure(width=7.0, height=3.8)
    ax = axes[0][0]
    chosen = [c for p in MODELS for c in cells if c.params == p and c.gpus == REF_GPUS and c.topology == "NVLink"
              and c.ib_gbit == REF_IB and c.fits]
    labels = [f"{c.model}  {c.layout}" for c in chosen]
    left = [0.0] * len(chosen)
    for i, name in enumerate(PARTS):
        vals = [c.parts[i] / c.step_s for c in chosen]
        ax.barh(labels, vals, left=left, label=name)
        left = [b + v for b, v in zip(left, vals)]
    ax.invert_yaxis()  # smallest model on top, as the matrix lists them
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set(xlabel="share of predicted step time", ylabel="model, layout (dp×tp×pp)",
           title=f"Where the step goes ({REF_GPUS} GPUs, NVLink, IB {REF_IB} Gbit/s)")
    plots.legend_outside(ax, "part of the step")
    return _save(fig, path)


def predicted_vs_measured(checks: list[Check], path: Path) -> Path | None:
    """Each local run: measured vs predicted step time (ms, log axes), the goal band, and the spread of the
    prediction over the load measured during the run as a vertical bar."""
    if not checks:
        return None
    fig, axes = plots.figure(width=6.2, height=4.6)
    ax = axes[0][0]
    for exp in sorted({c.experiment for c in checks}):
        rows = [c for c in checks if c.experiment == exp]
        x, y = [c.measured_s for c in rows], [c.predicted_s for c in rows]
        lo = [c.predicted_s - (c.predicted_range or (c.predicted_s,) * 2)[0] for c in rows]
        hi = [(c.predicted_range or (c.predicted_s,) * 2)[1] - c.predicted_s for c in rows]
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o", markersize=6, capsize=3, label=exp)
    lo = min(min(c.measured_s, (c.predicted_range or (c.predicted_s,))[0]) for c in checks) * 0.7
    hi = max(max(c.measured_s, (c.predicted_range or (0, c.predicted_s))[1]) for c in checks) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.fill_between([lo, hi], [lo * (1 - GOAL), hi * (1 - GOAL)], [lo * (1 + GOAL), hi * (1 + GOAL)],
                    color="grey", alpha=0.2, label=f"±{GOAL:.0%} (goal)")
    for axis in ("x", "y"):
        plots.log_axis_plain(ax, axis, scale=1e3)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (ms)", ylabel="predicted step time (ms)",
           title="Cost model vs local runs")
    ax.set_aspect("equal")
    plots.legend_outside(ax, "bars: 10th-90th pct. of load")
    return _save(fig, path)


FIGURES = {"mfu_vs_gpus": mfu_vs_gpus, "mfu_vs_ib": mfu_vs_ib, "step_breakdown": step_breakdown,
           "predicted_vs_measured": predicted_vs_measured}


def _draw(task: tuple) -> Path | None:
    name, data, path = task
    return FIGURES[name](data, path)


def draw_all(cells: list[Cell], checks: list[Check], out_dir: Path, pool=None) -> list[Path]:
    """Every figure (``pool``: side by side in its workers, which forked with matplotlib imported)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(name, checks if name == "predicted_vs_measured" else cells, out_dir / f"{name}.png")
             for name in FIGURES]
    made = pool.map(_draw, tasks, chunksize=1) if pool is not None else [_draw(t) for t in tasks]
    if made[-1] is None:  # no local runs: drop a stale plot from an earlier generation
        (out_dir / "predicted_vs_measured.png").unlink(missing_ok=True)
    return [p for p in made if p is not None]
