"""The guide's *Calibration* section: every empirical input of the cost model, the value the GPU
matrix uses and the value measured on this machine, each with its provenance."""

from __future__ import annotations

from dataclasses import fields

from dtrain.costmodel.calibrate import CalibrationReport
from dtrain.costmodel.calibration import Calibration

from .markdown import md_cell

# (name, label, format) of every Calibration field, in its order: a new field gets its row here
PARAM_NAMES = [(f.name, f.metadata["label"], f.metadata["fmt"]) for f in fields(Calibration)]
LINK_NAMES = [
    ("intra_alpha_s", "intra-node latency α per hop", lambda v: f"{v * 1e6:.1f} µs"),
    ("intra_efficiency", "intra-node achieved share of nominal β", lambda v: f"{v:.0%}"),
    ("inter_alpha_s", "inter-node latency α per hop", lambda v: f"{v * 1e6:.1f} µs"),
    ("inter_efficiency", "inter-node achieved share of nominal β", lambda v: f"{v:.0%}"),
]


def calibration_table(report: CalibrationReport) -> list[str]:
    out = [
        "## Calibration",
        "",
        "Every empirical input of the cost model, the value the GPU decision matrix uses and "
        "where it comes from, beside the value measured on this machine (used for the "
        "predicted-vs-measured check). *measured here* = a run directory of this project; "
        "*datasheet/published* = the cited source.",
        "",
        "| parameter | GPU matrix uses | provenance | this machine | provenance |",
        "|---|---:|---|---:|---|",
    ]
    for name, label, fmt in PARAM_NAMES:
        c, lo = getattr(report.cluster, name), getattr(report.local, name)
        out.append(
            f"| {label} | {fmt.format(c.value)} | {md_cell(c.provenance)} | "
            f"{fmt.format(lo.value)} | "
            f"{md_cell(lo.provenance) if lo.measured else 'same'} |"
        )
    for name, label, fmt in LINK_NAMES:
        c = getattr(report.cluster_links, name)
        local = _local_link(report, name)
        out.append(
            f"| {label} | {fmt(c.value)} | {md_cell(c.provenance)} | {local[0]} | "
            f"{md_cell(local[1])} |"
        )
    layers, prov = report.keep_bf16
    llayers, lprov = report.keep_bf16_local
    out.append(
        f"| layers to keep in BF16 under FP8 | {', '.join(f'`{x}`' for x in layers) or 'none'} | "
        f"{md_cell(prov)} | {', '.join(f'`{x}`' for x in llayers) or 'none'} | "
        f"{md_cell(lprov) if lprov != prov else 'same'} |"
    )
    out += [
        "",
        "Link rates themselves are the matrix's axes (NVLink / PCIe from `hardware.yaml`, IB "
        "100–800 Gbit/s); calibration scales them by the achieved share and sets α. Peak FLOP/s "
        "and HBM are datasheet figures (`common/dtrain/costmodel/hardware.yaml`, each with its "
        "source).",
        "",
    ]
    return out


def _local_link(report: CalibrationReport, name: str) -> tuple[str, str]:
    cls, what = name.split("_", 1)
    link, src = report.local_links.get(cls), report.local_sources.get(cls)
    if link is None:
        return "–", "not measured here" + (
            " (one host: no inter-node link)" if cls == "inter" else ""
        )
    if what == "alpha_s":
        return f"{link.alpha_s * 1e6:.1f} µs", src.provenance("all_reduce α–β fit")
    return f"β = {link.beta_Bps / 1e9:.2f} GB/s", src.provenance(
        "all_reduce α–β fit (bus bandwidth)"
    )
