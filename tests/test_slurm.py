"""The Slurm paths, on a real cluster (`scripts/slurm-cluster start`); skipped without one."""

from __future__ import annotations

import json

import pytest

from conftest import py
from dtrain.results import loader

pytestmark = pytest.mark.slurm


def test_launcher_slurm_two_tasks(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "world_size=2",
        "slurm.partition=debug",
        "slurm.time_min=5",
        f"results_dir={tmp_path}",
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted Slurm job" in out.stdout
    [run] = loader.complete_runs([tmp_path])
    assert run.summary["allreduce_sum"] == 3.0 and run.env["launcher"] == "slurm"
    assert run.env["slurm_job_id"]


def test_hydra_multirun_through_submitit_slurm(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "numel=16,64",
        "world_size=2",
        f"results_dir={tmp_path}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.mem_gb=2",
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        out.stdout.count("run complete: ") == 2 and "sweep complete: 2 point(s)" in out.stdout
    )  # where results are
    df = loader.load_runs([tmp_path])
    assert sorted(df["numel"]) == [16, 64]
    assert set(df["summary.allreduce_sum"]) == {3.0}
    assert len(set(df["run"])) == 2
    records = loader.load([tmp_path], kind="allreduce_check")
    assert sorted(records["numel"]) == [16, 64]
    assert json.loads(next(tmp_path.rglob("env.json")).read_text())["launcher"] == "job"
