"""Predicted vs measured step time for the local runs: does the cost model describe this machine?

Each run is predicted with ``dtrain.costmodel.step_time`` on a "cluster" made of this host: the
peak is the run's measured CPU matmul probe (or the GPU datasheet), the link the α–β that
allreduce-bench fitted on the same kind of device. The empirical inputs come from the *other*
experiments wherever possible, so most rows are real out-of-sample predictions:

  compute              with a gemm-probe run (``dtrain.costmodel.gemm_probe``, which capstone runs):
                       the GEMM roofline × achieved-fraction curve fitted over the runs' own GEMM
                       shapes plus the probe's measured fixed per-step overhead of the same model
                       (no step time of the checked runs is used); without one, the compute
                       efficiency of fsdp-scaling (leave-one-out over its runs)
  TP communication     α–β of allreduce-bench × the measured/modelled TP ratio of the OTHER runs
                       (tp-attention and fsdp-scaling's TP layout runs,
                       ``calibration_records.leave_one_out``:
                       never the row's own run); raw α–β when no other run measured it
  PP bubble            the bubble formula × the measured/formula ratio of the other PP layout runs
                       (leave-one-out, as above); the formula as is when there is none
  DP overlap           fsdp-scaling's measured overlap of the other runs (in-sample with one run),
                       times
                       the share of cores the ranks' compute leaves free (``free_core_share``)
  links                allreduce-bench's α–β per collective: all-reduce, and all_gather,
                       reduce_scatter
                       and send/recv where it fitted them (``LinkModel.of``)
  FP8 speed factor     fp8-train compare (in-sample for the fp8 rows: it measured those runs)
  shared cores         a run with more busy threads (ranks x threads_per_rank) than the host's cores
                       computes that many times slower: its peak is divided, its overhead multiplied
                       by ranks·threads / cores (``oversubscription``)
  other load           with a gemm-probe that has the run's load factor (the CPU time other
                       processes took during the run's timed steps, ``dtrain.run.hostload``):
                       the probe's idle reference rate divided, its overhead multiplied by that
                       factor, so load that slowed the run slows its prediction alike; the
                       factor's 10th-90th percentile over the window gives the prediction's
                       spread (``Check.predicted_range``)
Rows say which inputs were in-sample or left out. Goal: |error| <= 15%.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from dtrain.costmodel import (
    Calibration,
    Cluster,
    GPUProfile,
    Layout,
    LinkModel,
    ModelShape,
    Param,
    StepTime,
    step_time,
)
from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.results import contract
from dtrain.costmodel.calibration_records import (
    Candidate,
    RunInputs,
    leave_one_out,
    tp_modelled_comm_s,
    tp_rows,
    training_entries,
)
from dtrain.costmodel.efficiency import GemmCurve, gemm_time, layer_gemms
from dtrain.costmodel.gpt_shape import shape_of
from dtrain.costmodel.stack import Stack
from dtrain.costmodel.timemodel import model_flops_per_token
from dtrain.model.args import GPTConfig
from dtrain.model.flops import transformer_flops_per_token

from .check import CALLBACKS_NOTE, Check

# the local runs are this project's trainer: its layouts as it runs them (costmodel/software.py,
# "dtrain": FSDP2's ZeRO-2 gathers the weights again for every micro-batch)
TRAINER = Stack(software="dtrain")

BASELINE_RECIPES = ("fp32", "bf16", "fp16", "none")


def host_cluster(peak_flops: float, world: int, link: LinkModel) -> Cluster:
    """This host as the cost model's cluster: one 'GPU' per rank at the measured peak, one link."""
    gbps = link.beta_Bps / 1e9
    prof = GPUProfile(
        "host",
        peak_flops / 1e12,
        peak_flops / 1e12,
        1e6,
        0.0,
        gbps,
        2 * gbps,
        world,
        0,
        gbps,
        gbps * 8,
        "measured",
    )
    return Cluster(world, world, prof, link, link)


def oversubscription(env: dict, world: int) -> float:
    """Busy threads per core, at least 1: ranks · threads_per_rank / the host's cores (env.json).
    With more threads than cores the ranks' compute is time-sliced, so each runs that many times
    slower than the matmul probe it measured alone."""
    cores = int(env.get("cpu_count") or 0)
    threads = int(env.get("threads_per_rank") or 1)
    return max(1.0, world * threads / cores) if cores else 1.0


def free_core_share(env: dict, world: int) -> float:
    """Share of the host's cores not busy with the ranks' compute threads, max(0, 1 −
    ranks·threads / cores). Hidden DP traffic is only free where a core is: gloo's threads copy
    and reduce on the CPU (as NCCL's kernels take SMs, ``Calibration.dp_overlap``), so on a host
    whose cores all compute, a collective that overlaps compute takes its time from it. The local
    rows scale the measured overlap by this share."""
    cores = int(env.get("cpu_count") or 0)
    threads = int(env.get("threads_per_rank") or 1)
    return max(0.0, 1.0 - world * threads / cores) if cores else 1.0


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


@dataclass
class _Fsdp:
    """One local training run to predict: its record (layout, model, measured numbers) and what the
    check derives from it."""

    run: str
    on_gpu: bool
    record: contract.TrainingMeasurement
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
    loads: dict = field(default_factory=dict)  # run (display path) -> contract.RunLoad fields

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


def host_step(
    shape: ModelShape,
    layout: Layout,
    calib: Calibration,
    *,
    peak: float,
    world: int,
    link: LinkModel | None,
    value_bytes: int,
    overhead_s: float | None = None,
    precision: str = "bf16",
) -> StepTime:
    """The cost model's step on this host (``host_cluster``: ``world`` ranks at ``peak`` each, the
    local link; none measured: a free one). ``overhead_s``: the probe's fixed step overhead as
    slowed on these cores, in place of ``calib``'s."""
    if overhead_s is not None:
        calib = replace(calib, step_overhead_s=Param(overhead_s, calib.step_overhead_s.provenance))
    cluster = host_cluster(peak, world, link or LinkModel(0, 1e30))
    return step_time(
        shape, layout, cluster, calib, precision=precision, value_bytes=value_bytes, stack=TRAINER
    )


def fsdp_step(
    r: _Fsdp,
    calib: Calibration,
    *,
    peak: float,
    load: float,
    link: LinkModel | None,
    overhead_s: float | None,
) -> StepTime:
    """Run ``r``'s predicted step under ``load`` (other processes' load factor): its busy threads
    per core times the load make its compute that much slower, the probe's overhead that much
    longer."""
    k = r.oversub * load
    world = r.layout.dp * r.layout.tp * r.layout.pp
    return host_step(
        r.shape,
        r.layout,
        calib,
        peak=peak / k,
        world=world,
        link=link,
        value_bytes=r.value_bytes,
        overhead_s=None if overhead_s is None else overhead_s * k,
    )


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


def _spread(step, spread: tuple[float, float] | None) -> tuple[float, float] | None:
    """The predicted totals at the load's 10th and 90th percentile (``step(load=...)``), if
    measured."""
    return spread and (step(load=spread[0]).total, step(load=spread[1]).total)


def fsdp_checks(
    runs: list[_Fsdp],
    link: LinkModel | None,
    probe: _Probe | None = None,
    cands: list[Candidate] = (),
) -> list[Check]:
    checks = (
        fsdp_check(r, runs[:i] + runs[i + 1 :], link, probe, cands) for i, r in enumerate(runs)
    )
    return [c for c in checks if c is not None]


def fsdp_check(
    r: _Fsdp,
    rest: list[_Fsdp],
    link: LinkModel | None,
    probe: _Probe | None,
    cands: list[Candidate],
) -> Check | None:
    """Run ``r`` predicted from the other runs (``rest``) wherever they measured the input."""
    m, lay = r.record, r.layout
    if link is None and lay.dp * lay.tp * lay.pp > 1:
        return None
    # compute efficiency from pure data-parallel runs only: a TP / PP run's step holds TP comm and
    # bubble, which are what its row checks
    others = [o for o in rest if o.on_gpu == r.on_gpu and o.layout.tp * o.layout.pp == 1]
    eff = _median([o.efficiency for o in others]) if others else r.efficiency
    overlaps = [o.record.overlap_fraction for o in others if o.record.overlap_fraction is not None]
    overlap = _median(overlaps) if overlaps else m.overlap_fraction
    overlap = None if overlap is None else overlap * r.free_cores
    basis = (
        f"efficiency from {len(others)} other fsdp run(s)"
        if others
        else "in-sample: compute efficiency from this run, only communication predicted"
    )
    peak, load, spread, load_note = (
        probe.speed(r.run, m.peak_flops) if probe else (m.peak_flops, 1.0, None, "")
    )
    over = probe.overhead("gpt", _gpt_match(r.shape), lay.micro_batch, peak) if probe else None
    if over is None:
        peak, load, spread, load_note = m.peak_flops, 1.0, None, ""
    else:
        basis = PROBE_BASIS + (
            f"; DP overlap from {len(others)} other fsdp run(s)" if others else ""
        )
    factors = (
        leave_one_out(list(cands), "tp_overhead", r.run) if lay.tp > 1 else None,
        leave_one_out(list(cands), "pp_overhead", r.run) if lay.pp > 1 else None,
    )
    if lay.tp > 1:
        basis += _factor_basis(factors[0], "TP comm", "raw alpha-beta TP comm")
    if lay.pp > 1:
        basis += _factor_basis(factors[1], "PP bubble", "bubble formula as is")
    if r.free_cores < 1 and lay.dp > 1:
        basis += f"; DP overlap x{r.free_cores:.2g} (cores free of compute)"
    if r.oversub > 1:
        basis += f"; {r.oversub:g} busy threads per core"
    basis += load_note
    step = partial(
        fsdp_step,
        r,
        _calib(eff, basis, overlap, probe, over, factors),
        peak=peak,
        link=link,
        overhead_s=over,
    )
    t = step(load=load)
    return Check(
        r.experiment,
        r.run,
        _fsdp_what(m),
        m.step_time_s,
        t.total,
        basis,
        _fsdp_detail(m, t),
        _spread(step, spread),
        load=probe.measured(r.run) if probe else None,
    )


def _fsdp_what(m: contract.TrainingMeasurement) -> str:
    lay = m.layout
    if lay.tp * lay.pp == 1:
        return f"{m.strategy} x{lay.dp} step"
    return f"dp{lay.dp} x tp{lay.tp} x pp{lay.pp} step"


def _fsdp_detail(m: contract.TrainingMeasurement, t: StepTime) -> str:
    """The parts of the step the run measured against their predictions."""
    b, lay = m.breakdown, m.layout
    if lay.tp * lay.pp > 1 and b:  # the parts a layout run measured (CPU profile)
        return (
            f"TP comm measured {b.tp_comm_s * 1e3:.0f} ms vs predicted "
            f"{t.tp_comm * 1e3:.0f} ms; PP p2p + idle measured "
            f"{(b.pp_p2p_s + b.idle_s) * 1e3:.0f} ms vs predicted bubble + p2p "
            f"{(t.bubble + t.pp_comm) * 1e3:.0f} ms"
        )
    exposed = m.exposed_comm_s
    if exposed is None:
        return ""
    return (
        f"exposed comm measured {exposed * 1e3:.0f} ms (profile) vs predicted "
        f"{t.dp_comm_exposed * 1e3:.0f} ms; rest measured "
        f"{(m.step_time_s - exposed) * 1e3:.0f} ms vs predicted "
        f"{(t.total - t.dp_comm_exposed) * 1e3:.0f} ms"
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
    m: contract.TrainingMeasurement,
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


def _tp_probe_time(row: dict, kind: str, tp: int, peak: float, probe: _Probe) -> float | None:
    """Forward + backward of one layer (or its TP shard) from the probe curve, plus its overhead."""
    over = probe.overhead(
        kind,
        {"d_model": row["d_model"], "n_head": row["n_head"], "seq_len": row["seq"]},
        row["batch"],
        peak,
    )
    if over is None:
        return None
    ffn = 4.0 if kind == "block" else 1e-9
    shape = ModelShape(
        1, row["d_model"], row["n_head"], row["n_kv_head"] or row["n_head"], 1, row["seq"], ffn
    )
    gemms = [
        g
        for g in layer_gemms(shape, Layout(tp=tp, micro_batch=row["batch"]))
        if kind == "block" or g.name not in ("fc1", "fc2")
    ]
    return 3 * sum(gemm_time(g, peak, 0.0, probe.curve, 4) for g in gemms) + over


def tp_checks(
    report: CalibrationReport,
    runs: list[_Fsdp],
    link: LinkModel | None,
    base,
    probe: _Probe | None = None,
) -> list[Check]:
    out = []
    cpu = [r for r in runs if not r.on_gpu]
    if not cpu or link is None:
        return out
    eff, peak = _median([r.efficiency for r in cpu]), _median([r.record.peak_flops for r in cpu])
    for ri in report.inputs:
        rows = tp_rows(ri)
        if ri.source.on_gpu or not rows:
            continue
        run = ri.run
        shown_single = False
        here = display_path(run.path, base)
        factor = leave_one_out(report.candidates, "tp_overhead", here)
        scale = factor.value if factor else 1.0
        comm_basis = _factor_basis(factor, "alpha-beta TP comm", "raw alpha-beta TP comm")
        run_peak, load, spread, load_note = (
            probe.speed(here, peak) if probe else (peak, 1.0, None, "")
        )
        measured_load = probe.measured(here) if probe else None
        for row, regions in sorted(
            rows, key=lambda rr: (rr[0]["tp"], bool(rr[0]["sequence_parallel"]))
        ):
            b, s, h, heads, kv = (
                row["batch"],
                row["seq"],
                row["d_model"],
                row["n_head"],
                row["n_kv_head"],
            )
            ffn = int(row["mlp_ratio"]) * h if regions == 2 else 0
            flops = (
                b * s * transformer_flops_per_token(1, h, heads, kv, ffn, 0, s)
            )  # one layer, no lm_head
            single = flops / (peak * eff)
            kind = "block" if regions == 2 else "attention"
            p1 = _tp_probe_time(row, kind, 1, run_peak / load, probe) if probe else None
            eff_basis = "efficiency from fsdp-scaling" if p1 is None else PROBE_BASIS + load_note
            row_spread = spread if p1 is not None else None

            def at(
                lf: float, tp: int, row=row, kind=kind
            ) -> float:  # the probe's prediction at load factor lf
                return _tp_probe_time(row, kind, tp, run_peak / lf, probe)

            if not shown_single and row.get("single_rank_step_time_s"):
                out.append(
                    Check(
                        run.subproject,
                        here,
                        "one layer, single rank",
                        row["single_rank_step_time_s"],
                        single if p1 is None else p1,
                        eff_basis,
                        "",
                        row_spread and (at(row_spread[0], 1), at(row_spread[1], 1)),
                        load=measured_load,
                    )
                )
                shown_single = True
            if row["tp"] < 2:
                continue
            comm = tp_modelled_comm_s(row, link, regions) * scale
            sp = " sp" if row["sequence_parallel"] else ""
            detail = (
                f"TP comm measured {row['step_time_s'] * row['comm_share'] * 1e3:.0f} ms "
                f"(profile) vs predicted {comm * 1e3:.0f} ms"
            )
            shard = at(load, row["tp"]) if p1 is not None else None
            out.append(
                Check(
                    run.subproject,
                    here,
                    f"one layer, tp={row['tp']}{sp}",
                    row["step_time_s"],
                    (single / row["tp"] if shard is None else shard) + comm,
                    eff_basis + comm_basis,
                    detail,
                    row_spread
                    and (at(row_spread[0], row["tp"]) + comm, at(row_spread[1], row["tp"]) + comm),
                    load=measured_load,
                )
            )
    return out


def _content_key(ri: RunInputs) -> str:
    """What a run measured: its summary's guide inputs, canonical. A copied run folder has the same;
    a rerun of the same config measures other times (two real runs are two checks, and the guide
    compares them as run-to-run noise)."""
    inputs = ri.run.summary.get("guide_inputs")
    return json.dumps(inputs, sort_keys=True) if inputs else f"path:{ri.run.path}"


def distinct_runs(report: CalibrationReport, base=None) -> tuple[CalibrationReport, dict]:
    """``report`` with each measurement once, and {kept run's display path: the display paths of
    the folders that repeat its guide inputs (copies), left out}: 300 copies of one run are one
    check, not 300, and a copy is no "other run" for the leave-one-out factors. The first in path
    order is kept."""
    kept: dict[str, RunInputs] = {}
    copies: dict[str, list[RunInputs]] = {}
    for ri in report.inputs:
        first = kept.setdefault(_content_key(ri), ri)
        if first is not ri:
            copies.setdefault(display_path(first.run.path, base), []).append(ri)
    if not copies:
        return report, {}
    dropped = {ri.source.run for runs in copies.values() for ri in runs}
    distinct = replace(
        report,
        inputs=list(kept.values()),
        candidates=[c for c in report.candidates if c.source.run not in dropped],
    )
    return distinct, {
        run: tuple(display_path(ri.run.path, base) for ri in runs) for run, runs in copies.items()
    }


def local_checks(report: CalibrationReport, base=None) -> list[Check]:
    """Every local (non-CUDA) run the model can predict, in a stable order; a run's copies
    (``distinct_runs``) are checked once, its rows naming them (``Check.copies``)."""
    report, copies = distinct_runs(report, base)
    link = report.local_links.get("intra")
    if link is not None and report.local_sources["intra"].on_gpu:
        link = None  # a GPU link does not describe CPU ranks
    runs = [r for r in _fsdp_runs(report, base) if not r.on_gpu]
    probe = _probe(report, base)
    checks = (
        fsdp_checks(runs, link, probe, report.candidates)
        + fp8_checks(report, runs, link, base, probe)
        + tp_checks(report, runs, link, base, probe)
    )
    checks = [replace(c, copies=copies.get(c.run, ())) for c in checks]
    return sorted(checks, key=lambda c: (c.experiment, c.run, c.what))
