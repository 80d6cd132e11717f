"""The local check's row for an MoE run (issue 41): the capstone's ``fsdp-scaling moe`` step
(``train.ep=2``) publishes a ``moe_run`` record (``contract_records.MoeMeasurement``); its step time
is predicted with the MoE cost model's own terms (``moe_search.price``: the dense proxy's step plus
``moe_cost.moe_terms``, the memory aside) on this host, as the dense rows are
(``local_host.host_cluster``: one 'GPU' per rank, allreduce-bench's α–β as the link, whose
``all_to_all_v`` fit, else its ``all_to_all`` one, prices the dispatch and combine), and its
measured all-to-all time and share stand beside the model's in the row's detail.

  model        ``gpt_shape.moe_model_of`` (the GPT's GELU experts: 2 matrices each), fp32 values
               (4-byte weights and dispatched rows), ρ = the run's measured overload factor (an
               input the run measured, as the load factor: the cost model takes ρ, it fits none)
  compute      with a gemm-probe that timed this MoE model (one process, every expert local: its
               routing and permutation in its fixed overhead): the probe's GEMM curve and that
               overhead, at the run's load factor; else the fsdp runs' compute efficiency
  DP overlap   the fsdp runs' measured overlap x the cores free of compute, as the dense rows

The all-to-all is not judged apart: rank 0's ``ep_comm`` regions (``a2a_s``) time the token-count
exchange, the dispatches and the combines, each a blocking gloo call that also waits for the other
rank to arrive; on two shared cores that wait, not the transfer, is most of it (docs/GUIDE.md,
Predicted vs measured), and the α–β model prices the transfer alone.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.costmodel.gpt_shape import moe_model_of
from dtrain.costmodel.hardware import LinkModel
from dtrain.costmodel.moe_search import MoEPlan, price
from dtrain.model.args import GPTConfig
from dtrain.results import contract_records

from .check import Check
from .local_check import distinct_runs, local_checks
from .local_host import TRAINER, _spread, free_core_share, host_cluster, oversubscription
from .local_inputs import PROBE_BASIS, _calib, _fsdp_runs, _gpt_match, _median, _probe, _Probe


def moe_step(
    m: contract_records.MoeMeasurement,
    calib,
    *,
    peak: float,
    oversub: float,
    load: float,
    link: LinkModel | None,
    overhead_s: float | None,
) -> MoEPlan:
    """The run's MoE plan on this host under ``load`` (other processes' load factor): its busy
    threads per core times the load slow its compute and stretch the probe's overhead alike."""
    k = oversub * load
    if overhead_s is not None:
        calib = replace(calib, step_overhead_s=replace(calib.step_overhead_s, value=overhead_s * k))
    model = moe_model_of(GPTConfig(**m.model))
    model = replace(model, moe=replace(model.moe, imbalance=max(1.0, m.overload)))
    cluster = host_cluster(peak / k, m.layout.world_size, link or LinkModel(0, 1e30))
    vb = 4 if m.precision == "fp32" else 2
    return price(model, m.layout, cluster, calib, "bf16", TRAINER, value_bytes=vb)


def moe_check(
    ri,
    m: contract_records.MoeMeasurement,
    fsdp: list,
    link: LinkModel | None,
    probe: _Probe | None,
    base,
) -> Check:
    """One MoE run's row (module docstring); ``fsdp``: the local dense runs (``_fsdp_runs``)."""
    run, lay = display_path(ri.run.path, base), m.layout
    world = lay.world_size
    eff = _median([r.efficiency for r in fsdp])
    overlaps = [r.record.overlap_fraction for r in fsdp if r.record.overlap_fraction is not None]
    overlap = _median(overlaps) if overlaps else None
    free = free_core_share(ri.run.env, world)
    run_peak = _median([r.record.peak_flops for r in fsdp])  # the record keeps no matmul probe
    peak, load, spread, load_note = (
        probe.speed(run, run_peak) if probe else (run_peak, 1.0, None, "")
    )
    cfg = GPTConfig(**m.model)
    over = None
    if probe is not None:
        match = {**_gpt_match(moe_model_of(cfg).base), "moe": m.model["moe"]}
        over = probe.overhead("gpt", match, lay.micro_batch, peak)
    if over is None:
        peak, load, spread, load_note = run_peak, 1.0, None, ""
        basis = f"efficiency from {len(fsdp)} fsdp run(s) (no gemm-probe of this MoE model)"
    else:
        basis = PROBE_BASIS + " (this MoE model on one process)"
    basis += f"; rho {m.overload:.2f} = the run's measured overload"
    if overlap is not None and lay.dp > 1:
        overlap *= free
        basis += f"; DP overlap from the fsdp runs x{free:.2g} (cores free of compute)"
    k = oversubscription(ri.run.env, world)
    if k > 1:
        basis += f"; {k:g} busy threads per core"
    basis += load_note
    step = partial(
        moe_step,
        m,
        _calib(eff, basis, overlap, probe, over),
        peak=peak,
        oversub=k,
        link=link,
        overhead_s=over,
    )
    plan = step(load=load)
    t, e = plan.time, plan.moe
    detail = (
        f"EP a2a comm measured {m.a2a_s * 1e3:.0f} ms vs predicted {e.all_to_all * 1e3:.0f} ms "
        f"per step, a share of {m.a2a_share:.0%} of the profiled step vs "
        f"{e.all_to_all / t.total:.0%}"
        " (not judged: rank 0's ep_comm regions, the token-count exchange, dispatches and "
        "combines, each a blocking gloo call that also waits for the other rank; the α–β model "
        "prices the transfer)"
    )
    return Check(
        ri.run.subproject,
        run,
        f"MoE ep{lay.ep} step",
        m.step_time_s,
        t.total,
        basis,
        detail,
        _spread(lambda load: step(load=load).time, spread),
        load=probe.measured(run) if probe else None,
    )


def moe_checks(report: CalibrationReport, base=None) -> list[Check]:
    """A row per local (non-CUDA) MoE run, each run once (``local_check.distinct_runs``); none
    without a local fsdp run (the peak and efficiency the row is priced at)."""
    report, copies = distinct_runs(report, base)
    link = report.local_links.get("intra")
    if link is not None and report.local_sources["intra"].on_gpu:
        link = None
    fsdp = [r for r in _fsdp_runs(report, base) if not r.on_gpu]
    if not fsdp:
        return []
    probe = _probe(report, base)
    out = []
    for ri in report.inputs:
        if ri.source.on_gpu:
            continue
        for m in ri.of(contract_records.MoeMeasurement):
            if link is None and m.layout.world_size > 1:
                continue
            c = moe_check(ri, m, fsdp, link, probe, base)
            out.append(replace(c, copies=copies.get(c.run, ())))
    return out


def all_checks(report: CalibrationReport, base=None) -> list[Check]:
    """The guide's predicted-vs-measured rows: ``local_check.local_checks`` and the MoE runs',
    in one stable order."""
    checks = local_checks(report, base) + moe_checks(report, base)
    return sorted(checks, key=lambda c: (c.experiment, c.run, c.what))
