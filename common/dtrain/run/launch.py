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

What runs on every rank: dtrain.run.rank; local ranks: dtrain.run.local_launch; Slurm:
dtrain.run.slurm_launch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run.local_launch import launch_local
from dtrain.run.rank import RankContext, run_rank
from dtrain.run.slurm_launch import launch_slurm

LAUNCHERS = ("auto", "local", "slurm")


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
        return launch_local(rank_fn, cfg, run_dir, device), run_dir
    return launch_slurm(rank_fn, cfg, run_dir), run_dir
