"""Is each rank, and its launcher, still alive.

    rank side       `watch_rank`: a daemon thread that beats a heartbeat file and, for local ranks,
                    notices the launcher's death (kill -9 included): the rank records `run_failed`
                    and exits (`orphaned`), so no rank trains on with nobody to collect its results.
    launcher side   `HeartbeatMonitor` names a rank whose heartbeat stopped (SIGSTOP, swapped out,
                    stuck holding the GIL) within `heartbeat_timeout_s`, before the collective
                    timeout would blame a waiting peer.

The rest of keeping ranks and their launcher alive together, or ending them together:
dtrain.run.interrupts (SIGINT/SIGTERM on the launcher), dtrain.run.local_supervisor (local ranks),
dtrain.run.job_watch (a job whose launcher is not ours), dtrain.run.slurm_client_watch (a Slurm
client's death).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from dtrain.results.metrics import RunWriter

HEARTBEAT = "heartbeat.rank{rank}"


def heartbeat_interval(timeout_s: float) -> float:
    return min(5.0, max(0.1, timeout_s / 5))


def watch_rank(
    rank: int,
    run_dir: Path,
    heartbeat_dir: Path | None,
    timeout_s: float | None,
    launcher_pid: int | None = None,
) -> threading.Thread:
    """Beat `heartbeat_dir/heartbeat.rank<N>`; with `launcher_pid`, exit when that process is
    gone."""
    beat = Path(heartbeat_dir, HEARTBEAT.format(rank=rank)) if heartbeat_dir and timeout_s else None
    tmp = (
        beat.with_name(f".{beat.name}") if beat else None
    )  # a dot name: globs of heartbeat.rank* skip it
    interval = heartbeat_interval(timeout_s or 1.0)

    def loop():
        last_beat = 0.0
        while True:
            if launcher_pid is not None and os.getppid() != launcher_pid:
                orphaned(rank, run_dir, launcher_pid, heartbeat_dir)
            if beat is not None and time.monotonic() - last_beat >= interval:
                with contextlib.suppress(
                    OSError
                ):  # a vanished dir means the launcher is cleaning up
                    # written aside and renamed: a reader never sees a half-written beat
                    # (beat_source)
                    tmp.write_text(f"{time.time():.3f} {socket.gethostname()} {os.getpid()}\n")
                    os.replace(tmp, beat)
                last_beat = time.monotonic()
            time.sleep(0.2)

    thread = threading.Thread(target=loop, name="dtrain-liveness", daemon=True)
    thread.start()
    return thread


def orphaned(rank: int, run_dir: Path, launcher_pid: int, launcher_tmp: Path | None = None) -> None:
    """Record why this rank stops, tidy the dead launcher's temp dir (rank 0) and exit now."""
    with contextlib.suppress(OSError):
        with RunWriter(run_dir, rank) as w:
            w.event("run_failed", error=f"launcher (pid {launcher_pid}) died; rank {rank} stopped")
    print(
        f"error: launcher (pid {launcher_pid}) died; rank {rank} stops", file=sys.stderr, flush=True
    )
    if rank == 0 and launcher_tmp is not None:
        shutil.rmtree(launcher_tmp, ignore_errors=True)
    os._exit(1)  # from this thread: the main one may be blocked in a collective


class HeartbeatMonitor:
    """Which rank's heartbeat file has not changed for `timeout_s`, timed by this process's clock
    (so clock skew between hosts does not matter). A rank that never beat is judged from the
    moment the first rank beat, with at least `startup_grace_s` for ranks that import torch slower
    on a loaded host: one stopped before its first beat is hung too."""

    def __init__(
        self,
        heartbeat_dir: Path,
        world_size: int,
        timeout_s: float,
        pids: list[int] | None = None,
        startup_grace_s: float = 60.0,
        count_earlier_beats: bool = False,
    ):
        self.dir, self.world_size, self.timeout_s, self.pids = (
            Path(heartbeat_dir),
            world_size,
            timeout_s,
            pids,
        )
        self.startup_grace_s = startup_grace_s
        self.reset()
        if (
            count_earlier_beats
        ):  # the ranks started before this monitor (rank 0 of a job watching its peers)
            self._baseline = {}

    def reset(self) -> None:
        """Forget what was seen (a Slurm job left RUNNING, e.g. requeued): older beats do not
        count."""
        self._baseline = {r: m for r in range(self.world_size) if (m := self._mtime(r)) is not None}
        self._seen: dict[
            int, tuple[float, float]
        ] = {}  # rank -> (mtime, monotonic when first seen)
        self._first_beat: float | None = None

    def _mtime(self, rank: int) -> float | None:
        try:
            return Path(self.dir, HEARTBEAT.format(rank=rank)).stat().st_mtime
        except OSError:
            return None

    def stale(self) -> tuple[int, float] | None:
        now = time.monotonic()
        worst = None
        for rank in range(self.world_size):
            mtime = self._mtime(rank)
            if mtime is None or mtime == self._baseline.get(rank):
                age = now - self._first_beat if self._first_beat is not None else 0.0
                if age <= self.startup_grace_s:
                    continue
            else:
                self._first_beat = self._first_beat or now
                last = self._seen.get(rank)
                if last is None or last[0] != mtime:
                    self._seen[rank] = (mtime, now)
                    continue
                age = now - last[1]
            if age > self.timeout_s and (worst is None or age > worst[1]):
                worst = (rank, age)
        return worst

    def beat_source(self, rank: int) -> tuple[str, int] | None:
        """(host, pid) of the process that wrote the rank's last heartbeat."""
        with contextlib.suppress(OSError, ValueError):
            _, host, pid = Path(self.dir, HEARTBEAT.format(rank=rank)).read_text().split()
            return host, int(pid)
        return None

    def describe(self, rank: int, age: float) -> str:
        where = ""
        if self.pids and rank < len(self.pids):
            state = process_state(self.pids[rank])
            where = f" (pid {self.pids[rank]}{', ' + state if state else ''})"
        elif source := self.beat_source(
            rank
        ):  # a Slurm task or a torchrun rank: its heartbeat says where
            where = f" (pid {source[1]} on {source[0]})"
        return (
            f"rank {rank}{where} stopped responding: no heartbeat for {age:.0f} s "
            f"(heartbeat_timeout_s={self.timeout_s:g}); it is stopped (SIGSTOP), swapped out or "
            "hung"
        )


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    code = stat.rsplit(")", 1)[1].split()[0]
    return {
        "T": "state T: stopped",
        "t": "state t: traced",
        "D": "state D: uninterruptible wait",
        "Z": "state Z: zombie",
    }.get(code, f"state {code}")
