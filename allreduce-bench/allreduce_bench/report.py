"""After the ranks: the nccl-tests table, CSV, plots and the α–β fits."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd

from allreduce_bench import fit as abfit
from dtrain.core.terminal import WIDTH
from dtrain.results import plots
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RECORDS

CSV = "collectives.csv"
BUSBW_PLOT = "busbw_vs_size.png"
FIT_PLOT = "alpha_beta_fit.png"
MODES = ("out_of_place", "in_place")
BLOCK_KEYS = ["link_class", "dtype", "collective"]


def load_records(run_dir: Path) -> pd.DataFrame:
    rows = [r for r in read_jsonl(Path(run_dir) / RECORDS) if r.get("kind") == "collective"]
    return pd.DataFrame(rows)


def fit_mode(df: pd.DataFrame, collective: str) -> str:
    """The mode a collective is fitted and plotted in: out-of-place (nccl-tests' headline) when
    measured."""
    modes = set(df.loc[df.collective == collective, "mode"])
    return "out_of_place" if "out_of_place" in modes else "in_place"


# nccl-tests' columns, one space apart so a row fits dtrain.core.terminal.WIDTH (100) columns: the
# identifying columns (42) and one (time, algbw, busbw, #wrong) block (29) per mode
ID_WIDTHS = {"size": 10, "count": 10, "type": 8, "redop": 5, "root": 4}
CELL = " {:>7} {:>6} {:>6} {:>6}"


def _time(us: float) -> str:
    """At most 7 characters: two decimals below 10 ms, fewer above (10 s = 10000000 us is 8)."""
    return f"{us:.2f}" if us < 1e4 else f"{us:.1f}" if us < 1e5 else f"{us:.0f}"


def _cell(row) -> str:
    if row is None:
        return CELL.format("N/A", "N/A", "N/A", "N/A")
    t = row["time_us"]
    wrong = (
        "N/A"
        if row["wrong"] is None or (isinstance(row["wrong"], float) and math.isnan(row["wrong"]))
        else int(row["wrong"])
    )
    return CELL.format(_time(t), f"{row['algbw_GBps']:.2f}", f"{row['busbw_GBps']:.2f}", wrong)


def _ids(*values) -> str:
    return " ".join(f"{v:>{w}}" for v, w in zip(values, ID_WIDTHS.values()))


def nccl_table(df: pd.DataFrame) -> str:
    """One nccl-tests-style block per (link class, dtype, collective)."""
    out = []
    for (link_class, dtype, collective), block in df.groupby(BLOCK_KEYS, sort=False):
        first = block.iloc[0]
        ids = sum(ID_WIDTHS.values()) + len(ID_WIDTHS) - 1
        title = (
            f"# {collective}  link_class={link_class}  {int(first.group_size)} ranks/group x "
            f"{int(first.groups)} group(s)  dtype={dtype}  iters={int(first.iters)} "
            f"warmup={int(first.warmup)}"
        )
        out += textwrap.wrap(title, WIDTH, subsequent_indent="#   ", break_on_hyphens=False)
        names = (
            _ids("size", "count", "type", "redop", "root")
            + CELL.format("time", "algbw", "busbw", "#wrong") * 2
        )
        units = (
            _ids("(B)", "(elements)", "", "", "") + CELL.format("(us)", "(GB/s)", "(GB/s)", "") * 2
        )
        out += [
            f"#{'':{ids - 1}}{'out-of-place':^29}{'in-place':^29}".rstrip(),
            "#" + names[1:],
            ("#" + units[1:]).rstrip(),
        ]
        for nbytes, rows in block.groupby("nbytes", sort=True):
            by_mode = {r["mode"]: r for _, r in rows.iterrows()}
            r = rows.iloc[0]
            out.append(
                _ids(int(nbytes), int(r["count"]), r["type"], r["redop"], int(r["root"]))
                + "".join(_cell(by_mode.get(m)) for m in MODES)
            )
        main = block[block["mode"] == fit_mode(df, collective)]
        out += [
            f"# Avg bus bandwidth    : {main['busbw_GBps'].mean():.4g} GB/s "
            f"({fit_mode(df, collective)})",
            "",
        ]
    return "\n".join(out)


def fits(df: pd.DataFrame, theoretical: dict[str, float | None]) -> tuple[list[dict], list[dict]]:
    """One α–β fit per (collective, link class, dtype), in the guide's schema; and the blocks
    that gave no line (fewer than 2 sizes, one rank, or times falling with size: noise)."""
    out, unfitted = [], []
    for (link_class, dtype, collective), block in df.groupby(BLOCK_KEYS, sort=False):
        rows = block[block["mode"] == fit_mode(df, collective)].sort_values("nbytes")
        c = float(rows["bus_factor"].iloc[0])
        f = abfit.fit_alpha_beta(rows["nbytes"], rows["time_us"] * 1e-6, c)
        if f is None:
            reason = (
                "bus factor 0 (one rank)"
                if c == 0
                else "fewer than 2 sizes"
                if len(rows) < 2
                else "time does not grow with size (noise or too few sizes)"
            )
            unfitted.append(
                {
                    "collective": collective,
                    "link_class": link_class,
                    "dtype": dtype,
                    "reason": reason,
                }
            )
            continue
        theo = theoretical.get(link_class)
        out.append(
            {
                "collective": collective,
                "link_class": link_class,
                "alpha_us": f.alpha_us,
                "beta_GBps": f.beta_GBps,
                "r2": f.r2,
                "n_points": f.n_points,
                "algo_factor": c,
                "dtype": dtype,
                "world_size": int(rows["group_size"].iloc[0]),
                "theoretical_GBps": theo,
                "beta_pct_of_theoretical": 100 * f.beta_GBps / theo if theo else None,
                "mode": fit_mode(df, collective),
                "alpha_clamped": f.alpha_clamped,
                "groups": int(rows["groups"].iloc[0]),
            }
        )
    return out, unfitted


def peak_busbw(df: pd.DataFrame) -> dict[str, float]:
    """Best busbw per collective over the widest link class measured (the whole job)."""
    widest = "world" if "world" in set(df.link_class) else df.link_class.iloc[0]
    part = df[df.link_class == widest]
    return {c: float(g["busbw_GBps"].max()) for c, g in part.groupby("collective", sort=False)}


def plot_busbw(df: pd.DataFrame, path: Path) -> Path:
    import seaborn as sns

    classes = list(dict.fromkeys(df.link_class))
    fig, axes = plots.figure(ncols=len(classes))
    for ax, link_class in zip(axes[0], classes):
        part = df[
            (df.link_class == link_class)
            & (df["mode"] == df.collective.map(lambda c: fit_mode(df, c)))
        ]
        sns.lineplot(
            data=part,
            x="nbytes",
            y="busbw_GBps",
            hue="collective",
            style="dtype" if part.dtype.nunique() > 1 else None,
            marker="o",
            ax=ax,
        )
        plots.log2_bytes_axis(ax)
        ax.set(
            xlabel="message size S",
            ylabel="bus bandwidth (GB/s)",
            title=f"busbw vs size ({link_class})",
        )
        if ax is not axes[0][-1]:
            ax.get_legend().remove()
    plots.legend_outside(
        axes[0][-1]
    )  # one legend, right of the last panel: the collectives are the same
    return plots.save(fig, path)


def plot_fits(df: pd.DataFrame, fitted: list[dict], path: Path) -> Path:
    """Measured time per op and the fitted t(S) = α + S·c/β, log-log: how well the model holds."""
    import numpy as np
    import seaborn as sns

    classes = list(dict.fromkeys(df.link_class))
    fig, axes = plots.figure(ncols=len(classes))
    colors = dict(
        zip(dict.fromkeys(df.collective), sns.color_palette("colorblind", df.collective.nunique()))
    )
    for ax, link_class in zip(axes[0], classes):
        for f in (f for f in fitted if f["link_class"] == link_class):
            rows = df[
                (df.link_class == link_class)
                & (df.collective == f["collective"])
                & (df.dtype == f["dtype"])
                & (df["mode"] == f["mode"])
            ].sort_values("nbytes")
            s = np.geomspace(rows.nbytes.min(), rows.nbytes.max(), 50)
            model = f["alpha_us"] + s * f["algo_factor"] / (f["beta_GBps"] * 1e3)
            ax.plot(
                rows.nbytes, rows.time_us, "o", color=colors[f["collective"]], label=f["collective"]
            )
            ax.plot(s, model, "-", color=colors[f["collective"]], alpha=0.6)
        plots.log2_bytes_axis(ax)
        plots.log_axis_plain(ax, "y")
        ax.set(
            xlabel="message size S",
            ylabel="time per op (µs)",
            title=f"α–β fit ({link_class}; lines = fit)",
        )
    plots.legend_outside(axes[0][-1], "collective")
    return plots.save(fig, path)


def print_fits(fitted: list[dict]) -> None:
    from rich.table import Table

    from dtrain.core.terminal import console

    table = Table(title="α–β fit: t(S) = α + S·c/β  (β is a bus bandwidth)")
    for col in (
        "collective",
        "link class",
        "dtype",
        "ranks",
        "α (µs)",
        "β (GB/s)",
        "R²",
        "points",
        "β % of link",
    ):
        table.add_column(
            col, justify="right" if col not in ("collective", "link class", "dtype") else "left"
        )
    for f in fitted:
        pct = (
            "n/a"
            if f["beta_pct_of_theoretical"] is None
            else f"{f['beta_pct_of_theoretical']:.0f}%"
        )
        table.add_row(
            f["collective"],
            f["link_class"],
            f["dtype"],
            str(f["world_size"]),
            f"{f['alpha_us']:.1f}" + ("*" if f["alpha_clamped"] else ""),
            f"{f['beta_GBps']:.3g}",
            f"{f['r2']:.3f}",
            str(f["n_points"]),
            pct,
        )
    console().print(table)
