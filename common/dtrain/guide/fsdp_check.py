"""The local check's rows of the dense training runs (fsdp-scaling's, its layout runs too): each
run's step predicted from the other runs wherever they measured the input (``local_check``'s
module docstring), its measured parts (exposed DP comm, TP comm, PP bubble) beside the model's."""

from __future__ import annotations

from functools import partial

from dtrain.costmodel import Calibration, LinkModel, StepTime
from dtrain.results import contract_records
from dtrain.costmodel.calibration_records import Candidate, leave_one_out

from .check import Check
from .local_host import _spread, host_step
from .local_inputs import PROBE_BASIS, _calib, _factor_basis, _Fsdp, _gpt_match, _median, _Probe


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


def _fsdp_what(m: contract_records.TrainingMeasurement) -> str:
    lay = m.layout
    if lay.tp * lay.pp == 1:
        return f"{m.strategy} x{lay.dp} step"
    return f"dp{lay.dp} x tp{lay.tp} x pp{lay.pp} step"


def _fsdp_detail(m: contract_records.TrainingMeasurement, t: StepTime) -> str:
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
