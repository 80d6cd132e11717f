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


def save(fig, path: str | Path, quiet: bool = False, dpi: int = 120, reproducible: bool = False) -> Path:
    """Lay out, write and close ``fig``. ``reproducible``: no version string in the PNG, so the same
    figure gives the same bytes on every machine (the committed guide plots)."""
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, **({"metadata": {"Software": None}} if reproducible else {}))
    plt.close(fig)
    if not quiet:
        print(f"wrote plot {path}", flush=True)
    return path


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
