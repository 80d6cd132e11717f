"""The local launcher's watch over its spawned ranks: wait for them; on a failure or a hang kill
them all and raise the root cause (a rank's own error before the "connection closed" its peers
got)."""

from __future__ import annotations

import multiprocessing.connection
import signal
import time
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.run.liveness import HeartbeatMonitor, process_state
from dtrain.run.rank_failure import RankFailed, error_line, is_peer_symptom

PEER_GRACE_S = 2.0  # after a rank fails, how long its peers may take to fail on their own


def supervise_local(ctx, side_dir: Path, heartbeat_timeout_s: float | None) -> None:
    """Wait for torch.multiprocessing's ranks; on a failure or a hang kill them all and raise the
    root cause (RankFailed, or the UserError a rank raised). The caller kills them on
    Interrupted."""
    procs = ctx.processes
    monitor = (
        HeartbeatMonitor(side_dir, len(procs), heartbeat_timeout_s, ctx.pids())
        if heartbeat_timeout_s
        else None
    )
    while not any(p.exitcode not in (None, 0) for p in procs):
        if all(p.exitcode == 0 for p in procs):
            return
        hung = monitor.stale() if monitor else None
        if hung:
            message = monitor.describe(*hung)  # before the kill: it reads the process's state
            kill_all(procs)
            raise RankFailed(message, error=message)
        multiprocessing.connection.wait(
            [p.sentinel for p in procs if p.exitcode is None], timeout=0.5
        )
    deadline = time.monotonic() + PEER_GRACE_S
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        multiprocessing.connection.wait(
            [p.sentinel for p in procs if p.exitcode is None], timeout=0.1
        )
    stopped = [
        i
        for i, p in enumerate(procs)
        if p.exitcode is None and process_state(p.pid).startswith("state T")
    ]
    survivors = {i for i, p in enumerate(procs) if p.exitcode is None}
    kill_all(procs)
    raise _root_cause(procs, side_dir, survivors, stopped)


def kill_all(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.kill()  # SIGKILL: a stopped (SIGSTOP) process ignores everything else
    for p in procs:
        p.join(10)


def _root_cause(procs, side_dir: Path, survivors: set[int], stopped: list[int]) -> BaseException:
    """The error to show first: a rank's own error before the "connection closed" its peers got."""
    for i in range(len(procs)):
        user_error = Path(side_dir, f"usererror.{i}")
        if user_error.exists():
            return UserError(user_error.read_text())
    failures = []  # (is a peer symptom, when, rank, message, one line)
    for i, p in enumerate(procs):
        if i in survivors or p.exitcode in (None, 0):
            continue
        path = Path(side_dir, f"error.{i}")  # the rank's traceback, written as it failed
        if path.exists():
            text = path.read_text()
            failures.append(
                (
                    is_peer_symptom(text),
                    path.stat().st_mtime,
                    i,
                    f"rank {i} failed:\n{text}",
                    f"rank {i}: {error_line(text)}",
                )
            )
        else:
            how = (
                f"killed by {signal.Signals(-p.exitcode).name}"
                if p.exitcode < 0
                else f"exit code {p.exitcode}"
            )
            hint = (
                " (out of memory? the kernel's OOM killer sends SIGKILL)"
                if p.exitcode == -signal.SIGKILL
                else ""
            )
            line = f"rank {i} exited with code {p.exitcode} ({how}){hint}"
            failures.append((False, 0.0, i, line, line))
    failures.sort()
    if stopped and (
        not failures or failures[0][0]
    ):  # the peers only timed out or lost the connection
        first = f"rank {stopped[0]} is stopped (SIGSTOP); its peers failed waiting for it"
        return RankFailed(
            first + "".join(f"\n(rank {f[2]} then failed: {f[4]})" for f in failures), error=first
        )
    others = "".join(f"\n(after it, {f[4]})" for f in failures[1:])
    return RankFailed(failures[0][3] + others, error=failures[0][4])
