"""Preemption and time limits on a real Slurm cluster: the job saves a DCP checkpoint, is requeued,
resumes in the same run directory and ends with the losses of an uninterrupted run, every step
recorded once. Skipped without a cluster (`scripts/slurm-cluster start`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, py
from dtrain.core.files import files_named
from dtrain.results import loader

pytestmark = pytest.mark.slurm

SEED = 3


def train_args(app: str, steps: int) -> list[str]:
    common = ["world_size=2", f"seed={SEED}", f"train.steps={steps}"]
    if app == "fsdp_scaling":
        return [*common, "model.preset=tiny", "profile.enabled=false"]
    # emulated_current: a resume of emulated_delayed is not bit-exact even without Slurm
    # (train.resume_from: ~1e-5 relative from the first resumed step), a separate issue
    return [
        *common,
        "model.preset=tiny",
        "train.strategy=ddp",
        "recipe=emulated_current",
        "fp8_debug.freq=0",
    ]


_references: dict = {}


def reference_losses(app: str, steps: int, tmp_root: Path) -> list[float]:
    """The same training, uninterrupted, on local ranks."""
    key = (app, steps)
    if key not in _references:
        out = py(
            "-m",
            app,
            *train_args(app, steps),
            "launcher=local",
            f"results_dir={tmp_root / 'ref'}",
            timeout=600,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        _references[key] = list(
            loader.load([tmp_root / "ref"], kind="step").sort_values("step")["loss"]
        )
    return _references[key]


def start(
    app: str, steps: int, results_dir: Path, *extra: str, sweep: bool = False
) -> tuple[subprocess.Popen, Path]:
    """launcher=slurm (launch.SlurmTask), or a one-point Hydra sweep on submitit_slurm."""
    log = results_dir.parent / f"{results_dir.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    how = (
        [
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.partition=debug",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.mem_gb=2",
            *extra,
        ]
        if sweep
        else ["launcher=slurm", "slurm.partition=debug", *extra]
    )
    cmd = [
        sys.executable,
        "-m",
        app,
        *(["-m"] if sweep else []),
        *train_args(app, steps),
        f"results_dir={results_dir}",
        *how,
    ]
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO
    ), log


def job_id(log: Path, proc: subprocess.Popen, results_dir: Path, timeout: float = 120) -> str:
    """From launcher=slurm's "submitted Slurm job N", or the one job in the queue (a sweep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"submitted Slurm job (\d+)", log.read_text())
        if m:
            return m.group(1)
        if "sweep output dir" in log.read_text():
            for folder in results_dir.glob("*/multirun-*/.submitit/*"):
                if re.fullmatch(r"\d+(_\d+)?", folder.name):  # 12, or 12_0 in an array
                    return folder.name
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError(f"no job submitted within {timeout} s:\n{log.read_text()}")


def stop_all(proc: subprocess.Popen, job: str | None) -> None:
    """A failed test leaves neither the launcher nor its Slurm job behind."""
    proc.kill()
    if job:
        subprocess.run(["scancel", job], capture_output=True)


def steps_recorded(results_dir: Path) -> int:
    files = list(results_dir.rglob("records.jsonl"))
    return (
        sum('"kind": "step"' in line for line in files[0].read_text().splitlines()) if files else 0
    )


def wait_until(what: str, cond, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"finished before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


def events(run: Path) -> list[dict]:
    return [
        json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()
    ]


def finish_and_check(
    proc, log: Path, results_dir: Path, reference: list[float], steps: int
) -> list[dict]:
    assert proc.wait(timeout=600) == 0, log.read_text()
    [run] = loader.complete_runs([results_dir])
    rows = loader.load([results_dir], kind="step")
    assert list(rows["step"]) == list(range(1, steps + 1))  # every step once: none lost, none twice
    assert list(rows["loss"]) == reference  # bit-identical to the uninterrupted run
    ev = events(run.path)
    kinds = [e["kind"] for e in ev]
    assert {"preempted", "requeued", "resumed"} <= set(kinds), kinds
    stop = next(e for e in ev if e["kind"] == "preempted")
    resumed = next(e for e in ev if e["kind"] == "resumed")
    assert (
        resumed["step"] == stop["step"] > 0 and Path(stop["checkpoint"]).parent.parent == run.path
    )
    return ev


# ~60 s: a 2-point sweep, requeued mid-run (the USR2 test covers the same resume path)
@pytest.mark.slow
def test_scontrol_requeue_of_a_sweep_point_resumes_exactly(tmp_path, slurm_cluster):
    """Slurm requeues a Hydra sweep point (TERM): the ranks checkpoint at the next step boundary and
    exit; the requeued point resumes in the same sweep subfolder."""
    print(f"seed={SEED}")
    steps = (
        60  # ~4 s of training after step 10 on an idle 2-core machine: the requeue lands mid-run
    )
    reference = reference_losses("fsdp_scaling", steps, tmp_path)
    out = tmp_path / "run"
    proc, log = start("fsdp_scaling", steps, out, "hydra.launcher.timeout_min=10", sweep=True)
    job = None
    try:
        job = job_id(log, proc, out)
        wait_until("step 10", lambda: steps_recorded(out) >= 10, proc, log, timeout=180)
        subprocess.run(["scontrol", "requeue", job], check=True)
        ev = finish_and_check(proc, log, out, reference, steps)
    finally:
        stop_all(proc, job)
    stop = next(e for e in ev if e["kind"] == "preempted")
    assert stop["reason"] == "terminated" and stop["signal"] == "TERM"
    assert next(e for e in ev if e["kind"] == "requeued")["restart_count"] == 1


def test_usr2_checkpoints_and_requeues_through_submitit(tmp_path, slurm_cluster):
    """The time-limit signal (USR2, sent here at once): fp8-train saves, submitit requeues it."""
    print(f"seed={SEED}")
    steps = 30
    out = tmp_path / "run"
    proc, log = start("fp8_train", steps, out, "slurm.time_min=10")
    job = None
    try:
        job = job_id(log, proc, out)
        wait_until("step 5", lambda: steps_recorded(out) >= 5, proc, log, timeout=180)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        # the uninterrupted run on local ranks while Slurm holds the requeued job (BeginTime)
        reference = reference_losses("fp8_train", steps, tmp_path)
        ev = finish_and_check(proc, log, out, reference, steps)
    finally:
        stop_all(proc, job)
    stop = next(e for e in ev if e["kind"] == "preempted")
    assert stop["signal"] == "USR2"
    assert (
        stop["reason"] == "time_limit"
    )  # submitit counts every USR2 of a job under 10 min as a time-out


@pytest.mark.slow
@pytest.mark.timeout(900)  # a reference run, then a real time limit: both outlast the signal
def test_time_limit_signal_requeues_and_resumes(tmp_path, slurm_cluster):
    """A real 3-minute limit: Slurm sends USR2 signal_delay_s before it (up to 60 s earlier: sbatch
    --signal; checked every ~30 s here), the job checkpoints and requeues; the requeued job gets a
    longer limit here so it can finish. The signal is due 90 s in and comes 30 s in at the
    earliest, after the tasks have installed their handlers (a USR2 that lands while submitit is
    still unpickling the task kills it: Slurm's default action; dtrain.run.app.check_signal_delay
    refuses a shorter time_min), and training (6,000 steps: 130 s at the 45 steps/s measured on an
    idle host, longer under load) outlasts the latest the signal can come (90 s)."""
    print(f"seed={SEED}")
    steps = 6000
    reference = reference_losses("fsdp_scaling", steps, tmp_path)
    out = tmp_path / "run"
    proc, log = start("fsdp_scaling", steps, out, "slurm.time_min=3", "slurm.signal_delay_s=90")
    job = None
    try:
        job = job_id(log, proc, out)

        def stopped() -> bool:
            f = next(iter(files_named(out, "events.jsonl")), None)
            return f is not None and '"preempted"' in f.read_text()

        wait_until("preempted event", stopped, proc, log, timeout=200)
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], check=True)
        ev = finish_and_check(proc, log, out, reference, steps)
    finally:
        stop_all(proc, job)
    stop = next(e for e in ev if e["kind"] == "preempted")
    assert stop["signal"] == "USR2" and stop["reason"] == "time_limit"
