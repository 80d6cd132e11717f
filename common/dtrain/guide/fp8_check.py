"""The local check's rows of the numerics-recipe runs (fp8-train's): each run's step predicted with
the dense runs' efficiency (or the gemm-probe's curve) and, for an FP8 recipe, fp8-train compare's
speed factor (in-sample: it measured those runs)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from dtrain.costmodel import Calibration, Layout, LinkModel, ModelShape, Param, StepTime
from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.results import contract_records
from dtrain.costmodel.calibration_records import RunInputs, training_entries
from dtrain.costmodel.gpt_shape import shape_of
from dtrain.model.args import GPTConfig

from .check import CALLBACKS_NOTE, Check
from .local_host import _spread, free_core_share, host_step, oversubscription
from .local_inputs import PROBE_BASIS, _calib, _Fsdp, _gpt_match, _median, _Probe

BASELINE_RECIPES = ("fp32", "bf16", "fp16", "none")


def recipe_step(
    shape: ModelShape,
    layout: Layout,
    calib: Calibration,
    *,
    peak: float,
    oversub: float,
    load: float,
    link: LinkModel | None,
    value_bytes: int,
    overhead_s: float | None,
    precision: str,
) -> StepTime:
    """A numerics-recipe run's predicted step under ``load``, as ``fsdp_step``."""
    return host_step(
        shape,
        layout,
        calib,
        peak=peak / (oversub * load),
        world=layout.world_size,
        link=link,
        value_bytes=value_bytes,
        precision=precision,
        overhead_s=None if overhead_s is None else overhead_s * oversub * load,
    )


def fp8_checks(
    report: CalibrationReport,
    runs: list[_Fsdp],
    link: LinkModel | None,
    base,
    probe: _Probe | None = None,
) -> list[Check]:
    cpu = [r for r in runs if not r.on_gpu]
    if not cpu:
        return []
    eff, peak = _median([r.efficiency for r in cpu]), _median([r.record.peak_flops for r in cpu])
    overlaps = [r.record.overlap_fraction for r in cpu if r.record.overlap_fraction is not None]
    calib = _calib(eff, "fsdp-scaling", _median(overlaps) if overlaps else None)
    calib = replace(calib, fp8_speedup=report.local.fp8_speedup)
    out = []
    for ri in report.inputs:
        for m in training_entries(ri, recipe=True):
            if ri.source.on_gpu or (link is None and m.layout.world_size > 1):
                continue
            out.append(
                fp8_check(ri, m, calib, eff=eff, peak=peak, link=link, base=base, probe=probe)
            )
    return out


def fp8_check(
    ri: RunInputs,
    m: contract_records.TrainingMeasurement,
    calib: Calibration,
    *,
    eff: float,
    peak: float,
    link: LinkModel | None,
    base,
    probe: _Probe | None,
) -> Check:
    """One numerics-recipe run (fp8-train's) predicted with the fsdp runs' efficiency (or the
    probe's curve) and, for an FP8 recipe, fp8-train compare's speed factor."""
    lay, world = m.layout, m.layout.world_size
    shape = shape_of(GPTConfig(**m.model))
    measured = lay.micro_batch * lay.grad_accum * world * shape.seq_len / m.tokens_per_s
    fp8 = m.recipe not in BASELINE_RECIPES
    k = oversubscription(ri.run.env, world)
    free = free_core_share(ri.run.env, world)
    run = display_path(ri.run.path, base)
    run_peak = float(m.peak_flops or peak)  # the run's own matmul probe
    run_peak, load, spread, load_note = (
        probe.speed(run, run_peak) if probe else (run_peak, 1.0, None, "")
    )
    over = probe.overhead("gpt", _gpt_match(shape), lay.micro_batch, run_peak) if probe else None
    if over is None:
        load, spread, load_note = 1.0, None, ""
    else:
        calib = replace(
            _calib(eff, "", calib.dp_overlap.value, probe, over), fp8_speedup=calib.fp8_speedup
        )
    shared = calib.dp_overlap  # hidden DP traffic needs a free core (free_core_share)
    calib = replace(calib, dp_overlap=Param(shared.value * free, shared.provenance))
    step = partial(
        recipe_step,
        shape,
        lay,
        calib,
        peak=run_peak if over is not None else peak,
        oversub=k,
        link=link,
        value_bytes=4 if m.precision != "bf16" else 2,
        overhead_s=over,
        precision="fp8" if fp8 else "bf16",
    )
    t = step(load=load)
    basis = (
        ("efficiency from fsdp-scaling" if over is None else PROBE_BASIS)
        + ("; in-sample FP8 factor from fp8-train compare" if fp8 else "")
        + (f"; DP overlap x{free:.2g} (cores free of compute)" if free < 1 and world > 1 else "")
        + load_note
    )
    note = f"{CALLBACKS_NOTE}: {', '.join(m.step_callbacks)}" if m.step_callbacks else ""
    return Check(
        ri.run.subproject,
        run,
        f"{m.recipe} x{world} step",
        measured,
        t.total,
        basis,
        note,
        _spread(step, spread),
        load=probe.measured(run) if probe else None,
    )
