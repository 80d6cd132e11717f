"""`dtrain runs` on Slurm logs, without a cluster: submitit log folders read back, error tails kept."""
from __future__ import annotations

from dtrain import slurm_runs


def test_failed_sweep_point_found_with_its_error_tail(tmp_path, monkeypatch):
    sweep = tmp_path / "selftest" / "multirun-1"
    good, bad = sweep / ".submitit" / "12_0", sweep / ".submitit" / "12_1"
    good.mkdir(parents=True), bad.mkdir(parents=True)
    (good / "12_0_0_log.err").write_text("submitit INFO (x) - Starting\nsubmitit INFO (x) - Job completed successfully\n")
    (bad / "12_1_0_log.err").write_text("submitit INFO (x) - Starting\nTraceback line\n"
                                        "error: backend='bogus' is not one of auto, nccl, gloo\n")
    (bad / "12_1_1_log.err").write_text("[W1122 socket.cpp:207] noise\n")
    monkeypatch.setattr(slurm_runs, "sacct", lambda jobs: {"12_0": ("COMPLETED", "n1"), "12_1": ("FAILED", "n2")})
    jobs = slurm_runs.jobs_in([tmp_path])
    assert [(j.job, j.state, j.nodes) for j in jobs] == [("12_0", "COMPLETED", "n1"), ("12_1", "FAILED", "n2")]
    [failed] = slurm_runs.unfinished(jobs, complete_jobs={"12_0"})
    assert failed.job == "12_1" and failed.sweep_point == str(sweep / "1")
    assert failed.error_tail == "Traceback line\nerror: backend='bogus' is not one of auto, nccl, gloo"


def test_sacct_absent_gives_unknown_state(tmp_path, monkeypatch):
    folder = tmp_path / "run" / "slurm"
    folder.mkdir(parents=True)
    (folder / "7_0_log.err").write_text("RuntimeError: boom\n")
    monkeypatch.setattr(slurm_runs.shutil, "which", lambda name: None)
    [job] = slurm_runs.jobs_in([tmp_path])
    assert (job.job, job.state, job.sweep_point, job.error_tail) == ("7", "?", None, "RuntimeError: boom")
