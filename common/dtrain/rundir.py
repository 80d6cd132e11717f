"""One run directory, one run: the launching process claims the directory atomically.

`claim(run_dir)` creates `.run-owner` with O_CREAT | O_EXCL (atomic on local filesystems and on
NFSv3+), so of two runs pointed at the same directory - one after the other or both at once - only
the first writes there; the other gets `RunDirTaken`, one `error:` line, and leaves the directory
alone. The file stays after the run: a finished (or failed) run's directory is never reused, except
by the same Slurm job requeued (same job id), which continues its own run.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime
from pathlib import Path

from dtrain.errors import UserError

OWNER = ".run-owner"


class RunDirTaken(UserError):
    """Another run owns the directory; unlike other bad input, the directory is not ours to remove."""


def owner_text(path: Path) -> str:
    try:
        o = json.loads(Path(path).read_text())
        return f"started {o['started']} by pid {o['pid']} on {o['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"owner file {path}"


def slurm_job() -> str | None:
    """This Slurm job (array task included); a requeued job keeps it."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{job}_{task}" if job and task else job


def _same_job_restarted(path: Path) -> bool:
    """A requeued Slurm job runs its task again into the directory it owns: not a second run."""
    job = slurm_job()
    try:
        return job is not None and json.loads(path.read_text()).get("slurm_job") == job
    except (OSError, ValueError, AttributeError):
        return False


def claim(run_dir: Path) -> Path:
    """Make this process the directory's only run, or raise RunDirTaken."""
    path = Path(run_dir) / OWNER
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if _same_job_restarted(path):
            return path
        raise RunDirTaken(f"run directory {run_dir} already holds a run ({owner_text(path)}): pass a new "
                          "hydra.run.dir (or delete the old run); a run directory is never reused") from None
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv, "slurm_job": slurm_job(),
                   "started": datetime.now().isoformat(timespec="seconds")}, f)
    return path
