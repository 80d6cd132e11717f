"""The guide's plots, drawn from the matrix cells and the local checks (PNG, deterministic).

The guide writes and removes only plots it wrote: ``<plots dir>/.dtrain-guide-plots.json`` lists
each plot it wrote there with its sha256. A file of a plot's name that is not listed, or that
changed since (the user's own), is refused before any work (``check_plots_dir``), and a stale plot
is removed only when listed and unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.results import plots
from dtrain.results.metrics import write_json_atomic

from .check import VERDICT_FILE

from .check import GOAL, Check
from .matrix import GPU_COUNTS, IB_GBITS, MODELS, Cell, model_label


REF_IB, REF_GPUS = 400, 1024
# one colour and one marker per model: tab10's first colours are all different hues (colorblind's
# orange, vermillion and tan look alike at seven), and the markers tell them apart in greyscale too
MODEL_PALETTE = "tab10"
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")
PARTS = ("compute", "TP comm", "PP comm", "bubble", "exposed DP comm")


def _save(fig, path: Path) -> Path:
    return plots.save(fig, path, quiet=True, dpi=110, reproducible=True)


def model_styles() -> tuple[list, tuple[str, ...]]:
    """(colour, marker) per model of MODELS, every pair different."""
    assert len(MODELS) <= len(MODEL_MARKERS), "add markers for the new models"
    return plots.sns.color_palette(MODEL_PALETTE, len(MODELS)), MODEL_MARKERS[: len(MODELS)]


def _mfu_lines(cells: list[Cell], path: Path, x: str, keep, ticks, xlabel: str, title: str) -> Path:
    """Predicted MFU of the best layout against one swept axis (`x`): colour = model, line = node
    type, each in its own legend beside the plot."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    fig, axes = plots.figure(width=7.0, height=4.5)
    ax = axes[0][0]
    palette, markers = model_styles()
    styles = (("NVLink", "-"), ("PCIe", "--"))
    for color, marker, p in zip(palette, markers, MODELS):
        for topo, style in styles:
            pts = sorted(
                (getattr(c, x), c.mfu)
                for c in cells
                if c.params == p and c.topology == topo and keep(c) and c.fits
            )
            if pts:
                ax.plot(*zip(*pts), style, marker=marker, markersize=5, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set(xlabel=xlabel, ylabel="predicted MFU (% of peak)", title=title)
    handles = [Line2D([], [], color=c, marker=m, markersize=5) for c, m in zip(palette, markers)]
    models = ax.legend(
        handles,
        [model_label(p) for p in MODELS],
        title="model",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )
    ax.add_artist(models)
    ax.legend(
        [Line2D([], [], color="0.3", ls=st) for _, st in styles],
        [t for t, _ in styles],
        title="node",
        loc="lower left",
        bbox_to_anchor=(1.01, 0.0),
        borderaxespad=0.0,
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


def mfu_vs_gpus(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(
        cells,
        path,
        "gpus",
        lambda c: c.ib_gbit == REF_IB,
        GPU_COUNTS,
        "GPUs",
        f"Best layout's MFU (IB {REF_IB} Gbit/s per GPU)",
    )


def mfu_vs_ib(cells: list[Cell], path: Path) -> Path:
    return _mfu_lines(
        cells,
        path,
        "ib_gbit",
        lambda c: c.gpus == REF_GPUS,
        IB_GBITS,
        "InfiniBand per GPU (Gbit/s)",
        f"{REF_GPUS} GPUs: MFU vs inter-node bandwidth",
    )


def step_breakdown(cells: list[Cell], path: Path) -> Path:
    """One horizontal bar per model (its best layout), split into the step's parts."""
    from matplotlib.ticker import PercentFormatter

    fig, axes = plots.figure(width=7.0, height=3.8)
    ax = axes[0][0]
    chosen = [
        c
        for p in MODELS
        for c in cells
        if c.params == p
        and c.gpus == REF_GPUS
        and c.topology == "NVLink"
        and c.ib_gbit == REF_IB
        and c.fits
    ]
    labels = [f"{c.model}  {c.layout}" for c in chosen]
    left = [0.0] * len(chosen)
    for i, name in enumerate(PARTS):
        vals = [c.parts[i] / c.step_s for c in chosen]
        ax.barh(labels, vals, left=left, label=name)
        left = [b + v for b, v in zip(left, vals)]
    ax.invert_yaxis()  # smallest model on top, as the matrix lists them
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set(
        xlabel="share of predicted step time",
        ylabel="model, layout (dp×tp×pp)",
        title=f"Where the step goes ({REF_GPUS} GPUs, NVLink, IB {REF_IB} Gbit/s)",
    )
    plots.legend_outside(ax, "part of the step")
    return _save(fig, path)


def predicted_vs_measured(checks: list[Check], path: Path) -> Path | None:
    """Each local run: measured vs predicted step time (ms, log axes), the goal band, and the
    spread of the prediction over the load measured during the run as a vertical bar."""
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
    ax.fill_between(
        [lo, hi],
        [lo * (1 - GOAL), hi * (1 - GOAL)],
        [lo * (1 + GOAL), hi * (1 + GOAL)],
        color="grey",
        alpha=0.2,
        label=f"±{GOAL:.0%} (goal)",
    )
    for axis in ("x", "y"):
        plots.log_axis_plain(ax, axis, scale=1e3)
    ax.set(
        xlim=(lo, hi),
        ylim=(lo, hi),
        xlabel="measured step time (ms)",
        ylabel="predicted step time (ms)",
        title="Cost model vs local runs",
    )
    ax.set_aspect("equal")
    plots.legend_outside(ax, "bars: 10th-90th pct. of load")
    return _save(fig, path)


FIGURES = {
    "mfu_vs_gpus": mfu_vs_gpus,
    "mfu_vs_ib": mfu_vs_ib,
    "step_breakdown": step_breakdown,
    "predicted_vs_measured": predicted_vs_measured,
}


def _draw(task: tuple) -> Path | None:
    name, data, path = task
    return FIGURES[name](data, path)


MANIFEST = ".dtrain-guide-plots.json"  # in the plots folder: {"plots": {file name: sha256}}
LOCAL_ONLY = ("predicted_vs_measured",)  # drawn only from local runs


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(out_dir: Path) -> dict[str, str] | None:
    """The plots the guide wrote into ``out_dir`` ({} when none); None when the file there is not
    one the guide wrote."""
    try:
        data = json.loads((Path(out_dir) / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    listed = data.get("plots") if isinstance(data, dict) else None
    ok = isinstance(listed, dict) and all(isinstance(v, str) for v in listed.values())
    return listed if ok else None


def _ours(path: Path, manifest: dict[str, str]) -> bool:
    """Written by the guide and unchanged since."""
    return manifest.get(path.name) == _sha256(path)


def check_plots_dir(out_dir: Path, with_local: bool, shown: str) -> None:
    """Before any work: the guide would overwrite no file of ``out_dir`` it did not write
    (``shown``: how the user named the folder). ``with_local``: the plot of the local runs may be
    drawn too."""
    out_dir = Path(out_dir)
    fix = "move it or pass another --plots-dir"
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise UserError(
            f"{shown} holds {out_dir / MANIFEST} that dtrain guide did not write: {fix}"
        )
    names = [f"{n}.png" for n in FIGURES if with_local or n not in LOCAL_ONLY]
    names += [VERDICT_FILE] if with_local else []
    for path in (out_dir / n for n in names):
        if path.is_symlink() or path.is_dir() or (path.exists() and not _ours(path, manifest)):
            raise UserError(f"{shown} holds {path} that dtrain guide did not write: {fix}")


def _record(out_dir: Path, made: list[Path | None]) -> None:
    """List what was drawn; remove a stale plot of the local runs only when the guide wrote it."""
    manifest = read_manifest(out_dir) or {}
    for name, path in zip(FIGURES, made):
        if path is not None:
            manifest[path.name] = _sha256(path)
            continue
        stale = out_dir / f"{name}.png"
        if stale.is_file() and not stale.is_symlink() and _ours(stale, manifest):
            stale.unlink()  # no local runs this time: an earlier generation's plot would mislead
        manifest.pop(stale.name, None)  # gone, or the user's: never touched again
    write_json_atomic(out_dir / MANIFEST, {"written_by": "dtrain guide", "plots": manifest})


def ours(out_dir: Path, name: str) -> bool:
    """``out_dir/name`` is a file the guide wrote and listed, unchanged since."""
    path, manifest = Path(out_dir) / name, read_manifest(out_dir) or {}
    return path.is_file() and not path.is_symlink() and _ours(path, manifest)


def record_file(out_dir: Path, path: Path) -> None:
    """List another file the guide wrote into ``out_dir`` (the local check's verdict)."""
    manifest = read_manifest(out_dir) or {}
    manifest[path.name] = _sha256(path)
    write_json_atomic(out_dir / MANIFEST, {"written_by": "dtrain guide", "plots": manifest})


def draw_all(cells: list[Cell], checks: list[Check], out_dir: Path, pool=None) -> list[Path]:
    """Every figure (``pool``: side by side in its workers, which forked with matplotlib
    imported)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = [
        (name, checks if name == "predicted_vs_measured" else cells, out_dir / f"{name}.png")
        for name in FIGURES
    ]
    made = pool.map(_draw, tasks, chunksize=1) if pool is not None else [_draw(t) for t in tasks]
    _record(out_dir, made)
    return [p for p in made if p is not None]
