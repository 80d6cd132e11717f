"""The guide's predicted-vs-measured table gains rows for DP x TP x PP runs of fsdp-scaling, and
calibration does not take its compute efficiency from them (their step holds TP comm and bubble)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dtrain.costmodel.calibrate import calibrate
from dtrain.guide.local_check import local_checks
from dtrain.results import contract, contract_records
from dtrain.results.metrics import write_summary

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"


def test_layout_run_gets_its_own_row_and_does_not_calibrate(tmp_path):
    shutil.copytree(CPU, tmp_path / "cpu")
    fsdp = tmp_path / "cpu" / "fsdp-scaling"
    src = fsdp / "20250301-100100-000000"
    layout_run = fsdp / "20250301-100100-000009"
    shutil.copytree(src, layout_run)
    summary = json.loads((layout_run / "summary.json").read_text())
    [m] = contract.read(summary)
    # a dp1 x tp2 run of the same model: 5x slower, with a profiled breakdown (made-up numbers)
    lay = dataclasses.replace(m.layout, tp=2, pp=1, dp_replicate=1, grad_accum=2)
    m = dataclasses.replace(
        m,
        layout=lay,
        mfu=m.mfu / 5,
        step_time_s=m.step_time_s * 5,
        tokens_per_s=m.tokens_per_s / 5,
        breakdown=contract_records.StepBreakdown(
            step_s=4.3,
            compute_s=2.0,
            tp_comm_s=1.5,
            pp_p2p_s=0.0,
            dp_comm_s=0.1,
            dp_comm_exposed_s=0.1,
            idle_s=0.7,
        ),
    )
    write_summary(layout_run, {**summary, "guide_inputs": [m]})
    g = {"step_time_s": m.step_time_s}
    env = json.loads((layout_run / "env.json").read_text())
    (layout_run / "env.json").write_text(
        json.dumps({**env, "created": "2030-01-01T00:00:00+00:00"})
    )  # the latest
    before = calibrate([tmp_path / "cpu" / "fsdp-scaling"], warn=False)
    checks = local_checks(calibrate([tmp_path / "cpu"], warn=False))
    rows = [c for c in checks if c.what == "dp1 x tp2 x pp1 step"]
    assert len(rows) == 1 and rows[0].measured_s == pytest.approx(g["step_time_s"])
    assert "TP comm measured 1500 ms" in rows[0].detail and rows[0].predicted_s > 0
    # the layout run is not a compute-efficiency source: the same value as without it
    shutil.rmtree(layout_run)
    without = calibrate([tmp_path / "cpu" / "fsdp-scaling"], warn=False)
    assert before.local.mfu.value == pytest.approx(without.local.mfu.value)


def _layout_fixture(tmp_path, pp: int = 1):
    """The fixture's small-GPT ddp run turned into a dp1 x tp2 (or dp1 x pp2) run with a profiled
    breakdown."""
    shutil.copytree(CPU, tmp_path / "cpu")
    fsdp = tmp_path / "cpu" / "fsdp-scaling"
    run = fsdp / "20250301-100100-000009"
    shutil.copytree(fsdp / "20250301-100100-000000", run)
    summary = json.loads((run / "summary.json").read_text())
    [m] = contract.read(summary)
    tp = 1 if pp > 1 else 2
    # 2048 tokens per step (2381.4 / 5 tokens/s x 4.3 s) = 2 micro-batches of 4 x 256 on the one DP
    # rank
    m = dataclasses.replace(
        m,
        layout=dataclasses.replace(m.layout, tp=tp, pp=pp, dp_replicate=1, grad_accum=2),
        step_time_s=4.3,
        tokens_per_s=2381.3953488372094 / 5,
        breakdown=contract_records.StepBreakdown(
            step_s=4.3,
            compute_s=2.0,
            tp_comm_s=1.5 if tp > 1 else 0.0,
            pp_p2p_s=0.9 if pp > 1 else 0.0,
            dp_comm_s=0.0,
            dp_comm_exposed_s=0.0,
            idle_s=0.1,
        ),
    )
    write_summary(run, {**summary, "guide_inputs": [m]})
    return tmp_path / "cpu", run


def test_layout_runs_calibrate_tp_and_pp_factors_by_hand(tmp_path):
    from dtrain.costmodel.calibration_records import leave_one_out

    root, run = _layout_fixture(tmp_path)
    rep = calibrate([root], base=tmp_path, warn=False)
    mine = [
        c for c in rep.candidates if c.name == "tp_overhead" and c.source.run.endswith("000009")
    ]
    # tp_comm_time: 4 layers x 2 micro-batches x 4 all-reduces of 4·256·256 fp32 values (1 MiB) over
    # 2 ranks,
    # α = 31.25 µs per hop, β = 1.6 GB/s: 2·(1/2)·2^20/1.6e9 + 2·31.25e-6 each
    modelled = 4 * 2 * 4 * (2**20 / 1.6e9 + 2 * 31.25e-6)
    assert len(mine) == 1 and mine[0].value == pytest.approx(1.5 / modelled)
    # leave-one-out for that run: only tp-attention's ratio remains
    loo = leave_one_out(rep.candidates, "tp_overhead", mine[0].source.run)
    tp_att = [
        c for c in rep.candidates if c.name == "tp_overhead" and "tp-attention" in c.source.run
    ]
    assert loo.value == pytest.approx(tp_att[0].value) and "1 other run" in loo.detail
    # ... and the tp-attention rows are predicted with the layout run's factor, never their own
    assert leave_one_out(
        rep.candidates, "tp_overhead", tp_att[0].source.run
    ).value == pytest.approx(mine[0].value)
    rows = {c.what: c for c in local_checks(rep, tmp_path)}
    assert (
        "TP comm x%.2f from 1 other run(s), leave-one-out" % tp_att[0].value
        in rows["dp1 x tp2 x pp1 step"].basis
    )


def test_pp_factor_is_measured_share_over_the_bubble_formula(tmp_path):
    root, run = _layout_fixture(tmp_path, pp=2)
    rep = calibrate([root], base=tmp_path, warn=False)
    (pp,) = [c for c in rep.candidates if c.name == "pp_overhead"]
    # sends: 2·v·m = 4 of b·s·h/tp = 4·256·256 fp32 values (1 MiB) at β + α; bubble formula
    # (p−1)/(v·m) = 1/2
    sends = 4 * (2**20 / 1.6e9 + 31.25e-6)
    assert pp.value == pytest.approx((0.9 + 0.1 - sends) / 2.0 / 0.5)
    # the only PP run: its own row gets the formula as is, not its own factor
    rows = {c.what: c for c in local_checks(rep, tmp_path)}
    assert "bubble formula as is (no other run measured it)" in rows["dp1 x tp1 x pp2 step"].basis


def test_oversubscribed_run_computes_slower():
    from dtrain.guide.local_host import oversubscription

    assert oversubscription({"cpu_count": 2, "threads_per_rank": 1}, 4) == 2.0
    assert oversubscription({"cpu_count": 2, "threads_per_rank": 1}, 2) == 1.0
    assert oversubscription({"cpu_count": 8, "threads_per_rank": 2}, 8) == 2.0
    assert oversubscription({}, 4) == 1.0  # unknown core count: not assumed


def test_fp8_rows_name_the_tooling_the_model_leaves_out():
    from dtrain.guide.check import CALLBACKS_NOTE, Check

    row = Check(
        "fp8-train", "r", "fp32 x2 step", 0.030, 0.012, "probe", f"{CALLBACKS_NOTE}: guard, health"
    )
    assert "NaN guard's hooks" in row.miss_reason([row])
    plain = Check("fp8-train", "r", "fp32 x2 step", 0.030, 0.012, "probe", "")
    assert "NaN guard" not in plain.miss_reason([plain])


def test_fp8_rows_get_the_callbacks_note_from_the_record(tmp_path):
    from dtrain.guide.check import CALLBACKS_NOTE

    shutil.copytree(CPU, tmp_path / "cpu")
    run = tmp_path / "cpu" / "fp8-train" / "20250301-100300-000000"
    summary = json.loads((run / "summary.json").read_text())
    # a record written before step_callbacks existed still decodes (default: none)
    old = {
        **summary["guide_inputs"],
        "records": [
            {k: v for k, v in r.items() if k != "step_callbacks"}
            for r in summary["guide_inputs"]["records"]
        ],
    }
    [m] = contract.decode(old)
    assert m.step_callbacks == []
    write_summary(
        run,
        {**summary, "guide_inputs": [dataclasses.replace(m, step_callbacks=["guard", "health"])]},
    )
    rows = [
        c
        for c in local_checks(calibrate([tmp_path / "cpu"], warn=False))
        if c.run.endswith("100300-000000")
    ]
    assert rows and all(c.detail == f"{CALLBACKS_NOTE}: guard, health" for c in rows)
