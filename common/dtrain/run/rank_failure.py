"""How a failed rank or job is said: `RankFailed` (a rank raised, died or hung) and `JobEnded` (a
Slurm job ended from outside), the one error line in a traceback or a log (`error_line`), and the
errors a rank gets only because a peer failed (`is_peer_symptom`), which are never the root cause
when another rank has one.

No torch import here (dtrain.slurm reads error lines with it).
"""

from __future__ import annotations

import re

# Errors a rank gets *because* a peer died or stopped: never the root cause when another rank has
# one.
PEER_SYMPTOMS = (
    "Connection closed",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "DistNetworkError",
    "DistBackendError",
    "timed out",
    "Timeout",
)
_EXC_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failed)\b(?::.*)?$"
)


class RankFailed(RuntimeError):
    """A rank raised, died or hung; the message carries its traceback, `error` the one line for
    run_failed."""

    def __init__(self, message: str, error: str | None = None):
        super().__init__(message)
        self.error = error or error_line(message)


class JobEnded(RankFailed):
    """The Slurm job was ended from outside the run (scancel, its time limit after the last
    requeue): a failed run said in one line (`str`), no task's dump; `reason` goes into
    run_failed, `fix` after the line."""

    def __init__(self, message: str, reason: str, fix: str = ""):
        super().__init__(message, error=message)
        self.reason, self.fix = reason, fix


def error_line(text: str) -> str:
    """The line that names the error ("RuntimeError: ...") in a traceback or a log; else the last
    line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXC_LINE.match(line):
            return line[:500]
    return (lines[-1] if lines else text)[:500]


def is_peer_symptom(text: str) -> bool:
    return any(s in error_line(text) for s in PEER_SYMPTOMS)
