"""Slurm errors name their real cause, without a cluster: fake `sbatch` / `sinfo` scripts answer as
Slurm's tools do when there is no configuration, or when sbatch refuses a request."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import py
from dtrain.cli.main import main
from dtrain.core.errors import UserError
from dtrain.slurm import queue, submitit_sweep

NO_CONF = (
    'sbatch: error: s_p_parse_file: unable to read "/etc/slurm/slurm.conf": No such file or '
    "directory\n"
    "sbatch: fatal: Could not establish a configuration source"
)
GRES = "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification"


def fake_tools(
    folder: Path, stderr: str, tools=("sbatch", "sinfo", "squeue", "sacct", "srun")
) -> str:
    """A PATH whose Slurm tools print `stderr` and exit 1 (first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in tools:
        script = folder / name
        script.write_text(
            "#!/bin/sh\ncat >&2 <<'EOF'\n"
            + stderr.replace("sbatch:", f"{name}:")
            + "\nEOF\nexit 1\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_no_configuration_says_how_to_point_at_the_cluster(monkeypatch):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    err = queue.refused(NO_CONF, "job", "check slurm.partition")
    assert str(err) == (
        "Slurm cannot be reached (sbatch: fatal: Could not establish a configuration source; "
        "SLURM_CONF is not set): " + queue.CLUSTER_HINT
    )
    assert 'eval "$(scripts/slurm-cluster env)"' in str(err) and "partition" not in str(err)
    # a refusal of the request itself still points at the request's keys
    assert str(queue.refused(GRES, "sweep", "check hydra.launcher.gres")) == (
        f"Slurm refused the sweep ({GRES}): check hydra.launcher.gres"
    )


def test_launcher_slurm_without_configuration_is_refused_before_submitting(monkeypatch, tmp_path):
    """sinfo (asked before sbatch) fails for want of a configuration: one UserError, nothing
    submitted."""
    from dtrain.run.slurm_launch import slurm_executor

    monkeypatch.setenv("PATH", fake_tools(tmp_path / "bin", NO_CONF))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    cfg = OmegaConf.create(
        {
            "world_size": 2,
            "subproject": "selftest",
            "slurm": {
                "nodes": 1,
                "tasks_per_node": None,
                "cpus_per_task": 1,
                "time_min": 5,
                "requeue": True,
                "max_requeues": 3,
                "signal_delay_s": 60,
                "additional": {},
                "gpus_per_node": 0,
                "mem_gb": None,
                "partition": None,
                "account": None,
                "qos": None,
                "constraint": None,
            },
        }
    )
    with pytest.raises(
        UserError,
        match=r"^Slurm cannot be reached \(sinfo: fatal: Could not establish .*"
        r"SLURM_CONF is not set\): for the local cluster run eval",
    ):
        slurm_executor(cfg, tmp_path / "slurm")
    assert not (tmp_path / "slurm").exists() or not any((tmp_path / "slurm").rglob("*.sh"))


def test_submitit_sweep_refused_by_sbatch_is_one_line_and_listed(tmp_path, capsys):
    path = fake_tools(tmp_path / "bin", GRES)
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "numel=16,64",
        f"results_dir={tmp_path / 'r'}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.gres=gpu:nosuch:1",
        env={"PATH": path},
        timeout=90,
    )
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(
        f"error: Slurm refused the sweep ({GRES}): check the hydra.launcher.* keys"
    ), line
    [note] = (tmp_path / "r").rglob(submitit_sweep.SUBMISSION_FAILED)
    assert json.loads(note.read_text())["error"].startswith("Slurm refused the sweep")
    assert not list((tmp_path / "r").rglob("config.yaml"))  # no run started
    # dtrain runs lists the sweep that never ran
    assert main(["runs", str(tmp_path / "r")]) == 0
    shown = capsys.readouterr().out
    assert "1 sweep(s) refused at submission" in shown and "Invalid generic resource" in shown


def test_a_finished_sweep_prints_its_run_dirs(tmp_path, capsys):
    from hydra.core.utils import JobReturn

    from omegaconf import OmegaConf

    done, failed = tmp_path / "0", tmp_path / "1"
    done.mkdir()
    (done / "summary.json").write_text("{}")

    def job(
        out,
        # Hydra's JobReturn: working_dir is where the sweep was submitted from (hydra.job.chdir
        # false)
    ):
        return JobReturn(
            working_dir=str(tmp_path),
            hydra_cfg=OmegaConf.create({"hydra": {"runtime": {"output_dir": str(out)}}}),
        )

    submitit_sweep.report([job(done), job(failed)])
    assert capsys.readouterr().out.splitlines() == [
        f"run complete: {done}  (summary.json written)",
        f"run without summary.json: {failed} (see dtrain runs --all)",
    ]
