"""The guide's plots, drawn from the matrix cells and the local checks (PNG, deterministic)."""
from __future__ import annotations

from pathlib import Path

from dtrain import plots

from .local_check import GOAL, Check
from .matrix import GPU_COUNTS, IB_GBITS, MODELS, Cell, model_label

REF_IB, REF_GPUS = 400, 1024
PARTS = ("compute", "TP comm", "PP comm", "bubble", "exposed DP comm")


def _save(fig, path: Path) -> Path:
    return plots.save(fig, path, quiet=True, dpi=110, reproducible=True)


def _mfu_lines(cells: list[Cell], path: Path, x: str, keep, ticks, xlabel: str, title: str) -> Path:
    """Predicted MFU of the best layout against one swept axis (`x`), one line per model and topology."""
    fig, axes = plots.figure(width=7.5, height=4.5)
    ax = axes[0][0]
    palette = plots.sns.color_palette("colorblind", len(MODELS))
    for color, p in zip(palette, MODELS):
        for topo, style in (("NVLink", "-"), ("PCIe", "--")):
            pts = sorted((getattr(c, x), c.mfu) for c in cells if c.params == p and c.topology == topo
                         and keep(c) and c.fits)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{model_label(p)} {topo}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel=xlabel, ylabel="predicted MFU", title=title)
    ax.legend(ncol=2, fontsize=7)
    return _save(fig, path)


def mfu_vs_gpus(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(cells, path, "gpus", lambda c: c.ib_gbit == REF_IB, GPU_COUNTS, "GPUs",
                      f"Best layout's MFU (IB {REF_IB} Gbit/s per GPU; dashed: PCIe node)")


def mfu_vs_ib(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(cells, path, "ib_gbit", lambda c: c.gpus == REF_GPUS, IB_GBITS, "InfiniBand Gbit/s per GPU",
                      f"{REF_GPUS} GPUs: MFU vs inter-node bandwidth")


def step_breakdown(cells: list[Cell], path: Path) -> Path:
    fig, axes = plots.figure(width=7.5, height=4.2)
    ax = axes[0][0]
    chosen = [c for p in MODELS for c in cells if c.params == p and c.gpus == REF_GPUS and c.topology == "NVLink"
              and c.ib_gbit == REF_IB and c.fits]
    labels = [f"{c.model}\n{c.layout}" for c in chosen]
    bottom = [0.0] * len(chosen)
    for i, name in enumerate(PARTS):
        vals = [c.parts[i] / c.step_s for c in chosen]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="share of predicted step time", title=f"Where the step goes ({REF_GPUS} GPUs, NVLink, IB {REF_IB})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def predicted_vs_measured(checks: list[Check], path: Path) -> Path | None:
    if not checks:
        return None
    fig, axes = plots.figure(width=5.5, height=5.0)
    ax = axes[0][0]
    for exp in sorted({c.experiment for c in checks}):
        pts = [(c.measured_s, c.predicted_s) for c in checks if c.experiment == exp]
        ax.scatter(*zip(*pts), label=exp, s=40)
    lo = min(min(c.measured_s, c.predicted_s) for c in checks) * 0.7
    hi = max(max(c.measured_s, c.predicted_s) for c in checks) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.fill_between([lo, hi], [lo * (1 - GOAL), hi * (1 - GOAL)], [lo * (1 + GOAL), hi * (1 + GOAL)],
                    color="grey", alpha=0.2, label=f"±{GOAL:.0%}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (s)",
           ylabel="predicted step time (s)", title="Cost model vs local runs")
    ax.legend(fontsize=8)
    return _save(fig, path)


def draw_all(cells: list[Cell], checks: list[Check], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [mfu_vs_gpus(cells, out_dir / "mfu_vs_gpus.png"), mfu_vs_ib(cells, out_dir / "mfu_vs_ib.png"),
            step_breakdown(cells, out_dir / "step_breakdown.png"),
            predicted_vs_measured(checks, out_dir / "predicted_vs_measured.png")]
    if made[-1] is None:  # no local runs: drop a stale plot from an earlier generation
        (out_dir / "predicted_vs_measured.png").unlink(missing_ok=True)
    return [p for p in made if p is not None]
