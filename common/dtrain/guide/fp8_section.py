"""The guide's *FP8* section: the FP8 layout and speed of a few matrix cells, delayed and dynamic
scaling."""

from __future__ import annotations

from dtrain.costmodel import search
from dtrain.costmodel.calibrate import CalibrationReport
from dtrain.costmodel.stack import Stack

from .markdown import md_cell
from .matrix import GLOBAL_BATCH, SEQ_LEN, Cell, cluster_for
from .models import shape as model_shape


def fp8_section(report: CalibrationReport, cells: list[Cell], gpu: str) -> list[str]:
    """The FP8 layout and speed of a few matrix cells, with each scaling's cast cost
    (``Stack.fp8_scaling``)."""
    out = [
        "## FP8",
        "",
        "Predicted effect of FP8 compute on a few cells (NVLink node, IB 400 Gbit/s): the block "
        "linears' GEMMs in FP8 at the GPU's FP8 curve, their casts at `FP8_CAST_BYTES` by "
        "scaling, delayed (TransformerEngine, Megatron: casts fused into the kernels that make "
        "the tensors) or dynamic (torchao's float8 training, torchtitan and dtrain: a global amax "
        "before each cast, measured on an H200):",
        "",
        "| model | GPUs | BF16 layout | BF16 tokens/s | FP8 layout, delayed | FP8 tokens/s, "
        "delayed | gain | FP8 tokens/s, dynamic | gain |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for p, g in ((8e9, 64), (70e9, 1024), (405e9, 4096)):
        c = next(
            (
                x
                for x in cells
                if x.params == p and x.gpus == g and x.topology == "NVLink" and x.ib_gbit == 400
            ),
            None,
        )
        if c is None or not c.fits:
            continue
        shape = model_shape(p, SEQ_LEN)
        cluster = cluster_for(gpu, g, "NVLink", 400, report.cluster_links)
        delayed, dynamic = (
            search(
                shape,
                cluster,
                GLOBAL_BATCH,
                report.cluster,
                precision="fp8",
                prune=True,
                stack=Stack(fp8_scaling=s),
            ).best
            for s in ("delayed", "dynamic")
        )
        if delayed is None or dynamic is None:
            continue
        out.append(
            f"| {c.model} | {g} | {c.layout} Z{c.zero} | {c.tokens_per_s:,.0f} | "
            f"{delayed.dp}×{delayed.tp}×{delayed.pp} Z{delayed.zero_stage} | "
            f"{delayed.time.tokens_per_s:,.0f} | "
            f"{delayed.time.tokens_per_s / c.tokens_per_s - 1:+.0%} | "
            f"{dynamic.time.tokens_per_s:,.0f} | "
            f"{dynamic.time.tokens_per_s / c.tokens_per_s - 1:+.0%} |"
        )
    layers, prov = report.keep_bf16
    out += [
        "",
        f"Keep in BF16: {', '.join(f'`{x}`' for x in layers) or 'none'} ({md_cell(prov)}).",
        "",
    ]
    return out
