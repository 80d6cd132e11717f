"""`python -m fp8_train dashboard RUN [RUN...] [--out DIR]`: a multi-panel PNG comparing runs,
and a small self-contained HTML page around it (the image embedded, the runs and their events
listed). Events are drawn on the loss panel: x = NaN/Inf, | = rollback, ^ = alert.
A training run renders its own dashboard at the end; this command compares several.
"""

from __future__ import annotations

import argparse
import base64
import html
from pathlib import Path

import pandas as pd

from dtrain.results import plots
from dtrain.results.loader import read_jsonl, require_complete
from dtrain.results.metrics import EVENTS, RECORDS

PANELS = [
    ("loss", "loss", "linear"),
    ("grad_norm", "grad norm", "log"),
    ("param_norm", "parameter norm", "linear"),
    ("update_ratio", "update / parameter ratio", "log"),
    ("grad_snr", "gradient SNR", "log"),
    ("scale", "scale (FP8 min / fp16 loss scale)", "log"),
    ("tokens_per_s", "tokens/s", "linear"),
    ("peak_mem_bytes", "peak memory (MiB)", "linear"),
]
MARKERS = {"nonfinite": "x", "recovery": "|", "alert": "^"}


def _read(path: Path, name: str) -> list[dict]:
    f = path / name
    return read_jsonl(f) if f.exists() else []


def label(run_dir: Path, config: dict | None = None) -> str:
    cfg = config or {}
    return f"{cfg.get('recipe', '?')} s{cfg.get('seed', '?')} ({run_dir.name})"


def frames(run_dirs: list[Path], configs: dict[Path, dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps, events = [], []
    for d in run_dirs:
        name = label(d, configs.get(d))
        rows = [r for r in _read(d, RECORDS) if r.get("kind") == "step"]
        for i, r in enumerate(rows):
            r = dict(r, run=name, attempt=i)
            r["scale"] = r.get("fp8_scale_min", r.get("grad_scale"))
            if r.get("peak_mem_bytes") is not None:
                r["peak_mem_bytes"] = r["peak_mem_bytes"] / 2**20
            steps.append(r)
        events += [dict(e, run=name) for e in _read(d, EVENTS) if e.get("kind") in MARKERS]
    return pd.DataFrame(steps), pd.DataFrame(events)


def plot(steps: pd.DataFrame, events: pd.DataFrame, out: Path) -> Path:
    fig, axes = plots.figure(ncols=4, nrows=2, width=4.6, height=3.4)
    for ax, (col, title, scale) in zip(axes.flat, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        if col not in steps or steps[col].dropna().empty:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
            (
                ax.set_xticks([]),
                ax.set_yticks([]),
            )  # no axis to read: the panel only says what is missing
            continue
        plots.integer_axis(ax)
        for run, g in steps.groupby("run", sort=False):
            g = g.dropna(subset=[col])
            ax.plot(
                g["step"], g[col], marker="." if len(g) < 30 else None, label=run, linewidth=1.2
            )
        if scale == "log" and (steps[col].dropna() > 0).all():
            ax.set_yscale("log")
    ax = axes.flat[0]
    if not events.empty:
        for kind, marker in MARKERS.items():
            e = events[events["kind"] == kind]
            if not e.empty and not steps.empty and steps["loss"].notna().any():
                y = steps["loss"].dropna().max()
                ax.scatter(
                    e["step"], [y] * len(e), marker=marker, color="crimson", label=kind, zorder=5
                )
    handles, labels = axes.flat[0].get_legend_handles_labels()
    plots.legend_outside(axes[0][-1], "run", handles=handles, labels=labels)
    return plots.save(fig, out)


def page(png: Path, run_dirs: list[Path], events: pd.DataFrame) -> str:
    img = base64.b64encode(png.read_bytes()).decode()
    runs = "".join(f"<li>{html.escape(str(d))}</li>" for d in run_dirs)
    ev = "<p>no NaN, recovery or alert events</p>"
    if not events.empty:
        cols = [
            c for c in ("run", "step", "kind", "action", "alert", "message", "rank") if c in events
        ]
        ev = events[cols].to_html(index=False, na_rep="", border=0)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>fp8-train "
        "dashboard</title><style>body{font-family:sans-serif;margin:2em}td,th{padding:2px "
        "8px}</style></head><body><h1>Training health</h1><img "
        f"src='data:image/png;base64,{img}' "
        f"style='max-width:100%'><h2>Runs</h2><ul>{runs}</ul><h2>Events</h2>{ev}</body></html>"
    )


def render(
    run_dirs: list[Path], out_dir: Path, configs: dict[Path, dict] | None = None
) -> tuple[Path, Path]:
    import yaml

    run_dirs = [Path(d) for d in run_dirs]
    configs = configs or {
        d: yaml.safe_load((d / "config.yaml").read_text())
        for d in run_dirs
        if (d / "config.yaml").exists()
    }
    steps, events = frames(run_dirs, configs)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(steps, events, out_dir / "dashboard.png")
    page_path = out_dir / "dashboard.html"
    page_path.write_text(page(png, run_dirs, events))
    print(f"wrote dashboard {page_path}", flush=True)
    return png, page_path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fp8_train dashboard", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "runs", nargs="+", help="run directories (or folders above them, e.g. a multirun)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write dashboard.png/html (default: the first run, "
        "or the folder given when it holds several runs)",
    )
    args = parser.parse_args(argv)
    runs = require_complete(args.runs, "a dashboard")
    out = args.out or (runs[0].path if len(runs) == 1 else Path(args.runs[0]))
    render([r.path for r in runs], out, {r.path: r.config for r in runs})
