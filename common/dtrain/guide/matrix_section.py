"""The guide's *Decision matrix* section: one table per model (GPUs x node type x InfiniBand rate),
with the backtest's error figures beside it (``≈`` ties, ``⚠`` memory)."""

from __future__ import annotations

from dtrain.costmodel.uncertainty import ErrorBand

from .matrix import (
    GPU_COUNTS,
    IB_GBITS,
    MODELS,
    SEQ_LEN,
    TOPOLOGIES,
    Cell,
    cell_text,
    model_label,
)
from .models import shape as model_shape


def uncertainty_note(band: ErrorBand, cells: list[Cell]) -> list[str]:
    """The backtest's error figures beside the matrix, and how many cells each marker flags."""
    fit = [c for c in cells if c.fits]
    ties = sum("≈" in cell_text(c, band) for c in fit)
    risky = sum("⚠" in cell_text(c, band) for c in fit)
    hbm = max((c.hbm_gib for c in fit), default=0.0)
    return [
        f"**How far to trust a cell.** Against the {band.rows} published runs of the backtest "
        f"(below, `dtrain backtest`) the predicted throughput has a median |error| of "
        f"{band.time:.1%}, and the predicted memory is {band.memory_low:+.0%} to "
        f"{band.memory_high:+.0%} of the peak the {band.memory_rows} rows that print one report. "
        f"So `≈` marks a cell whose fastest other DP×TP×PP layout (named on the cell's third "
        f"line, with how much slower it is predicted) is within {band.time:.1%}: a tie the model "
        "cannot break, measure both; knob variants of the same layout (micro-batch, ZeRO stage, "
        "recompute) are often within it too (`dtrain plan` lists them). `⚠` marks memory that "
        f"would not fit in the {hbm:g} GiB of HBM if the model is as low as its worst row "
        f"({band.memory_low:+.0%}: above {hbm * (1 + band.memory_low):.0f} GiB predicted): such "
        f"a cell may run out of memory; keep a layout with more headroom at hand. {ties} of "
        f"{len(fit)} cells that fit carry `≈`, {risky} carry `⚠`.",
        "",
    ]


def matrix_tables(cells: list[Cell], band: ErrorBand | None = None) -> list[str]:
    by_key = {(c.params, c.gpus, c.topology, c.ib_gbit): c for c in cells}
    cols = [(t, ib) for t in TOPOLOGIES for ib in IB_GBITS]
    out = ["## Decision matrix", ""] + (uncertainty_note(band, cells) if band else [])
    for p in MODELS:
        shape = model_shape(p, SEQ_LEN)
        out += [
            f"### {model_label(p)} — {shape.name} ({shape.num_params() / 1e9:.1f}B parameters, "
            f"{shape.n_layer} layers, d_model {shape.d_model}, {shape.n_head} heads / "
            f"{shape.n_kv_head} KV)",
            "",
            "| GPUs | " + " | ".join(f"{t} · IB {ib}" for t, ib in cols) + " |",
            "|---:|" + "---|" * len(cols),
        ]
        for g in GPU_COUNTS:
            out.append(
                f"| {g} | "
                + " | ".join(cell_text(by_key[(p, g, t, ib)], band) for t, ib in cols)
                + " |"
            )
        out.append("")
    return out
