"""`dtrain runs` on Slurm logs, without a cluster: submitit log folders read back, error tails
kept."""

from __future__ import annotations

import re

from dtrain.slurm import jobs


def test_failed_sweep_point_found_with_its_error_tail(tmp_path, monkeypatch):
    sweep = tmp_path / "selftest" / "multirun-1"
    good, bad = sweep / ".submitit" / "12_0", sweep / ".submitit" / "12_1"
    good.mkdir(parents=True), bad.mkdir(parents=True)
    (good / "12_0_0_log.err").write_text(
        "submitit INFO (x) - Starting\nsubmitit INFO (x) - Job completed successfully\n"
    )
    (bad / "12_1_0_log.err").write_text(
        "submitit INFO (x) - Starting\nTraceback line\n"
        "error: backend='bogus' is not one of auto, nccl, gloo\n"
    )
    (bad / "12_1_1_log.err").write_text("[W1122 socket.cpp:207] noise\n")
    monkeypatch.setattr(
        jobs, "sacct", lambda ids: {"12_0": ("COMPLETED", "n1"), "12_1": ("FAILED", "n2")}
    )
    found = jobs.jobs_in([tmp_path])
    assert [(j.job, j.state, j.nodes) for j in found] == [
        ("12_0", "COMPLETED", "n1"),
        ("12_1", "FAILED", "n2"),
    ]
    [failed] = jobs.unfinished(found, complete_jobs={"12_0"})
    assert failed.job == "12_1" and failed.sweep_point == str(sweep / "1")
    assert (
        failed.error_tail == "Traceback line\nerror: backend='bogus' is not one of auto, nccl, gloo"
    )


def test_sacct_absent_gives_unknown_state(tmp_path, monkeypatch):
    folder = tmp_path / "run" / "slurm"
    folder.mkdir(parents=True)
    (folder / "7_0_log.err").write_text("RuntimeError: boom\n")
    monkeypatch.setattr(jobs.shutil, "which", lambda name: None)
    [job] = jobs.jobs_in([tmp_path])
    assert (job.job, job.state, job.sweep_point, job.error_tail) == (
        "7",
        "?",
        None,
        "RuntimeError: boom",
    )


def test_dtrain_runs_fits_100_columns_and_wide_shows_everything(tmp_path, monkeypatch, capsys):
    """Long sweep paths on Slurm, sacct unreachable: the default listing keeps to 100 columns,
    cutting a path in its middle (the end tells runs apart), says once why the state is unknown;
    --wide has the full path."""
    from omegaconf import OmegaConf

    from dtrain.cli.main import main
    from dtrain.results.metrics import write_config, write_json_atomic, write_summary

    monkeypatch.setattr(jobs.shutil, "which", lambda name: None)  # no sacct here
    deep = tmp_path / "fsdp-scaling" / ("multirun-20261125-110744-886682-" + "x" * 60)
    for point in ("0", "1"):
        run = deep / point
        run.mkdir(parents=True)
        write_config(run, OmegaConf.create({"subproject": "fsdp-scaling", "world_size": 8}))
        write_json_atomic(
            run / "env.json",
            {
                "world_size": 8,
                "backend": "nccl",
                "device": "cuda",
                "created": "2026-11-25T11:07:08+00:00",
                "slurm_job": f"4242_{point}",
            },
        )
        write_summary(run, {"ok": True})
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, lines
    header = lines[1].split()
    assert header == [
        "run",
        "subproject",
        "status",
        "ranks",
        "created",
        "overrides",
        "job",
        "state",
    ]
    rows = [ln for ln in lines if "4242_" in ln]
    assert [r.split()[0][-2:] for r in rows] == ["/0", "/1"] and all(
        "…" in r.split()[0] for r in rows
    )
    assert "8 nccl cuda  11-25 11:07  (defaults)  4242_0  unknown" in rows[0]
    assert lines[-1].startswith(
        "Slurm state unknown: sacct is not on PATH: for the local cluster run eval"
    )
    assert main(["runs", "--wide", str(tmp_path)]) == 0
    wide = capsys.readouterr().out
    assert str(deep / "0") in re.sub(r"\n\s+", "", wide)  # the path, broken after a "/"
