"""A `launcher=slurm` client's death: `start_client_watch` runs a detached watcher that cancels the
job and records `run_failed` if the client dies without saying goodbye (`client_done`).

No torch import here: the watcher is a bare `python -m dtrain.run.slurm_client_watch` process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from dtrain.results.metrics import RunWriter


def start_client_watch(job_id: str, run_dir: Path) -> subprocess.Popen:
    """A detached process that cancels `job_id` if this process dies before calling
    `client_done`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain.run.slurm_client_watch",
            str(os.getpid()),
            str(job_id),
            str(run_dir),
        ],
        stdin=subprocess.PIPE,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def client_done(watch: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        watch.stdin.write(b"done\n")
        watch.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watch.wait(timeout=5)


def _watch_client(client_pid: int, job_id: str, run_dir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    said = sys.stdin.buffer.read()  # EOF when the client exits, however it exits
    if b"done" in said:
        return
    subprocess.run(["scancel", job_id], check=False)
    with contextlib.suppress(OSError):
        RunWriter(Path(run_dir)).event(
            "run_failed", error=f"Slurm client (pid {client_pid}) died; job {job_id} cancelled"
        )


if __name__ == "__main__":
    _watch_client(int(sys.argv[1]), sys.argv[2], sys.argv[3])
