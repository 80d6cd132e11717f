"""Fault injection on local runs: kill -9 / Ctrl-C / SIGTERM of the launcher, a stopped rank, and
which rank's error is shown first. Every test starts its launcher in a new session and kills that
session at the end, so nothing outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO
from dtrain.core.files import files_named
from dtrain.run import job_watch, liveness, local_supervisor, rank_failure

START_TIMEOUT_S = 60  # two spawned ranks import torch and rendezvous; slow on a loaded 2-core host


def _start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain.run.selftest",
            "world_size=2",
            "work_s=60",
            f"results_dir={tmp_path}",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
        preexec_fn=_interruptible,
    )


def _interruptible() -> None:
    """In the child: Ctrl-C as in a terminal, even when pytest runs in the background (SIGINT
    ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    s = _stat(pid)
    return (
        s is not None and s[0] != "Z"
    )  # a zombie has ended; only its parent has not read its status


def _ranks_of(launcher: int) -> list[int]:
    """The launcher's spawned ranks, in start order (= rank order)."""
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and (s := _stat(int(p.name))) and int(s[1]) == launcher:
            try:
                if b"spawn_main" in Path(p, "cmdline").read_bytes():
                    kids.append((int(s[19]), int(p.name)))  # field 22: start time
            except OSError:
                pass
    return [pid for _, pid in sorted(kids)]


def _wait_running(proc: subprocess.Popen, tmp_path: Path) -> tuple[Path, list[int]]:
    """Until rank 0 wrote config.yaml (rendezvous done, ranks in their all-reduce loop)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        configs = [p for p in files_named(tmp_path, "config.yaml") if ".hydra" not in p.parts]
        if configs and proc.poll() is None:
            ranks = _ranks_of(proc.pid)
            if len(ranks) == 2:
                return configs[0].parent, ranks
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("ranks did not start in time")


def _wait_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - t0 < timeout, (
            f"ranks still alive: {[p for p in pids if _alive(p)]}"
        )
        time.sleep(0.1)
    return time.monotonic() - t0


def _events(run: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted(run.glob("events*.jsonl"))
        for line in f.read_text().splitlines()
    ]


@pytest.fixture
def launcher_session():
    procs = []
    yield procs.append
    for p in procs:  # whatever happened, no process of the test's session survives it
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate(timeout=30)


def test_kill9_launcher_ends_every_rank_and_records_run_failed(tmp_path, launcher_session):
    proc = _start(tmp_path)
    launcher_session(proc)
    run, ranks = _wait_running(proc, tmp_path)
    [launcher_tmp] = [
        b.parent
        for b in Path(tempfile.gettempdir()).glob("dtrain-launch-*/heartbeat.rank0")
        if b.read_text().split()[-1:] == [str(ranks[0])]
    ]
    os.kill(proc.pid, signal.SIGKILL)
    took = _wait_gone(ranks, timeout=15)
    print(f"ranks {ranks} gone {took:.1f} s after kill -9 of launcher {proc.pid}")
    failed = [e for e in _events(run) if e["kind"] == "run_failed"]
    assert failed and all(f"launcher (pid {proc.pid}) died" in e["error"] for e in failed), failed
    assert any(e["rank"] == 0 for e in failed)  # rank 0's goes to events.jsonl, the run's own file
    assert not (run / "summary.json").exists()
    assert not launcher_tmp.exists()  # rank 0 tidied the dead launcher's temp dir


@pytest.mark.parametrize(
    "sig, to_group, code",
    [
        (signal.SIGINT, True, 130),
        pytest.param(
            signal.SIGTERM, False, 143, marks=pytest.mark.slow
        ),  # the same path, another signal
    ],
)
def test_interrupt_stops_ranks_one_error_line(tmp_path, launcher_session, sig, to_group, code):
    """SIGINT to the whole process group, as Ctrl-C in a terminal does; SIGTERM to the launcher
    only."""
    proc = _start(tmp_path)
    launcher_session(proc)
    run, ranks = _wait_running(proc, tmp_path)
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    _wait_gone(ranks, timeout=5)
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: interrupted by {sig.name}"), err
    failed = [e for e in _events(run) if e["kind"] == "run_failed"]
    assert [e["error"] for e in failed] == [f"interrupted by {sig.name}"]
    assert not (run / "summary.json").exists()


def test_stopped_rank_is_named_by_heartbeat(tmp_path, launcher_session):
    timeout_s = 3
    proc = _start(tmp_path, f"heartbeat_timeout_s={timeout_s}")
    launcher_session(proc)
    run, ranks = _wait_running(proc, tmp_path)
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    print(f"stopped rank detected after {took:.1f} s (heartbeat_timeout_s={timeout_s})")
    assert proc.returncode == 1, err
    assert f"rank 1 (pid {ranks[1]}, state T: stopped) stopped responding" in err, err
    assert (
        took < timeout_s + 20
    )  # the bound: timeout + a beat interval + polling, not dist_timeout_s (300)
    _wait_gone(ranks, timeout=10)
    [failed] = [e for e in _events(run) if e["kind"] == "run_failed"]
    assert failed["error"].startswith("rank 1 (pid") and "heartbeat_timeout_s=3" in failed["error"]


@pytest.mark.parametrize("value", [-1.0, 0.001, float("inf")])
def test_bad_heartbeat_timeout_is_one_line(value):
    """Below the floor healthy ranks would be judged hung (they beat every timeout/5): refused
    before any rank starts. In process: the command line reaches the same check through
    dtrain.run.precheck."""
    from omegaconf import OmegaConf

    from dtrain.core.errors import UserError
    from dtrain.core.nodes import BaseConfig, defaults
    from dtrain.run import app

    cfg = OmegaConf.merge(defaults(BaseConfig), {"heartbeat_timeout_s": value, "world_size": 1})
    with pytest.raises(UserError) as e:
        app.check_base(cfg)
    assert str(e.value) == (
        f"heartbeat_timeout_s={value!r} must be a number of seconds >= 2 (ranks beat every "
        "timeout/5; below that healthy ranks look hung), or null to turn it off"
    )
    app.check_base(OmegaConf.merge(cfg, {"heartbeat_timeout_s": 2.0}))  # the floor itself is fine


# ---------------------------------------------------------------- root cause, without processes


class _Proc:
    def __init__(self, exitcode, pid=0):
        self.exitcode, self.pid = exitcode, pid


CLOSED = (
    'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
    "torch.distributed.DistBackendError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1234\n"
)
REAL = (
    'Traceback (most recent call last):\n  File "y.py", line 2, in g\nValueError: loss is nan at '
    "step 3\n"
)


def test_root_cause_is_the_real_error_not_the_peer_symptom(tmp_path):
    (tmp_path / "error.1").write_text(REAL)
    (tmp_path / "error.0").write_text(CLOSED)
    os.utime(tmp_path / "error.0", (1000, 1000))  # the peer's symptom even landed first
    os.utime(tmp_path / "error.1", (2000, 2000))
    err = local_supervisor._root_cause([_Proc(1), _Proc(1)], tmp_path, survivors=set(), stopped=[])
    text = str(err)
    assert text.startswith("rank 1 failed:\n" + REAL)
    assert text.index("ValueError") < text.index("Connection closed")
    assert err.error == "rank 1: ValueError: loss is nan at step 3"


def test_root_cause_killed_rank_before_peer_symptom(tmp_path):
    (tmp_path / "error.0").write_text(CLOSED)
    err = local_supervisor._root_cause([_Proc(1), _Proc(-9)], tmp_path, survivors=set(), stopped=[])
    assert str(err).startswith("rank 1 exited with code -9 (killed by SIGKILL) (out of memory?")
    assert err.error.startswith("rank 1 exited with code -9")


def test_root_cause_blames_the_stopped_rank_not_the_waiting_peer(tmp_path):
    (tmp_path / "error.0").write_text(
        CLOSED.replace("Connection closed by peer", "Timed out waiting 300000ms")
    )
    err = local_supervisor._root_cause(
        [_Proc(1), _Proc(None)], tmp_path, survivors={1}, stopped=[1]
    )
    assert err.error == "rank 1 is stopped (SIGSTOP); its peers failed waiting for it"


def test_error_line_finds_the_exception_in_a_submitit_message():
    text = (
        "Job (task=1) failed during processing with trace:\n----------------------\n"
        + REAL
        + "----------------------\nYou can check full logs with 'job.stderr(1)' and "
        "'job.stdout(1)'or at paths:\n  - /tmp/x/slurm/12_1_log.err\n  - "
        "/tmp/x/slurm/12_1_log.out\n"
    )
    assert rank_failure.error_line(text) == "ValueError: loss is nan at step 3"
    assert (
        rank_failure.error_line("srun: error: task 1: Exited with exit code 1\n")
        == "srun: error: task 1: Exited with exit code 1"
    )


def test_heartbeat_monitor_names_the_silent_rank(tmp_path):
    beat = [tmp_path / f"heartbeat.rank{r}" for r in range(3)]
    mon = liveness.HeartbeatMonitor(tmp_path, world_size=3, timeout_s=0.3, startup_grace_s=0)
    assert (
        mon.stale() is None
    )  # nobody beat yet: nothing to judge (a Slurm job may still be pending)
    beat[0].write_text("1 hostA 11\n")
    beat[1].write_text("1 hostB 22\n")
    assert mon.stale() is None
    for i in range(
        8
    ):  # ranks 0 and 1 keep beating; rank 2 never does; rank 1 stops after the first rounds
        time.sleep(0.1)
        os.utime(beat[0], (i + 2.0, i + 2.0))
        if i < 2:
            os.utime(beat[1], (i + 2.0, i + 2.0))
        mon.stale()  # the launcher polls; a change counts from when it is seen
    rank, age = mon.stale()
    assert rank == 2 and age > 0.3  # silent longest: never beat since rank 0 first did
    beat[2].write_text("1 hostC 33\n")
    rank, age = mon.stale()
    assert (
        rank == 1 and 0.3 < age < 5.0
    )  # from when its last change was seen (~0.6 s), not its mtime (epoch 3 s)
    assert mon.describe(1, age).startswith(
        "rank 1 (pid 22 on hostB) stopped responding: no heartbeat for"
    )


def test_heartbeat_monitor_reset_ignores_older_beats(tmp_path):
    """A requeued Slurm job: beats from before the reset do not count, new ones do."""
    beat = [tmp_path / f"heartbeat.rank{r}" for r in range(2)]
    for b in beat:
        b.write_text("1 host 1\n")
    mon = liveness.HeartbeatMonitor(tmp_path, world_size=2, timeout_s=0.2, startup_grace_s=0)
    mon.reset()
    for _ in range(4):
        time.sleep(0.1)
        assert mon.stale() is None  # nobody beat since the reset
    os.utime(beat[0], (5.0, 5.0))
    assert mon.stale() is None
    time.sleep(0.3)
    os.utime(beat[0], (6.0, 6.0))
    rank, _ = mon.stale()
    assert rank == 1  # rank 0 beat after the restart, rank 1 did not


def test_in_a_job_the_peer_symptom_is_replaced_by_the_rank_that_failed_first(tmp_path):
    """Slurm tasks / torchrun ranks: task 0's "connection closed" names rank 1's own error
    instead."""
    own = (
        'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad batch on '
        "purpose\n"
    )
    symptom = (
        "Traceback (most recent call last):\nRuntimeError: [pair.cc:553] Connection closed by "
        "peer [10.0.0.2]:1\n"
    )
    assert job_watch.job_root_cause(tmp_path, 1, own) is None  # a rank's own error stays as it is
    line = job_watch.job_root_cause(tmp_path, 0, symptom, wait_s=0)
    assert line == (
        "rank 1 failed first: ValueError: bad batch on purpose (rank 0 then lost its peer: "
        "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:1)"
    )
    alone = tmp_path / "alone"
    alone.mkdir()
    t0 = time.monotonic()
    assert (
        job_watch.job_root_cause(alone, 0, symptom, wait_s=0.5) is None
    )  # nobody else wrote: the symptom stays
    assert 0.5 <= time.monotonic() - t0 < 5
    assert (alone / job_watch.JOB_ERRORS / "rank0.txt").read_text() == symptom


def test_torchrun_job_names_a_stopped_rank_by_heartbeat(tmp_path, launcher_session):
    """Under torchrun no process of ours supervises: rank 0 watches the others' heartbeats in the
    run dir."""
    timeout_s = 3
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dtrain.run.selftest",
            "work_s=60",
            f"heartbeat_timeout_s={timeout_s}",
            f"results_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    launcher_session(proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (beats := files_named(tmp_path, f"{job_watch.JOB_HEARTBEATS}/heartbeat.rank1")):
        assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start in time"
        time.sleep(0.2)
    time.sleep(0.5)  # the beat's text is written after the file is created
    _, host, pid = beats[0].read_text().split()
    t0 = time.monotonic()
    os.kill(int(pid), signal.SIGSTOP)
    _, err = proc.communicate(timeout=90)
    took = time.monotonic() - t0
    print(f"stopped torchrun rank detected after {took:.1f} s (heartbeat_timeout_s={timeout_s})")
    assert proc.returncode != 0
    assert f"error: rank 1 (pid {pid} on {host}) stopped responding" in err, err[-3000:]
    assert took < timeout_s + 20  # timeout + a beat interval + polling, not dist_timeout_s (300)
    [failed] = [e for e in _events(beats[0].parent.parent) if e["kind"] == "run_failed"]
    assert failed["error"].startswith(f"rank 1 (pid {pid} on {host}) stopped responding")
    assert not _alive(int(pid))
