"""Launching ranks as the tasks of a Slurm job (submitit) and waiting for it: the executor from
`slurm.*`, a hung task named by its heartbeat, the pending reason said, a job that can never
start or was cancelled from outside said in one line, every task's outcome collected (a task's own
traceback before its peers' "connection closed"); on any other end the job is cancelled."""

from __future__ import annotations

import contextlib
import io
import math
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run import liveness, requeue, slurm_client_watch
from dtrain.run.rank import run_rank
from dtrain.run.rank_failure import JobEnded, RankFailed, error_line, is_peer_symptom
from dtrain.slurm import queue


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


def launch_slurm(rank_fn, cfg, run_dir: Path) -> Any:
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
    watch = slurm_client_watch.start_client_watch(
        job.job_id, run_dir
    )  # cancels the job if this process is killed
    print(
        f"submitted Slurm job {job.job_id} ({cfg.world_size} tasks); logs in {run_dir / 'slurm'}",
        flush=True,
    )
    try:
        _wait_slurm(job, cfg, run_dir)
    except JobEnded:  # cancelled from outside: nothing left to cancel
        raise
    except (
        BaseException
    ):  # Interrupted, a hung rank, a job that can never start: it must not run on
        job.cancel(check=False)
        print(f"cancelled Slurm job {job.job_id}", flush=True)
        raise
    finally:
        slurm_client_watch.client_done(watch)
    results, failures = [], []
    for i in range(cfg.world_size):  # every task's outcome: the first to fail is not always task 0
        try:
            results.append(job.task(i).result())
        except (FailedJobError, UncompletedJobError) as e:
            failures.append((is_peer_symptom(str(e)), "Traceback" not in str(e), i, str(e)))
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
        error=f"task {first}: {error_line(first_text)}",
    ) from None


# what a task's outcome says when the job ran out of time for good: submitit's handler after the
# last allowed requeue (or with requeue off), or Slurm's own kill at the limit
_TIMED_OUT = ("timed-out too many times", "state: TIMEOUT")


def _raise_if_cancelled(job_id: str, job_state: tuple[str, str] | None) -> None:
    by = queue.cancelled(job_id, job_state)
    if by is not None:
        how = f" (scancel {by})" if by else ""
        raise JobEnded(f"Slurm job {job_id} was cancelled{how}", reason="cancelled")


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
    raise JobEnded(
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
