"""`scontrol requeue` of a finished job on the real (local) Slurm cluster: every task of the
requeued attempt says the run is complete in its log and exits 0; the run's files stay
byte-identical. Skipped without a cluster (`scripts/slurm-cluster start`)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import py
from test_hardening_ownership_nested import TINY, _hashes

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_scontrol_requeue_of_a_finished_job_touches_nothing(tmp_path, slurm_cluster):
    run = tmp_path / "run"
    argv = [a for a in TINY if a != "world_size=1"]
    out = py(
        *argv,
        "world_size=2",
        "launcher=slurm",
        "slurm.partition=debug",
        f"hydra.run.dir={run}",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job = json.loads((run / "env.json").read_text())["slurm_job"]
    before = {k: v for k, v in _hashes(run).items() if not k.startswith("slurm/")}
    # slurmctld forgets a finished job MinJobAge (10 s here) after it ends: requeue it at once
    requeued = subprocess.run(
        ["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=30
    )
    assert requeued.returncode == 0, requeued.stderr
    logs = [run / "slurm" / f"{job}_{task}_log.out" for task in (0, 1)]
    line = f"requeue: run {run} is already complete (summary.json); nothing to do"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        queued = subprocess.run(
            ["squeue", "-h", "-j", str(job)], capture_output=True, text=True
        ).stdout.strip()
        if not queued and all(line in log.read_text() for log in logs):
            break
        time.sleep(1)
    else:
        tails = [p.read_text()[-500:] for p in logs]
        pytest.fail(f"job {job} did not end its requeued attempt in 120 s: {tails}")
    after = {k: v for k, v in _hashes(run).items() if not k.startswith("slurm/")}
    assert after == before  # no env.json rewrite, no records, no events
    deadline = time.monotonic() + 60  # slurmdbd records the end a moment after squeue drops it
    while True:
        state = subprocess.run(
            ["sacct", "-n", "-X", "-j", str(job), "-o", "State,ExitCode"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if state[:1] not in (["RUNNING"], ["PENDING"], ["REQUEUED"]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state[:2] == ["COMPLETED", "0:0"], state
