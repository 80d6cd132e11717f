"""`dtrain backtest --moe`: the MoE cost model (``moe_cost.py``) against published MoE training runs
(``moe_backtest_runs.yaml``: only the sources issue 41 released; every other run is held out).

Per row: the predicted tokens/s per GPU of the published layout (ep included) against the reported
one (a reported TFLOP/s converted with Megatron's MoE FLOP rule, GPU hours per trillion tokens
inverted), whether it is predicted to fit, and the MoE terms of its step. Leave-one-source-out as
for the dense rows (``backtest``): a row is predicted with the two fitted numbers (``dp_overlap``,
``link_efficiency``, over ``backtest_fit.FIT_GRID``) that minimise the squared log error over every
dense row and the OTHER sources' MoE rows, so no source tunes its own prediction.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

import yaml

from dtrain.core import terminal
from dtrain.model.flops import MLA

from . import backtest_cli as dense_cli
from .backtest import WITHIN
from .backtest_fit import FIT_GRID, _best, _log_errors, calibration
from .hardware import Cluster, GiB
from .moe_model import MoEModel, MoESpec
from .moe_search import MoEPlan, price
from .published_runs import load_rows, row_cluster, row_layout, row_shape
from .shapes import Layout
from .stack import Stack


@dataclass(frozen=True)
class MoESetup:
    model: MoEModel
    cluster: Cluster
    layout: Layout
    precision: str
    stack: Stack


@dataclass(frozen=True)
class MoERow:
    name: str
    group: str
    source: str
    reported_tps: float
    predicted_tps: float
    fits: bool
    memory_gib: float
    hbm_gib: float
    layout: str
    terms: dict = field(default_factory=dict)
    fitted: dict = field(default_factory=dict)

    @property
    def error(self) -> float:
        return self.predicted_tps / self.reported_tps - 1


@lru_cache(maxsize=1)
def load_moe_rows() -> tuple[dict, ...]:
    path = resources.files(__package__).joinpath("moe_backtest_runs.yaml")
    return tuple(yaml.safe_load(path.read_text(encoding="utf-8")))


def moe_setup(row: dict) -> MoESetup:
    e, lay = row["moe"], row["layout"]
    base = row_shape(row)
    spec = MoESpec(
        e["experts"],
        e["top_k"],
        e["expert_ffn"],
        e.get("shared", 0),
        e.get("shared_ffn", 0),
        e.get("dense_layers", 0),
        e.get("imbalance", 1.0),
        e.get("dispatcher", "alltoall"),
        bool(e.get("a2a_overlap")),
    )
    mla = MLA(**e["mla"]) if "mla" in e else None
    model = MoEModel(base, spec, e.get("head_dim", 0), mla, row["name"])
    cluster = row_cluster(row)
    return MoESetup(
        model, cluster, row_layout(lay), row.get("precision", "bf16"), Stack(**row.get("stack", {}))
    )


def reported_tps(row: dict, model: MoEModel) -> float:
    """Tokens/s per GPU as the source reports it."""
    rep = row["reported"]
    if "tokens_per_s_per_gpu" in rep:
        return float(rep["tokens_per_s_per_gpu"])
    if "gpu_hours_per_trillion_tokens" in rep:
        return 1e12 / (rep["gpu_hours_per_trillion_tokens"] * 3600)
    if "step_time_s" in rep:
        gb = row["layout"]["global_batch"]
        return gb * model.base.seq_len / rep["step_time_s"] / row["gpus"]
    return rep["tflops_per_gpu"] * 1e12 / model.flops_per_token()


def predict(s: MoESetup, fitted: dict) -> tuple[MoEPlan, Cluster]:
    calib, links = calibration(fitted)
    cluster = links.apply(s.cluster)
    act = calib.fp8_memory_factor.value if s.precision != "bf16" else 1.0
    return price(s.model, s.layout, cluster, calib, s.precision, s.stack, act), cluster


def _moe_log_errors(rows: tuple[dict, ...]) -> dict:
    """|log(predicted / reported)| of every MoE row at every grid point."""
    pts = [(moe_setup(r), r) for r in rows]
    out = {}
    for ov in FIT_GRID["dp_overlap"]:
        for eff in FIT_GRID["link_efficiency"]:
            f = {"dp_overlap": ov, "link_efficiency": eff}
            out[ov, eff] = [
                abs(
                    math.log(
                        predict(s, f)[0].time.tokens_per_s
                        / s.layout.gpus
                        / reported_tps(r, s.model)
                    )
                )
                for s, r in pts
            ]
    return out


@lru_cache(maxsize=1)
def _dense_errors() -> dict:
    """Every dense row's log errors over the grid (``backtest_fit._log_errors``), AsyncTP's share at
    its default."""
    return _log_errors(tuple(r for r in load_rows() if not r.get("expect_oom")))


def moe_loso_fits(rows: tuple[dict, ...]) -> dict[str, dict]:
    """Per MoE source: the grid point fitted to every dense row and the OTHER MoE sources' rows."""
    dense, moe = _dense_errors(), _moe_log_errors(rows)
    out = {}
    for g in sorted({r["group"] for r in rows}):
        keep = [True] * len(next(iter(dense.values()))) + [r["group"] != g for r in rows]
        errors = {k: dense[k] + moe[k] for k in dense}
        out[g] = _best(errors, keep)
    return out


def moe_backtest(loo: bool = True) -> list[MoERow]:
    rows = load_moe_rows()
    fits = moe_loso_fits(rows) if loo else {}
    out = []
    for row in rows:
        s = moe_setup(row)
        fitted = fits.get(row["group"], {})
        plan, cluster = predict(s, fitted)
        t, m = plan.time, plan.moe
        out.append(
            MoERow(
                row["name"],
                row["group"],
                row["source"],
                reported_tps(row, s.model),
                t.tokens_per_s / s.layout.gpus,
                plan.memory.fits(cluster.gpu.hbm_bytes, 0.0),
                plan.memory.total / GiB,
                cluster.gpu.hbm_gib,
                plan.describe(),
                terms={
                    "compute": t.compute,
                    "expert_gemm": m.expert_gemm,
                    "all_to_all_exposed": m.exposed_all_to_all,
                    "expert_dp": m.expert_dp,
                    "tp_comm": t.tp_comm,
                    "bubble": t.bubble,
                    "dp_exposed": t.dp_comm_exposed,
                    "step": t.total,
                },
                fitted=fitted,
            )
        )
    return out


def moe_summary(rows: list[MoERow]) -> dict:
    errs = [abs(r.error) for r in rows]
    return {
        "rows": len(rows),
        "median_abs_error": statistics.median(errs) if errs else None,
        "within_15pct": sum(e <= WITHIN for e in errs),
        "fit": sum(r.fits for r in rows),
    }


def moe_text_lines(rows: list[MoERow], loso: bool = True) -> list[str]:
    how = "leave-one-source-out" if loso else "in-sample"
    out = [f"MoE rows ({how}): predicted vs reported tokens/s per GPU", ""]
    for r in rows:
        out += [
            r.name,
            f"  {r.layout}",
            f"  reported {r.reported_tps:,.0f}, predicted {r.predicted_tps:,.0f} "
            f"({r.error:+.0%}); memory {r.memory_gib:.0f} of {r.hbm_gib:g} GiB"
            + ("" if r.fits else " (!)")
            + f"; exposed all-to-all {r.terms['all_to_all_exposed'] / r.terms['step']:.0%} of "
            "the step",
        ]
    s = moe_summary(rows)
    if s["rows"]:
        out += [
            "",
            f"MoE: median |error| {s['median_abs_error']:.1%}; within 15%: {s['within_15pct']} "
            f"of {s['rows']}; predicted to fit: {s['fit']} of {s['rows']}",
        ]
    return out


def moe_json(rows: list[MoERow]) -> dict:
    return {
        "rows": [dict(vars(r), error=r.error) for r in rows],
        "summary": moe_summary(rows),
    }


def run(a) -> int:
    """`dtrain backtest --moe`."""
    rows = moe_backtest(loo=not a.in_sample)
    if a.json:
        print(json.dumps(moe_json(rows), indent=2, sort_keys=True))
    else:
        width = terminal.width()
        for line in moe_text_lines(rows, loso=not a.in_sample):
            print("\n".join(textwrap.wrap(line, width, subsequent_indent="  ") or [""]))
    return 0


def add_parser(sub) -> None:
    """`dtrain backtest` (``backtest_cli.add_parser``) with ``--moe``: the MoE rows instead."""
    dense_cli.add_parser(sub)
    p = sub.choices["backtest"]
    p.add_argument(
        "--moe",
        action="store_true",
        help="the MoE rows instead (moe_backtest_runs.yaml: dtrain plan --experts against them)",
    )
    p.set_defaults(func=lambda a: run(a) if a.moe else dense_cli.run(a))
