"""The CP study end to end on 2 CPU ranks: every measured layer parity-checked, counted bytes =
analytic, the table / CSV / plot, and the typed CpMeasurement records calibration reads. The rank
function runs through dtrain.run.launch in-process (fast); the CLI once, in a slow test."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import py
from dtrain.core.nodes import defaults
from dtrain.parallel.cp.exchange import expected_wire_bytes
from dtrain.results import contract, contract_records, loader, metrics
from dtrain.run.launch import launch

TINY = {
    "model.seq_len": [32, 64],
    "model.d_model": 32,
    "model.n_head": 4,
    "model.n_kv_head": 2,
    "iters": 2,
    "timing_warmup": 1,
}


def test_study_measures_every_layout_and_publishes_cp_records(tmp_path):
    from tp_attention.conf import CpStudyConfig
    from tp_attention.cp.bench import rank_fn
    from tp_attention.cp.report import finalize

    cfg = defaults(CpStudyConfig)
    for key, value in {
        **TINY,
        "launcher": "local",
        "device": "cpu",
        "backend": "gloo",
        "threads_per_rank": 1,
    }.items():
        OmegaConf.update(cfg, key, value)
    result, run_dir = launch(rank_fn, cfg, tmp_path / "run")
    summary = finalize(run_dir, cfg, result)
    rows = result["rows"]
    assert {(r["seq_len"], r["impl"]) for r in rows} == {
        (s, i) for s in (32, 64) for i in ("single", "ring", "ulysses", "tp_sp")
    }
    assert all(r["max_rel_err"] <= 1e-5 for r in rows if r["impl"] in ("ring", "ulysses"))
    assert all(r["saved_bytes"] > 0 and r["median_s"] > 0 for r in rows)
    records = contract.decode(
        contract.encode(summary["guide_inputs"])
    )  # what summary.json holds, read back
    assert sorted((m.seq_len, m.impl) for m in records) == [
        (s, i) for s in (32, 64) for i in ("ring", "ulysses")
    ]
    for m in records:
        assert isinstance(m, contract_records.CpMeasurement) and m.where == contract_records.Where(
            "cpu", "gloo"
        )
        assert (m.cp, m.d_model, m.n_head, m.n_kv_head, m.micro_batch) == (2, 32, 4, 2, 1)
        assert m.comm_bytes_per_layer == expected_wire_bytes(
            m.impl, batch=1, seq=m.seq_len, n_head=4, n_kv_head=2, head_dim=8, cp=2
        )
        assert m.single_device_step_time_s > 0 and m.tp_sp_step_time_s > 0
        if m.impl == "ring":  # 3 k/v blocks of 2 x (s/2) tokens x 2 heads x 8 x 4 bytes
            assert m.comm_bytes_per_layer == 3 * 2 * (m.seq_len // 2) * 2 * 8 * 4
            assert 0 <= m.overlap_fraction <= 1 and m.serial_step_time_s > 0
        else:
            assert m.overlap_fraction is None
    assert (run_dir / "cp_scaling.png").stat().st_size > 0 and (run_dir / "cp_scaling.csv").exists()
    metrics.write_summary(
        run_dir, {**summary, "status": "complete"}
    )  # strict JSON, contract checked
    assert len(contract.read(loader.complete_runs([run_dir])[0].summary)) == 4


@pytest.mark.slow
def test_cli_runs_the_study_and_refuses_bad_input(tmp_path):
    args = [f"{k}={v}".replace(" ", "") for k, v in TINY.items()]
    out = py("-m", "tp_attention.cp", *args, f"results_dir={tmp_path}", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    assert len(contract.read(run.summary)) == 4 and "all-to-all (Ulysses)" in out.stdout
    bad = py(
        "-m", "tp_attention.cp", "model.seq_len=[30]", f"results_dir={tmp_path}/bad", timeout=60
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith(
        "error: model.seq_len=30 is not divisible"
    )
    assert not (tmp_path / "bad").exists()
