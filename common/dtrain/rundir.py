"""One run directory, one run: the launching process claims the directory atomically.

`claim(run_dir)` creates `.run-owner` with O_CREAT | O_EXCL (atomic on local filesystems and on
NFSv3+), so of two runs pointed at the same directory - one after the other or both at once - only
the first writes there; the other gets `RunDirTaken`, one `error:` line, and leaves the directory
alone. The file stays after the run: a finished (or failed) run's directory is never reused.
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


def claim(run_dir: Path) -> Path:
    """Make this process the directory's only run, or raise RunDirTaken."""
    path = Path(run_dir) / OWNER
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise RunDirTaken(f"run directory {run_dir} already holds a run ({owner_text(path)}): pass a new "
                          "hydra.run.dir (or delete the old run); a run directory is never reused") from None
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
                   "started": datetime.now().isoformat(timespec="seconds")}, f)
    return path
