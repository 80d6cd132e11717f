"""The published runs of ``backtest_runs.yaml`` as the cost model sees them: each row's model, GPUs,
layout, batch, precision and software stack (``Setup``), and the throughput its source reports.
One reader of a row's model and GPUs (``row_shape``, ``row_cluster``), for the dense and the MoE
backtests alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

import yaml

from .stack import Stack
from .hardware import Cluster, get_profile
from .shapes import Layout, ModelShape
from .token_flops import model_flops_per_token


@dataclass(frozen=True)
class Setup:
    """One row as the model sees it."""

    shape: ModelShape
    cluster: Cluster  # datasheet links (the fitted efficiency is applied per prediction)
    layout: Layout
    global_batch: int
    precision: str
    stack: Stack


@lru_cache(maxsize=1)
def load_rows() -> tuple[dict, ...]:
    text = resources.files(__package__).joinpath("backtest_runs.yaml").read_text(encoding="utf-8")
    return tuple(yaml.safe_load(text))


def row_shape(row: dict) -> ModelShape:
    """A published row's model (its ``model`` entry), dense and MoE rows alike."""
    m = row["model"]
    return ModelShape(
        m["layers"],
        m["hidden"],
        m["heads"],
        m["kv_heads"],
        m["vocab"],
        m["seq"],
        m["ffn"] / m["hidden"],
        bool(m.get("gated")),
        name=row["name"],
        dropout=bool(m.get("dropout")),
        rotary=m.get("rotary", True),
    )


def row_cluster(row: dict) -> Cluster:
    """A published row's GPUs: the profile with the row's own HBM and power where it gives them."""
    prof = replace(
        get_profile(row["gpu"]),
        **{k: row[k] for k in ("hbm_gib", "hbm_tbps", "power_w") if k in row},
    )
    return Cluster.from_profile(
        prof, row["gpus"], row["gpus_per_node"], ib_gbit_per_gpu=row.get("ib_gbit_per_gpu")
    )


def row_setup(row: dict) -> Setup:
    lay = row["layout"]
    shape = row_shape(row)
    cluster = row_cluster(row)
    gb = lay["global_batch"]
    return Setup(
        shape,
        cluster,
        row_layout(lay),
        gb,
        row.get("precision", "bf16"),
        Stack(**row.get("stack", {})),
    )


def row_layout(lay: dict) -> Layout:
    """A published row's ``layout`` (dp, tp, pp, zero, recompute, mb, global_batch; cp, ep, etp,
    sp, schedule, v, cp_impl, split where the row gives them) as the one Layout type, dense and
    MoE rows alike."""
    return Layout(
        dp_shard=lay["dp"],
        cp=lay.get("cp", 1),
        tp=lay["tp"],
        pp=lay["pp"],
        ep=lay.get("ep", 1),
        etp=lay.get("etp", 1),
        zero_stage=lay["zero"],
        recompute=lay["recompute"],
        micro_batch=lay["mb"],
        grad_accum=lay["global_batch"] // (lay["dp"] * lay["mb"]),
        sequence_parallel=bool(lay.get("sp", False)),
        pp_schedule=lay.get("schedule", "1f1b"),
        pp_virtual=lay.get("v", 1),
        cp_impl=lay.get("cp_impl", "ring"),
        pp_split=lay.get("split", "layers"),
    )


def reported_tps(row: dict, shape: ModelShape) -> float | None:
    """Tokens/s per GPU as the source reports it, a TFLOP/s converted with the source's FLOP
    count."""
    rep = row.get("reported")
    if not rep:
        return None
    if "tokens_per_s_per_gpu" in rep:
        return float(rep["tokens_per_s_per_gpu"])
    if "step_time_s" in rep:
        return row["layout"]["global_batch"] * shape.seq_len / rep["step_time_s"] / row["gpus"]
    flops = {
        "model": model_flops_per_token(shape),
        "megatron_recompute": 96
        * shape.n_layer
        * shape.d_model**2
        * (
            1
            + shape.seq_len / (6 * shape.d_model)
            + shape.vocab / (16 * shape.n_layer * shape.d_model)
        ),
        "neox_2022": 6 * shape.num_params() + 60 * shape.n_layer * shape.d_model * shape.seq_len,
    }
    return rep["tflops_per_gpu"] * 1e12 / flops[rep["flops"]]
