"""What the local check predicts a row from (``local_check``'s module docstring): the local dense
training runs (``_Fsdp``, ``_fsdp_runs``), the gemm-probe's curve, per-model overheads and load
factors (``_Probe``, ``_probe``), and the ``Calibration`` a row is predicted with (``_calib``), with
the words its basis says of the leave-one-out factors (``_factor_basis``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain.costmodel import Calibration, Layout, ModelShape, Param
from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.results import contract_records
from dtrain.costmodel.calibration_records import Candidate, training_entries
from dtrain.costmodel.efficiency import GemmCurve
from dtrain.costmodel.gpt_shape import shape_of
from dtrain.costmodel.token_flops import model_flops_per_token
from dtrain.model.args import GPTConfig

from .local_host import free_core_share, oversubscription


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


@dataclass
class _Fsdp:
    """One local training run to predict: its record (layout, model, measured numbers) and what the
    check derives from it."""

    run: str
    on_gpu: bool
    record: contract_records.TrainingMeasurement
    shape: ModelShape
    value_bytes: int
    efficiency: float  # compute-only, cost-model FLOP convention
    experiment: str  # the run's subproject, as the checks label it
    oversub: float = 1.0
    free_cores: float = 1.0  # free_core_share: scales the DP overlap

    @property
    def layout(self) -> Layout:
        return self.record.layout


def _fsdp_runs(report: CalibrationReport, base) -> list[_Fsdp]:
    out = []
    for ri in report.inputs:
        for m in training_entries(ri):
            step, tps, peak = m.step_time_s, m.tokens_per_s, m.peak_flops
            if not (step and tps and peak):
                continue
            world = m.layout.world_size
            shape = shape_of(GPTConfig(**m.model))
            tokens_per_rank = tps * step / world
            compute_s = step - (m.exposed_comm_s or 0.0)
            eff = tokens_per_rank * model_flops_per_token(shape) / (compute_s * peak)
            vb = 4 if m.precision == "fp32" else 2
            out.append(
                _Fsdp(
                    display_path(ri.run.path, base),
                    ri.source.on_gpu,
                    m,
                    shape,
                    vb,
                    eff,
                    ri.run.subproject,
                    oversubscription(ri.run.env, world),
                    free_core_share(ri.run.env, world),
                )
            )
    return out


@dataclass(frozen=True)
class _Probe:
    """The gemm-probe's curve and per-model overheads (see module docstring)."""

    curve: GemmCurve
    overheads: list
    label: str
    peak: float  # the probe's own 512^3 matmul rate (with load factors: the idle host's)
    loads: dict = field(
        default_factory=dict
    )  # run (display path) -> contract_records.RunLoad fields

    def speed(
        self, run: str, run_peak: float
    ) -> tuple[float, float, tuple[float, float] | None, str]:
        """(peak to predict the run at, its load factor, (10th, 90th percentile) factors, basis
        note). With the run's load measured: the probe's idle rate and that factor; else the
        run's own matmul probe."""
        load = self.loads.get(run)
        if load is None:
            return run_peak, 1.0, None, ""
        lf, lo, hi = load["load_factor"], load["low"], load["high"]
        return (
            self.peak,
            lf,
            (lo, hi),
            f"; load x{lf:.2f} measured during the run ({lo:.2f}-{hi:.2f})",
        )

    def measured(self, run: str) -> tuple[float, float, float] | None:
        """The run's measured load (median, 10th, 90th percentile factor), if the probe has it:
        whether the row is judged (``Check.judged``), used in its prediction or not."""
        load = self.loads.get(run)
        return load and (load["load_factor"], load["low"], load["high"])

    def overhead(self, kind: str, match: dict, micro_batch: int, run_peak: float) -> float | None:
        """The measured overhead of this model, scaled by probe peak / run peak: on shared cores the
        run's own matmul probe says how much slower everything ran at the time (load)."""
        for o in self.overheads:
            c = o["config"]
            if (
                o["kind"] == kind
                and o["micro_batch"] == micro_batch
                and all(c.get(k) == v for k, v in match.items())
                and c.get("moe") == match.get("moe")  # an MoE model's overhead is its own
            ):
                return float(o["overhead_s"]) * self.peak / run_peak
        return None


def _probe(report: CalibrationReport, base) -> _Probe | None:
    found = report.local_probe()
    if found is None:
        return None
    src, g = found
    results = ((Path(base) if base else Path.cwd()) / src.run).parent  # the folder the probe read
    loads = {display_path(results / ld["run"], base): ld for ld in g.get("loads") or []}
    return _Probe(
        GemmCurve(g["e_max"], g.get("w_half") or 0.0),
        g.get("overheads") or [],
        src.run,
        float(g.get("peak_flops") or 1.0),
        loads,
    )


def _gpt_match(shape: ModelShape) -> dict:
    return {
        "n_layer": shape.n_layer,
        "d_model": shape.d_model,
        "n_head": shape.n_head,
        "seq_len": shape.seq_len,
        "vocab_size": shape.vocab,
    }


def _calib(
    eff: float,
    eff_basis: str,
    overlap: float | None,
    probe: _Probe | None = None,
    overhead: float | None = None,
    factors: tuple[Candidate | None, ...] = (),
) -> Calibration:
    c = replace(
        Calibration(),
        mfu=Param(eff, "measured here: " + eff_basis),
        tp_overhead=Param(1.0, "datasheet/published: raw alpha-beta"),
    )
    for f in factors:  # leave-one-out tp_overhead / pp_overhead
        if f is not None:
            c = replace(c, **{f.name: f.param()})
    if probe is not None and overhead is not None:
        c = replace(
            c,
            mfu=Param(probe.curve.e_max, "measured here: " + probe.label),
            gemm_half_flops=Param(probe.curve.w_half, "measured here: " + probe.label),
            step_overhead_s=Param(overhead, "measured here: " + probe.label),
        )
    if overlap is not None:
        c = replace(c, dp_overlap=Param(overlap, "measured here: fsdp-scaling"))
    return c


PROBE_BASIS = "GEMM curve + fixed step overhead from gemm-probe"


def _factor_basis(f: Candidate | None, what: str, raw: str) -> str:
    if f is None:
        return f"; {raw} (no other run measured it)"
    return f"; {what} x{f.value:.2f} from {len(f.pooled)} other run(s), leave-one-out"
