"""The local check's rows of tp-attention's runs: one layer (attention, or the whole block) on a
single rank and at each tp, its compute from the dense runs' efficiency or the gemm-probe's curve,
its TP communication the α–β of allreduce-bench times the other runs' measured/modelled ratio
(leave-one-out)."""

from __future__ import annotations

from dtrain.costmodel import Layout, LinkModel, ModelShape
from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.costmodel.calibration_records import leave_one_out
from dtrain.costmodel.calibration_tp import tp_modelled_comm_s, tp_rows
from dtrain.costmodel.efficiency import gemm_time, layer_gemms
from dtrain.model.flops import transformer_flops_per_token

from .check import Check
from .local_inputs import PROBE_BASIS, _factor_basis, _Fsdp, _median, _Probe


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
