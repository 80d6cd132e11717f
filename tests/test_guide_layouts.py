"""The guide's predicted-vs-measured table gains rows for DP x TP x PP runs of fsdp-scaling, and
calibration does not take its compute efficiency from them (their step holds TP comm and bubble)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dtrain import contract
from dtrain.costmodel.calibrate import calibrate
from dtrain.guide.local_check import local_checks
from dtrain.metrics import write_summary

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
    m = dataclasses.replace(m, layout=dataclasses.replace(m.layout, tp=2, pp=1, dp=1, grad_accum=2), mfu=m.mfu / 5,
                            step_time_s=m.step_time_s * 5, tokens_per_s=m.tokens_per_s / 5,
                            breakdown=contract.StepBreakdown(step_s=4.3, compute_s=2.0, tp_comm_s=1.5, pp_p2p_s=0.0,
                                                             dp_comm_s=0.1, dp_comm_exposed_s=0.1, idle_s=0.7))
    write_summary(layout_run, {**summary, "guide_inputs": [m]})
    g = {"step_time_s": m.step_time_s}
    env = json.loads((layout_run / "env.json").read_text())
    (layout_run / "env.json").write_text(json.dumps({**env, "created": "2030-01-01T00:00:00+00:00"}))  # the latest
    before = calibrate([tmp_path / "cpu" / "fsdp-scaling"], warn=False)
    checks = local_checks(calibrate([tmp_path / "cpu"], warn=False))
    rows = [c for c in checks if c.what == "dp1 x tp2 x pp1 step"]
    assert len(rows) == 1 and rows[0].measured_s == pytest.approx(g["step_time_s"])
    assert "TP comm measured 1500 ms" in rows[0].detail and rows[0].predicted_s > 0
    # the layout run is not a compute-efficiency source: the same value as without it
    shutil.rmtree(layout_run)
    without = calibrate([tmp_path / "cpu" / "fsdp-scaling"], warn=False)
    assert before.local.mfu.value == pytest.approx(without.local.mfu.value)
