"""Ranks of a job whose launcher is not ours (torchrun, a Hydra submitit sweep point): every rank
beats into the run dir and rank 0 watches the beats (`watch_job`, `end_job`); a rank whose own
error is only a peer symptom names the peer that failed first (`job_root_cause`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dtrain.results.metrics import RunWriter
from dtrain.run.liveness import HeartbeatMonitor, heartbeat_interval, watch_rank
from dtrain.run.rank_failure import error_line, is_peer_symptom

JOB_ERRORS = ".rank-errors"  # in the run dir: each failed rank's traceback, for its peers to name


def job_root_cause(run_dir: Path, rank: int, text: str, wait_s: float = 10.0) -> str | None:
    """In a job (Slurm tasks, torchrun) each rank fails on its own and the job's launcher
    (submitit, Hydra's submitit plugin) shows task 0's error, usually the "connection closed" it
    got when the failing rank exited. Every failing rank leaves its traceback in the run dir; a
    rank whose own error is only that symptom waits briefly for a peer's real error and returns
    the line to raise in its place."""
    folder = Path(run_dir, JOB_ERRORS)
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
        Path(folder, f"rank{rank}.txt").write_text(text)
    if not is_peer_symptom(text):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        for path in sorted(folder.glob("rank*.txt")):
            other = path.read_text(errors="replace")
            if path.stem != f"rank{rank}" and not is_peer_symptom(other):
                return (
                    f"{path.stem.replace('rank', 'rank ')} failed first: {error_line(other)} "
                    f"(rank {rank} then lost its peer: {error_line(text)})"
                )
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


# in the run dir, for a job no process of ours launched (torchrun, Hydra's submitit)
JOB_HEARTBEATS = ".heartbeats"


def watch_job(rank: int, world_size: int, run_dir: Path, timeout_s: float | None) -> None:
    """In a job whose launcher is not ours (torchrun, a Hydra submitit sweep point), nobody
    watches the heartbeats: every rank beats into the run dir and rank 0 watches them, so a
    stopped rank ends the job within `timeout_s` instead of after dist_timeout_s."""
    if not timeout_s:
        return
    folder = Path(run_dir, JOB_HEARTBEATS)
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
    watch_rank(rank, run_dir, folder, timeout_s)
    if rank != 0 or world_size < 2:
        return
    monitor = HeartbeatMonitor(folder, world_size, timeout_s, count_earlier_beats=True)

    def loop():
        while True:
            time.sleep(heartbeat_interval(timeout_s))
            hung = monitor.stale()
            if hung:
                end_job(run_dir, monitor.describe(*hung), hung_rank_at=monitor.beat_source(hung[0]))

    threading.Thread(target=loop, name="dtrain-job-monitor", daemon=True).start()


def end_job(run_dir: Path, error: str, hung_rank_at: tuple[str, int] | None = None) -> None:
    """Rank 0 of a job: record why, cancel the Slurm job (every task, the stopped one too) and exit;
    under torchrun our exit makes its agent stop the other ranks. A stopped rank on this host is
    killed first: torchrun's SIGTERM waits until it is continued, and its SIGKILL comes 30 s
    later."""
    with contextlib.suppress(OSError), RunWriter(run_dir) as w:
        w.event("run_failed", error=error)
    print(f"error: {error}; ending the job", file=sys.stderr, flush=True)
    job = os.environ.get("SLURM_JOB_ID")
    if job and shutil.which("scancel"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", job], timeout=30, capture_output=True)
    elif hung_rank_at and hung_rank_at[0] == socket.gethostname():
        with contextlib.suppress(OSError):
            os.kill(hung_rank_at[1], signal.SIGKILL)
    os._exit(1)  # from this thread: the main one may be blocked in a collective
