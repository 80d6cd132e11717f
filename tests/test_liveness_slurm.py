"""launcher=slurm under fault injection, on the local cluster: Ctrl-C or kill -9 of the client
cancels its job, a stopped task is named by its heartbeat, a request no node can hold is refused
and a job pending for a reason that never clears is detected. Every test cancels what it
submitted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, py
from dtrain.core.files import files_named

pytestmark = pytest.mark.slurm


def _interruptible() -> None:
    """In the child: Ctrl-C as in a terminal, even when pytest runs in the background (SIGINT
    ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Client:
    """`python -m dtrain.run.selftest launcher=slurm ...` in its own session, output to files."""

    def __init__(
        self, tmp_path: Path, *overrides: str, world_size: int = 2, interruptible: bool = True
    ):
        self.results = tmp_path / "results"
        self.out_path, self.err_path = tmp_path / "client.out", tmp_path / "client.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("RANK", None)
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dtrain.run.selftest",
                    "launcher=slurm",
                    f"world_size={world_size}",
                    "work_s=60",
                    "slurm.partition=debug",
                    "slurm.time_min=5",
                    f"results_dir={self.results}",
                    *overrides,
                ],
                stdout=out,
                stderr=err,
                text=True,
                env=env,
                cwd=REPO,
                start_new_session=True,
                preexec_fn=_interruptible if interruptible else None,
            )
        self.job_id: str | None = None

    def wait_running(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"submitted Slurm job (\d+)", self.out_path.read_text())
            if m:
                self.job_id = m.group(1)
                beats = files_named(self.out_path.parent / "results", "heartbeat.rank*")
                if (
                    len(beats) == 2 and len(_task_pids(self.job_id)) == 2
                ):  # both tasks' Python is up
                    return self.job_id
            assert self.proc.poll() is None, self.err_path.read_text()
            time.sleep(0.5)
        raise AssertionError(f"job did not start running: {self.out_path.read_text()}")

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        return self.proc.wait(timeout=timeout), self.err_path.read_text()

    def cleanup(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        if self.job_id:
            subprocess.run(["scancel", self.job_id], check=False)


@pytest.fixture
def client(tmp_path, slurm_cluster):
    made = []

    def start(*overrides):
        made.append(Client(tmp_path, *overrides))
        return made[-1]

    yield start
    for c in made:
        c.cleanup()


def _squeue_state(job_id: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
    ).stdout.strip()


def _final_state(job_id: str, timeout: float = 30) -> str:
    """The job's state in sacct once it left the queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True
        )
        state = out.stdout.strip()
        if state and not _squeue_state(job_id) and state not in ("RUNNING", "PENDING"):
            return state
        time.sleep(0.5)
    return f"still {_squeue_state(job_id) or state}"


def _task_pids(job_id: str) -> dict[int, int]:
    """SLURM_PROCID -> pid of the task's Python (submitit's _submit) on this host."""
    tasks = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1)
                for kv in Path(p, "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
            cmd = Path(p, "cmdline").read_bytes()
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == job_id and b"submitit.core._submit" in cmd:
            tasks[int(env["SLURM_PROCID"])] = int(p.name)
    return tasks


def _run_failed(tmp_path: Path) -> list[str]:
    return [
        e["error"]
        for f in tmp_path.rglob("events*.jsonl")
        for line in f.read_text().splitlines()
        if (e := json.loads(line))["kind"] == "run_failed"
    ]


def test_ctrl_c_on_client_cancels_the_job(tmp_path, client):
    c = client()
    job = c.wait_running()
    os.killpg(c.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code, err = c.wait(timeout=30)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGINT"), err
    assert _final_state(job).startswith("CANCELLED")
    assert f"cancelled Slurm job {job}" in c.out_path.read_text()
    assert _run_failed(tmp_path) == ["interrupted by SIGINT"]


def test_kill9_of_client_cancels_the_job(tmp_path, client):
    c = client()
    job = c.wait_running()
    os.kill(c.proc.pid, signal.SIGKILL)  # the client cannot act: its watcher must
    c.wait(timeout=10)
    assert _final_state(job).startswith("CANCELLED")
    assert _run_failed(tmp_path) == [f"Slurm client (pid {c.proc.pid}) died; job {job} cancelled"]


@pytest.mark.slow
def test_stopped_task_is_named_and_job_cancelled(tmp_path, client):
    c = client("heartbeat_timeout_s=5")
    job = c.wait_running()
    pid = _task_pids(job)[1]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    code, err = c.wait(timeout=60)
    print(
        f"stopped Slurm task detected after {time.monotonic() - t0:.1f} s (heartbeat_timeout_s=5)"
    )
    assert code == 1, err
    assert f"rank 1 (pid {pid} on " in err and "stopped responding" in err, err
    assert _final_state(job).startswith("CANCELLED")
    [failed] = _run_failed(tmp_path)
    assert failed.startswith(f"rank 1 (pid {pid} on ") and "heartbeat_timeout_s=5" in failed


def test_failing_task_real_error_first_and_in_run_failed(tmp_path, slurm_cluster):
    t0 = time.monotonic()
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "world_size=2",
        "fail_rank=1",
        "slurm.partition=debug",
        "slurm.time_min=5",
        f"results_dir={tmp_path}",
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - t0 < 60  # the job ends with its task, not at its time limit
    assert not list(tmp_path.rglob("summary.json"))
    assert out.stderr.index("fails on purpose") < out.stderr.index(
        "--- task 0"
    )  # not the peer's "connection closed"
    assert _run_failed(tmp_path) == [
        "task 1: RuntimeError: selftest: rank 1 fails on purpose (fail_rank=1)"
    ]


def test_request_no_node_can_hold_is_refused_before_submitting(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "world_size=8",
        "slurm.partition=debug",
        f"results_dir={tmp_path}",
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith(
        "error: Slurm can never run this job: it asks for 1 node(s) with 8 CPUs each"
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "submitted" not in out.stdout and not list(tmp_path.rglob("config.yaml"))


def test_job_pending_for_a_reason_that_never_clears_is_cancelled(tmp_path, slurm_cluster):
    """The backstop for what sinfo cannot foresee: an extra sbatch option (8 tasks on a 2-CPU node)
    slips past the pre-check; Slurm queues the job with reason PartitionConfig."""
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "slurm.partition=debug",
        "+slurm.additional.ntasks_per_node=8",
        f"results_dir={tmp_path}",
        timeout=90,
    )
    job = re.search(r"submitted Slurm job (\d+)", out.stdout).group(1)
    try:
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip() == (
            f"error: Slurm job {job} can never start (squeue: PENDING, PartitionConfig), "
            "cancelled: ask for fewer CPUs/GPUs/nodes/time, or another slurm.partition"
        )
        assert f"cancelled Slurm job {job}" in out.stdout
        assert _final_state(job).startswith("CANCELLED")
    finally:
        subprocess.run(["scancel", job], check=False)


def test_request_sbatch_refuses_is_one_line(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "launcher=slurm",
        "slurm.partition=debug",
        "slurm.constraint=nosuchfeature",
        f"results_dir={tmp_path}",
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: Slurm refused the job (sbatch: error: Batch job submission failed: Invalid "
        "feature specification): check slurm.partition, slurm.constraint, slurm.account, "
        "slurm.qos and slurm.additional"
    ), out.stderr
    assert not list(tmp_path.rglob("config.yaml"))
