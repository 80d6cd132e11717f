"""Issue: hardening, third round, area D (the Slurm client). A `scancel`ed job is said in one line
within seconds; a job pending on a drained node says why it waits; a time limit Slurm can signal
too early is refused up front; a job that timed out past slurm.max_requeues ends in one line.
The cluster tests cancel their job and resume the node they drained, whatever happens."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import test_liveness_slurm as liveness_slurm
from conftest import py
from dtrain.core.errors import UserError
from dtrain.core.files import files_named
from dtrain.run.app import check_signal_delay
from dtrain.slurm import queue


# ---------------------------------------------------------------- without a cluster

TOO_SHORT = (
    "slurm.time_min=1 must be >= 2 minutes: Slurm sends USR2 slurm.signal_delay_s=25 s "
    "before the limit and up to 60 s earlier (sbatch --signal), and the tasks need 30 s "
    "for submitit's handler: pass slurm.time_min=2 or more"
)


def test_a_time_limit_usr2_can_precede_is_refused_naming_the_least_time_min():
    """sbatch --signal: USR2 may come up to 60 s before signal_delay_s; the tasks need 30 s."""
    with pytest.raises(UserError) as e:
        check_signal_delay(OmegaConf.create({"time_min": 1, "signal_delay_s": 25}))
    assert str(e.value) == TOO_SHORT
    # no negative signal delay suggested any more
    with pytest.raises(
        UserError,
        match=r"^slurm.time_min=0 must be >= 3 minutes: .*: "
        r"pass slurm.time_min=3 or more$",
    ):
        check_signal_delay(OmegaConf.create({"time_min": 0, "signal_delay_s": 60}))
    with pytest.raises(
        UserError,
        match=r"^slurm.time_min=4 must be >= 5 minutes: .* or lower "
        r"slurm.signal_delay_s to <= 150$",
    ):
        check_signal_delay(OmegaConf.create({"time_min": 4, "signal_delay_s": 200}))
    check_signal_delay(OmegaConf.create({"time_min": 2, "signal_delay_s": 30}))  # 30 s in, earliest
    check_signal_delay(OmegaConf.create({"time_min": 30, "signal_delay_s": 60}))  # the defaults


def test_cli_time_min_too_short_is_one_line_before_slurm_is_asked(tmp_path):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "world_size=1",
        "slurm.time_min=1",
        "slurm.signal_delay_s=25",
        f"results_dir={tmp_path}",
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"error: {TOO_SHORT}"]
    assert not any(tmp_path.iterdir())


def test_cancelled_reads_sacct(monkeypatch):
    answers = {"sacct": "CANCELLED by 0|2026-11-27T06:17:41\n"}
    monkeypatch.setattr(queue, "_run", lambda args, need_cluster=False: answers.get(args[0]))
    assert queue.cancelled("7", None) == "by root at 2026-11-27T06:17:41"
    assert queue.cancelled("7", ("RUNNING", "None")) is None  # active: sacct is not asked
    answers["sacct"] = "COMPLETED|2026-11-27T06:17:41\n"
    assert queue.cancelled("7", ("COMPLETING", "None")) is None
    answers["sacct"] = None  # no accounting: squeue's word while it lists the job
    assert queue.cancelled("7", ("CANCELLED", "None")) == ""
    assert queue.cancelled("7", None) is None


def test_pending_reason_names_drained_nodes_only_when_they_may_be_why(monkeypatch):
    rows = "node1|DRAINED|maintenance\nnode2|DOWN*|Not responding\n"
    monkeypatch.setattr(
        queue, "_run", lambda args, need_cluster=False: rows if args[0] == "sinfo" else None
    )
    assert queue.pending_reason("Resources") == (
        'Resources: node1 drained "maintenance", node2 down "Not responding"'
    )
    assert queue.pending_reason("ReqNodeNotAvail, UnavailableNodes:node1") == (
        'ReqNodeNotAvail, UnavailableNodes:node1; node1 drained "maintenance", '
        'node2 down "Not responding"'
    )
    assert queue.pending_reason("Priority") == "Priority"


# ---------------------------------------------------------------- on the local cluster


class Client(liveness_slurm.Client):
    """`python -m dtrain.run.selftest launcher=slurm world_size=1 ...`, output to files."""

    def __init__(self, tmp_path: Path, *overrides: str):
        super().__init__(tmp_path, *overrides, world_size=1, interruptible=False)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.out_path.read_text())
            if m:
                return m
            assert self.proc.poll() is None, self.out_path.read_text() + self.err_path.read_text()
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.out_path.read_text()}")

    def wait_submitted(self) -> str:
        self.job_id = self.wait_for(r"submitted Slurm job (\d+)", 60).group(1)
        return self.job_id

    def wait_running(self) -> str:
        """Until the task's Python beats (submitit's handler is installed well before)."""
        job = self.wait_submitted()
        deadline = time.monotonic() + 60
        while not files_named(self.results, "heartbeat.rank*"):
            alive = time.monotonic() < deadline and self.proc.poll() is None
            assert alive, self.err_path.read_text()
            time.sleep(0.2)
        time.sleep(2)
        return job

    def run_failed(self) -> list[dict]:
        return [
            e
            for f in files_named(self.results, "events.jsonl")
            for line in f.read_text().splitlines()
            if (e := json.loads(line))["kind"] == "run_failed"
        ]


@pytest.fixture
def client(tmp_path, slurm_cluster):
    made = []

    def start(*overrides):
        made.append(Client(tmp_path, *overrides))
        return made[-1]

    yield start
    for c in made:
        c.cleanup()


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_is_said_in_one_line_within_seconds(client):
    c = client()
    job = c.wait_running()
    start = time.monotonic()
    subprocess.run(["scancel", job], check=True)
    code = c.proc.wait(timeout=30)
    took = time.monotonic() - start
    err = c.err_path.read_text()
    assert code == 1, err
    [line] = err.splitlines()
    assert re.fullmatch(
        rf"error: Slurm job {job} was cancelled \(scancel by \S+ at \S+\): "
        r"run_failed recorded in \S+/events\.jsonl",
        line,
    ), line
    assert took < 15, f"noticed after {took:.1f} s"  # submitit alone: ~40 s
    [failed] = c.run_failed()
    assert failed["reason"] == "cancelled"
    assert failed["error"].startswith(f"Slurm job {job} was cancelled")
    assert not files_named(c.results, "summary.json")


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_past_max_requeues_is_one_line(client):
    """USR2 is what the time limit sends; with slurm.max_requeues=0 the first one is the last."""
    c = client("slurm.max_requeues=0")
    job = c.wait_running()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    code = c.proc.wait(timeout=60)
    err = c.err_path.read_text()
    assert code == 1, err
    [line] = err.splitlines()
    assert re.fullmatch(
        rf"error: Slurm job {job} reached its time limit \(slurm.time_min=5\) "
        r"after slurm.max_requeues=0 requeue\(s\): run_failed recorded in "
        r"\S+/events\.jsonl; raise slurm.time_min or slurm.max_requeues",
        line,
    ), line
    assert [e["reason"] for e in c.run_failed()] == ["time_limit"]


@pytest.mark.slurm
@pytest.mark.slow
def test_job_pending_on_a_drained_node_says_why(client):
    node, why = "node1", "maintenance by test"
    subprocess.run(
        ["scontrol", "update", f"nodename={node}", "state=drain", f"reason={why}"], check=True
    )
    try:
        c = client(f"+slurm.additional.nodelist={node}")
        job = c.wait_submitted()
        start = time.monotonic()
        line = c.wait_for(rf"waiting: Slurm job {job} pending \(.*\)", 15).group(0)
        assert f'{node} drained "{why}"' in line, line
        assert time.monotonic() - start < 15
        assert c.out_path.read_text().count("waiting:") == 1  # said once while the reason stays
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
