"""Keeping ranks and their launcher alive together, or ending them together.

    rank side       `watch_rank`: a daemon thread that beats a heartbeat file and, for local ranks,
                    notices the launcher's death (kill -9 included): the rank records `run_failed`
                    and exits, so no rank trains on with nobody to collect its results.
    launcher side   `HeartbeatMonitor` names a rank whose heartbeat stopped (SIGSTOP, swapped out,
                    stuck holding the GIL) within `heartbeat_timeout_s`, before the collective
                    timeout would blame a waiting peer; `catch_interrupts` turns SIGINT/SIGTERM
                    into `Interrupted`, so the launcher stops its ranks and exits 128+signal.
    Slurm client    `start_client_watch` runs a detached watcher that cancels the job and records
                    `run_failed` if the client dies without saying goodbye.

No torch import here: the Slurm client watcher is a bare `python -m dtrain.run.liveness` process.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.results.metrics import RunWriter

HEARTBEAT = "heartbeat.rank{rank}"
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


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher; a BaseException so no `except Exception` swallows
    it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM


@contextlib.contextmanager
def _interrupt_handler(handler):
    """`handler` for SIGINT/SIGTERM while inside (main thread only; elsewhere nothing changes). A
    signal ignored on purpose (`cmd &` in a script ignores SIGINT) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {
        s: signal.signal(s, handler)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def catch_interrupts():
    """SIGINT/SIGTERM raise `Interrupted` in the main thread while inside (launching process
    only)."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    return _interrupt_handler(handler)


@contextlib.contextmanager
def deferred_interrupts():
    """Clean-up that must finish (kill the ranks, remove the temp folder): SIGINT/SIGTERM
    arriving meanwhile (a second Ctrl-C) are noted, then raised as `Interrupted` once it is done.
    A handler, not a signal mask: the kernel may hand the signal to any thread, and Python runs
    handlers in the main thread."""
    caught: list[int] = []
    with _interrupt_handler(lambda signum, _frame: caught.append(signum)):
        yield
    if caught:
        raise Interrupted(caught[0])


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


# ---------------------------------------------------------------- rank side

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


# ---------------------------------------------------------------- launcher side


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


# ---------------------------------------------------------------- local ranks

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


# ---------------------------------------------------------------- Slurm client death


def start_client_watch(job_id: str, run_dir: Path) -> subprocess.Popen:
    """A detached process that cancels `job_id` if this process dies before calling
    `client_done`."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain.run.liveness", str(os.getpid()), str(job_id), str(run_dir)],
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
