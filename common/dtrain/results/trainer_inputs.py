"""The guide-input records of a ``dtrain.train.Trainer`` run, from its ``run()`` result: every
trainer user publishes through ``training_inputs`` (its ``training`` record) and ``moe_inputs``
(an MoE model's ``moe_run`` record)."""

from __future__ import annotations

import dataclasses
import math

from dtrain.core.layout import Layout
from dtrain.results.contract_records import (
    MoeMeasurement,
    StepBreakdown,
    TrainingMeasurement,
    Where,
)


def training_inputs(
    result: dict,
    model: dict,
    layout: Layout,
    where: Where,
    precision: str | None = None,
    recipe: str | None = None,
    overlap: dict | None = None,
    breakdown: dict | None = None,
    step_callbacks=(),
) -> list[TrainingMeasurement]:
    """The record of one ``dtrain.train.Trainer`` run from its ``run()`` result (every trainer user
    publishes through this): ``model`` is the GPTConfig as a dict, ``layout`` the run's
    (``TrainConfig.layout`` of the config it ran), ``overlap``/``breakdown`` a profile window's
    results when one ran, ``step_callbacks`` the per-step tools the run had on beyond training.
    [] when the run timed no step (all steps were warmup): there is no measurement to publish."""
    if not all(
        isinstance(result.get(k), (int, float)) and math.isfinite(result[k])
        for k in ("step_time_s", "tokens_per_s")
    ):
        return []
    ov = overlap or {}
    return [
        TrainingMeasurement(
            model=dict(model),
            layout=layout,
            strategy=str(result["strategy"]),
            precision=str(precision or result["mixed_precision"]),
            step_time_s=float(result["step_time_s"]),
            tokens_per_s=float(result["tokens_per_s"]),
            peak_mem_bytes=int(result["peak_mem_bytes"]),
            where=where,
            recipe=recipe,
            mfu=result.get("mfu"),
            peak_flops=result.get("peak_flops"),
            peak_flops_source=result.get("peak_flops_source"),
            model_params=result.get("model_params"),
            flops_per_token=result.get("flops_per_token"),
            comm_s=ov.get("comm_s"),
            exposed_comm_s=ov.get("exposed_comm_s"),
            overlap_fraction=ov.get("overlap_fraction"),
            breakdown=_breakdown(breakdown),
            step_callbacks=list(step_callbacks),
        )
    ]


def moe_inputs(
    result: dict, model: dict, layout: Layout, where: Where, breakdown: dict | None
) -> list[MoeMeasurement]:
    """The ``moe_run`` record of a trainer run of an MoE model ([] for a dense model, or without a
    profiled breakdown to take the all-to-all time from)."""
    b = breakdown or {}
    if not model.get("moe") or not b.get("step_s") or result.get("moe_overload_mean") is None:
        return []
    return [
        MoeMeasurement(
            model=dict(model),
            layout=layout,
            precision=str(result["mixed_precision"]),
            tokens_per_step=int(result["tokens_per_step"]),
            step_time_s=float(result["step_time_s"]),
            profiled_step_s=float(b["step_s"]),
            a2a_s=float(b.get("ep_comm_s", 0.0)),
            a2a_share=float(b.get("ep_comm_s", 0.0)) / float(b["step_s"]),
            overload=float(result["moe_overload_mean"]),
            expert_overload=float(result["moe_expert_overload_mean"]),
            dropped_frac=float(result["moe_dropped_frac_mean"]),
            where=where,
        )
    ]


def _breakdown(values: dict | None) -> StepBreakdown | None:
    """A profile window's step breakdown as the record's (absent parts at their defaults)."""
    if not values:
        return None
    return StepBreakdown(
        **{
            f.name: float(values[f.name] if f.name in values else f.default)
            for f in dataclasses.fields(StepBreakdown)
        }
    )
