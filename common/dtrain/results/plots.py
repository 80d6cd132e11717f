"""One seaborn look for every plot of the project, and one way to save them (path printed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: ranks and CI have no display

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402


def style() -> None:
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 4.2):
    style()
    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def save(
    fig, path: str | Path, quiet: bool = False, dpi: int = 120, reproducible: bool = False
) -> Path:
    """Lay out, write and close ``fig`` (a legend outside the axes is kept in the picture).
    ``reproducible``:
    no version string in the PNG, so the same figure gives the same bytes on every machine (the
    committed guide plots)."""
    path = Path(path)
    fig.tight_layout()
    fig.savefig(
        path,
        dpi=dpi,
        bbox_inches="tight",
        **({"metadata": {"Software": None}} if reproducible else {}),
    )
    plt.close(fig)
    if not quiet:
        print(f"wrote plot {path}", flush=True)
    return path


def legend_outside(ax, title: str | None = None, **kw):
    """The legend to the right of the axes, never over the data (plots.save lays the figure out
    around it)."""
    handles, labels = kw.pop("handles", None), kw.pop("labels", None)
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    return ax.legend(
        handles,
        labels,
        title=title,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        fontsize=8,
        title_fontsize=8,
        frameon=False,
        **kw,
    )


def integer_axis(ax, axis: str = "x") -> None:
    """Ticks at whole numbers only (steps, ranks, GPUs)."""
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def log_axis_plain(ax, axis: str = "x", scale: float = 1.0) -> None:
    """A log axis labelled with plain numbers at 1, 2, 5 per decade (x `scale`, e.g. 1e3 for s ->
    ms) and no minor labels, so labels never run into each other on a narrow range."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v * scale:g}"))
    target.set_minor_formatter(NullFormatter())


def log2_bytes_axis(ax, axis: str = "x") -> None:
    """Message-size axes read best as powers of two with B/KiB/MiB/GiB labels."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: human_bytes(v))
    if axis == "x":
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(fmt)
    else:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(fmt)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
