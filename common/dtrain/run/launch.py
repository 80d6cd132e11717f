"""Run a per-rank function on `world_size` ranks: one API, three places.

    in a job   torchrun variables or a multi-task Slurm step are present: become that rank
    local      spawn `world_size` ranks on this host (gloo on CPU, NCCL on GPUs)
    slurm      submit through submitit; ranks are Slurm tasks (they then take the "in a job" path)

`rank_fn(ctx: RankContext)` runs on every rank; `launch` returns rank 0's return value and the
run directory the ranks agreed on.
If any rank raises, every rank stops within a bounded time (spawned peers are killed, Slurm steps
use --kill-on-bad-exit, and the collective timeout bounds the rest) and the caller gets that
rank's traceback, before any peer's "connection closed". A rank whose heartbeat stops (SIGSTOP)
is named within `heartbeat_timeout_s`; local ranks exit when their launcher dies; SIGINT/SIGTERM
on the launcher stop every rank (or cancel the Slurm job). See dtrain.run.liveness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig, OmegaConf, open_dict

from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run import envinfo, liveness, requeue, rundir
from dtrain.slurm import queue
from dtrain.run.liveness import Interrupted, RankFailed  # noqa: F401  (re-exported for apps)
from dtrain.results.metrics import ENV, RunWriter, write_config, write_json_atomic

if TYPE_CHECKING:
    import torch
# torch.distributed is imported where a rank uses it: the launching process checks its command line
# with this module (dtrain.run.app) before torch is needed, so a wrong override fails in a fraction
# of a
# second.

LAUNCHERS = ("auto", "local", "slurm")


@dataclass
class RankContext:
    cfg: DictConfig
    env: ddist.DistEnv
    device: torch.device
    backend: str
    run_dir: Path
    writer: RunWriter
    hosts: list[str] = dataclasses.field(
        default_factory=list
    )  # every rank's hostname, in rank order

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    is_main = property(lambda self: self.env.rank == 0)

    @property
    def gpu_name(self) -> str | None:
        """This rank's GPU model (None on CPU): what a record's provenance names."""
        import torch

        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()


def mode_of(cfg: DictConfig) -> str:
    """'job' when this process already is a rank, else the configured launcher."""
    if cfg.launcher not in LAUNCHERS:
        raise UserError(f"launcher={cfg.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if ddist.detect_job(cfg.launcher) is not None:
        return "job"
    return "slurm" if cfg.launcher == "slurm" else "local"


def max_local_cpu_ranks() -> int:
    # Oversubscription is fine for correctness runs (tp=4 on 2 cores), not beyond reason.
    return max(8, 4 * (os.cpu_count() or 1))


def check_local(cfg: DictConfig) -> str:
    """Resolve `device` once, here in the parent, for every local rank; returns "cuda" or "cpu"."""
    n = cfg.world_size
    device = ddist.device_type(cfg.device)
    gpus = ddist.cuda_count()
    if device == "cuda" and n > gpus:
        raise UserError(
            f"world_size={n} asks for {n} CUDA ranks but this host has {gpus} GPU(s) (one rank "
            f"per GPU): set world_size={gpus}, or device=cpu for {n} CPU ranks, or use "
            "launcher=slurm"
        )
    if device == "cpu" and n > max_local_cpu_ranks():
        raise UserError(
            f"world_size={n} is more ranks than this host allows ({max_local_cpu_ranks()} CPU "
            "ranks): lower world_size or use launcher=slurm"
        )
    return device


def launch(
    rank_fn: Callable[[RankContext], Any], cfg: DictConfig, run_dir: Path
) -> tuple[Any, Path]:
    mode = mode_of(cfg)
    if mode == "job":
        return run_rank(rank_fn, cfg, run_dir, ddist.detect_job(), launcher="job")
    if mode == "local":
        device = check_local(cfg)  # the ranks do not re-decide: all of them cuda, or all cpu
        return _launch_local(rank_fn, cfg, run_dir, device), run_dir
    return _launch_slurm(rank_fn, cfg, run_dir), run_dir


# ---------------------------------------------------------------- inside a rank


def run_rank(
    rank_fn,
    cfg: DictConfig,
    run_dir: Path,
    env: ddist.DistEnv,
    launcher: str,
    device_type: str | None = None,
) -> tuple[Any, Path]:
    """`device_type`: decided by the local launcher for every rank (None: this rank decides from
    cfg.device). cfg stays as composed: config.yaml records what was asked, env.json what was
    used."""
    import torch.distributed as dist

    device = ddist.pick_device(device_type or cfg.device, env.local_rank)
    backend = ddist.pick_backend(cfg.backend, device)
    threads = (
        ddist.set_cpu_threads(cfg.threads_per_rank, env.local_world_size)
        if device.type == "cpu"
        else None
    )
    ddist.init(env, backend, device, cfg.dist_timeout_s)
    # On an exception we deliberately skip destroy(): peers may be blocked in a collective,
    # and the launcher (or the collective timeout) stops them.
    run_dir = _agree_on_run_dir(run_dir, env)
    hosts = [None] * env.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.world_size = env.world_size  # in a job, the job's size is the truth
    if env.rank == 0:
        write_config(run_dir, cfg)
        write_json_atomic(
            run_dir / ENV,
            envinfo.collect(
                backend=backend,
                world_size=env.world_size,
                device=str(device),
                launcher=launcher,
                hosts=hosts,
                threads_per_rank=threads,
            ),
        )
    if launcher == "job":  # the Slurm launcher and the local one watch heartbeats themselves
        liveness.watch_job(env.rank, env.world_size, run_dir, cfg.get("heartbeat_timeout_s"))
    with RunWriter(run_dir, env.rank) as writer:
        requeue.start_attempt(run_dir, env.rank, writer)
        try:
            result = rank_fn(RankContext(cfg, env, device, backend, run_dir, writer, hosts))
        except Exception as e:
            if launcher != "job":
                raise
            if "SLURM_JOB_ID" in os.environ:
                # Hydra keeps a sweep point's exception in its JobReturn (sacct says COMPLETED):
                # the job's own log must show it, for `dtrain runs` and for whoever reads the log
                traceback.print_exc()
            root = (
                None
                if isinstance(e, UserError)
                else liveness.job_root_cause(run_dir, env.rank, traceback.format_exc())
            )
            if (
                root
            ):  # what the job's launcher shows (task 0) is then the root cause, not the symptom
                raise RuntimeError(root) from e
            raise
    if env.world_size > 1:
        dist.barrier()
    ddist.destroy()
    return (result if env.rank == 0 else None), run_dir


def _agree_on_run_dir(run_dir: Path, env: ddist.DistEnv) -> Path:
    """In a job each rank's Hydra picked its own timestamped dir; rank 0's wins."""
    if env.world_size == 1:
        return Path(run_dir)
    import torch.distributed as dist

    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    chosen = Path(box[0])
    if chosen.resolve() != Path(run_dir).resolve():
        rundir.discard(run_dir, claimed=False)  # Hydra's bookkeeping, in a folder this process made
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


# ---------------------------------------------------------------- local


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


def _launch_local(rank_fn, cfg, run_dir: Path, device_type: str) -> Any:
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
        liveness.supervise_local(ctx, Path(side_dir), cfg.get("heartbeat_timeout_s"))
        with open(Path(side_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        with (
            liveness.deferred_interrupts()
        ):  # a second Ctrl-C must not leave ranks or the temp folder behind
            if ctx is not None:
                liveness.kill_all(
                    ctx.processes
                )  # no-op when they finished; on Interrupted they must not outlive us
            shutil.rmtree(side_dir, ignore_errors=True)


# ---------------------------------------------------------------- slurm


class SlurmTask:
    """What every Slurm task runs: become the rank submitit describes.

    It follows submitit's Checkpointable protocol: on USR2 (time limit or preemption) submitit
    calls `checkpoint()`, pickles the returned submission and requeues the job. The state to keep
    is already on disk (the trainer's DCP checkpoint in run_dir), so the same task is resubmitted
    and picks it up (dtrain/run/requeue.py)."""

    def __init__(self, rank_fn, cfg, run_dir: str):
        self.rank_fn, self.cfg, self.run_dir = rank_fn, cfg, run_dir

    def __call__(self):
        requeue.exit_if_complete(
            Path(self.run_dir), check_owner=False
        )  # requeued after it finished
        env = ddist.env_from_slurm() or ddist.DistEnv(0, 1, 0, 1, "127.0.0.1", ddist.free_port())
        liveness.watch_rank(
            env.rank,
            Path(self.run_dir),
            Path(self.run_dir, "slurm"),
            self.cfg.get("heartbeat_timeout_s"),
        )
        return run_rank(self.rank_fn, self.cfg, Path(self.run_dir), env, launcher="slurm")[0]

    def checkpoint(self, *args, **kwargs):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def requeue_options(s: DictConfig) -> tuple[int, dict]:
    """slurm.requeue / max_requeues -> (submitit's max_num_timeout, the sbatch flag): without
    requeue a time-out is final and Slurm may not requeue the job either."""
    if s.get("requeue", True):
        return int(s.get("max_requeues", 3)), {"requeue": True}
    return 0, {"no_requeue": True}


def slurm_executor(cfg: DictConfig, folder: Path):
    if shutil.which("sbatch") is None:
        raise UserError(
            "launcher=slurm needs Slurm's sbatch on PATH: run on a login node, or start the local "
            'cluster (scripts/slurm-cluster start; eval "$(scripts/slurm-cluster env)")'
        )
    import submitit

    s = cfg.slurm
    tasks = s.tasks_per_node or math.ceil(cfg.world_size / s.nodes)
    if s.nodes * tasks != cfg.world_size:
        raise UserError(
            f"world_size={cfg.world_size} is not slurm.nodes={s.nodes} x "
            f"slurm.tasks_per_node={tasks}"
        )
    max_timeouts, requeue_flag = requeue_options(s)
    ex = submitit.AutoExecutor(
        folder=str(folder), cluster="slurm", slurm_max_num_timeout=max_timeouts
    )
    params = dict(
        name=f"dtrain-{cfg.subproject}",
        nodes=s.nodes,
        tasks_per_node=tasks,
        cpus_per_task=s.cpus_per_task,
        timeout_min=s.time_min,
        slurm_srun_args=["--kill-on-bad-exit=1"],
        slurm_signal_delay_s=int(s.get("signal_delay_s", 60)),  # USR2 this long before the limit
        slurm_additional_parameters={**requeue_flag, **OmegaConf.to_container(s.additional)},
    )
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem_gb:
        params["mem_gb"] = s.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        if s.get(key):
            params[f"slurm_{key}"] = s[key]
    ex.update_parameters(**params)
    queue.check_fits(s, tasks)
    return ex


def _launch_slurm(rank_fn, cfg, run_dir: Path) -> Any:
    from submitit.core.utils import FailedJobError, UncompletedJobError

    ex = slurm_executor(cfg, run_dir / "slurm")
    try:
        with contextlib.redirect_stderr(
            io.StringIO()
        ):  # submitit prints sbatch's refusal; we say it once
            job = ex.submit(SlurmTask(rank_fn, cfg, str(run_dir)))
    except (
        FailedJobError
    ) as e:  # sbatch said no: an option the cluster does not know or allow, or no cluster
        raise queue.refused(
            str(e),
            "job",
            "check slurm.partition, slurm.constraint, slurm.account, "
            "slurm.qos and slurm.additional",
        ) from None
    watch = liveness.start_client_watch(
        job.job_id, run_dir
    )  # cancels the job if this process is killed
    print(
        f"submitted Slurm job {job.job_id} ({cfg.world_size} tasks); logs in {run_dir / 'slurm'}",
        flush=True,
    )
    try:
        _wait_slurm(job, cfg, run_dir)
    except liveness.JobEnded:  # cancelled from outside: nothing left to cancel
        raise
    except (
        BaseException
    ):  # Interrupted, a hung rank, a job that can never start: it must not run on
        job.cancel(check=False)
        print(f"cancelled Slurm job {job.job_id}", flush=True)
        raise
    finally:
        liveness.client_done(watch)
    results, failures = [], []
    for i in range(cfg.world_size):  # every task's outcome: the first to fail is not always task 0
        try:
            results.append(job.task(i).result())
        except (FailedJobError, UncompletedJobError) as e:
            failures.append(
                (liveness.is_peer_symptom(str(e)), "Traceback" not in str(e), i, str(e))
            )
    if not failures:
        return results[0]
    _raise_if_cancelled(job.job_id, queue.state(job.job_id))  # submitit saw it first
    _raise_if_timed_out(job.job_id, cfg.slurm, [t for *_, t in failures])
    failures.sort()  # a task's own traceback first; "connection closed" and killed-by-Slurm after
    text = "\n".join(f"--- task {i}:\n{t}" for _, _, i, t in failures)
    if "UserError: " in text:
        raise UserError(text.split("UserError: ", 1)[1].splitlines()[0]) from None
    _, _, first, first_text = failures[0]
    raise RankFailed(
        f"Slurm job {job.job_id} failed:\n{text}",
        error=f"task {first}: {liveness.error_line(first_text)}",
    ) from None


# what a task's outcome says when the job ran out of time for good: submitit's handler after the
# last allowed requeue (or with requeue off), or Slurm's own kill at the limit
_TIMED_OUT = ("timed-out too many times", "state: TIMEOUT")


def _raise_if_cancelled(job_id: str, job_state: tuple[str, str] | None) -> None:
    by = queue.cancelled(job_id, job_state)
    if by is not None:
        how = f" (scancel {by})" if by else ""
        raise liveness.JobEnded(f"Slurm job {job_id} was cancelled{how}", reason="cancelled")


def _raise_if_timed_out(job_id: str, s: DictConfig, texts: list[str]) -> None:
    """A job that hit its time limit once more than slurm.max_requeues allow: one line, not the
    tasks' dumps (every task's log says the same)."""
    if not any(marker in t for t in texts for marker in _TIMED_OUT):
        return
    requeues, _ = requeue_options(s)
    how = (
        f"after slurm.max_requeues={requeues} requeue(s)"
        if s.get("requeue", True)
        else "(slurm.requeue=false)"
    )
    raise liveness.JobEnded(
        f"Slurm job {job_id} reached its time limit (slurm.time_min={s.time_min}) {how}",
        reason="time_limit",
        fix="raise slurm.time_min or slurm.max_requeues",
    )


def _wait_slurm(job, cfg, run_dir: Path) -> None:
    """Until the job ends; watching heartbeats (a hung rank), the pending reason (said while it
    waits; a job that can never start is cancelled) and a cancel from outside (scancel: said within
    a queue check, where submitit's own poll of sacct takes ~40 s and ends in every task's log).
    Heartbeats count only while squeue says RUNNING: a requeued job's ranks are rightly silent."""
    timeout = cfg.get("heartbeat_timeout_s")
    monitor = (
        liveness.HeartbeatMonitor(run_dir / "slurm", cfg.world_size, timeout) if timeout else None
    )
    running, next_queue_check, said = False, 0.0, None
    while not job.done():
        if time.monotonic() > next_queue_check:
            job_state = queue.state(job.job_id)
            reason = queue.never_starts(job_state)
            if reason:
                raise UserError(
                    f"Slurm job {job.job_id} can never start (squeue: PENDING, {reason}), "
                    "cancelled: ask for fewer CPUs/GPUs/nodes/time, or another slurm.partition"
                )
            said = _say_pending(job.job_id, job_state, said, cfg.slurm.get("partition"))
            _raise_if_cancelled(job.job_id, job_state)
            if running and job_state and job_state[0] != "RUNNING" and monitor:
                monitor.reset()
            running = bool(job_state) and job_state[0] == "RUNNING"
            next_queue_check = time.monotonic() + 2
        hung = monitor.stale() if monitor and running else None
        if hung:
            raise RankFailed(
                f"Slurm job {job.job_id}: " + monitor.describe(*hung), error=monitor.describe(*hung)
            )
        time.sleep(1)


def _say_pending(
    job_id: str, job_state: tuple[str, str] | None, said: str | None, partition: str | None
) -> str | None:
    """Print why the job waits, once and whenever the reason changes; returns what was said last."""
    if not job_state or job_state[0] != "PENDING" or job_state[1] in ("None", ""):
        return said
    why = queue.pending_reason(job_state[1], partition)
    if why != said:
        print(f"waiting: Slurm job {job_id} pending ({why})", flush=True)
    return why
