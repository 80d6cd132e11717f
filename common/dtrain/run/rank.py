"""What every rank runs around `rank_fn(ctx)`, whichever launcher started it: the process group,
the run dir the ranks agree on, config.yaml and env.json (rank 0), the heartbeat of a job whose
launcher is not ours, and the teardown; `RankContext` is what `rank_fn` gets."""

from __future__ import annotations

import dataclasses
import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, open_dict

from dtrain.core.errors import UserError
from dtrain.results.metrics import ENV, RunWriter, write_config, write_json_atomic
from dtrain.run import dist as ddist
from dtrain.run import envinfo, job_watch, requeue, rundir

if TYPE_CHECKING:
    import torch


# torch.distributed is imported where a rank uses it: the launching process checks its command line
# with this module (dtrain.run.app) before torch is needed, so a wrong override fails in a fraction
# of a
# second.
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
        job_watch.watch_job(env.rank, env.world_size, run_dir, cfg.get("heartbeat_timeout_s"))
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
                else job_watch.job_root_cause(run_dir, env.rank, traceback.format_exc())
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
