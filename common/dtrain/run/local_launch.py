"""Launching `world_size` ranks on this host (torch.multiprocessing, spawn) and tearing them down:
each rank ignores Ctrl-C (the launcher decides), beats its heartbeat and exits when its launcher
dies; the launcher supervises them (dtrain.run.local_supervisor) and, however it ends, kills every
rank and removes its temp folder."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run import interrupts, liveness, local_supervisor
from dtrain.run.rank import run_rank


def _local_worker(
    local_rank: int, rank_fn, cfg, run_dir, world_size, port, side_dir, launcher_pid, device_type
) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole process group; the launcher decides
    signal.pthread_sigmask(
        signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM}
    )  # the launcher held them to spawn
    liveness.watch_rank(
        local_rank, Path(run_dir), Path(side_dir), cfg.get("heartbeat_timeout_s"), launcher_pid
    )
    env = ddist.DistEnv(local_rank, world_size, local_rank, world_size, "127.0.0.1", port)
    try:
        result, _ = run_rank(
            rank_fn, cfg, Path(run_dir), env, launcher="local", device_type=device_type
        )
    except UserError as e:
        Path(side_dir, f"usererror.{local_rank}").write_text(str(e))
        sys.exit(2)
    except BaseException:
        if (
            os.getppid() != launcher_pid
        ):  # a peer died with the launcher: say why, not "connection closed"
            liveness.orphaned(local_rank, Path(run_dir), launcher_pid, Path(side_dir))
        Path(side_dir, f"error.{local_rank}").write_text(
            traceback.format_exc()
        )  # its mtime orders failures
        _leave(1)
    if local_rank == 0:
        with open(Path(side_dir, "result.pkl"), "wb") as f:
            pickle.dump(result, f)
    logging.shutdown()
    _leave(0)


def _leave(code: int) -> None:
    """End a rank without the interpreter's teardown, where gloo's threads now and then abort a
    finished rank ("terminate called without an active exception", SIGABRT) and fail a run that
    succeeded. os._exit skips atexit, so first run multiprocessing's finalizers: they unlink the
    named semaphores a rank made (tqdm's multiprocessing lock, one per rank), which the resource
    tracker would otherwise report after every run ("There appear to be N leaked semaphore
    objects")."""
    import multiprocessing.util

    with contextlib.suppress(Exception):
        multiprocessing.util._run_finalizers()  # what its atexit hook runs; private, hence guarded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch_local(rank_fn, cfg, run_dir: Path, device_type: str) -> Any:
    import torch.multiprocessing as mp

    ctx = None
    # An interrupt while spawning would leave half-started ranks: hold it until they are all known.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    side_dir = tempfile.mkdtemp(prefix="dtrain-launch-")
    try:
        try:
            ctx = mp.start_processes(
                _local_worker,
                args=(
                    rank_fn,
                    cfg,
                    str(run_dir),
                    cfg.world_size,
                    ddist.free_port(),
                    side_dir,
                    os.getpid(),
                    device_type,
                ),
                nprocs=cfg.world_size,
                join=False,
                start_method="spawn",
            )
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        local_supervisor.supervise_local(ctx, Path(side_dir), cfg.get("heartbeat_timeout_s"))
        with open(Path(side_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        with (
            interrupts.deferred_interrupts()
        ):  # a second Ctrl-C must not leave ranks or the temp folder behind
            if ctx is not None:
                local_supervisor.kill_all(
                    ctx.processes
                )  # no-op when they finished; on Interrupted they must not outlive us
            shutil.rmtree(side_dir, ignore_errors=True)
