"""Process-group set-up shared by every launch mode.

torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
are the single convention inside a rank: Slurm tasks and locally spawned ranks are translated
into them before `init_process_group`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: the launching process checks a command line
# (dtrain.run.app, dtrain.run.precheck) with this module before any rank starts, and a wrong
# override is one line in
# a fraction of a second instead of after torch's import.


def __getattr__(name: str):
    """The collective compatibility shims (one home): torch >= 2.13 renames the single-tensor
    collectives; older releases (>= 2.6) only have the *_tensor names."""
    import torch.distributed as dist

    if name == "all_gather_single":
        return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if name == "reduce_scatter_single":
        return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def export(self) -> None:
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def env_from_torchrun() -> DistEnv | None:
    """torchrun (or any launcher that exports its variables)."""
    e = os.environ
    if not all(k in e for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(e["WORLD_SIZE"])
    return DistEnv(
        int(e["RANK"]),
        world,
        int(e.get("LOCAL_RANK", 0)),
        int(e.get("LOCAL_WORLD_SIZE", world)),
        e["MASTER_ADDR"],
        int(e["MASTER_PORT"]),
    )


def env_from_slurm() -> DistEnv | None:
    """A task of a multi-task srun step (submitit jobs run their tasks this way)."""
    e = os.environ
    if "SLURM_STEP_ID" not in e or int(e.get("SLURM_NTASKS", "1")) < 2:
        return None
    from submitit.helpers import TorchDistributedEnvironment

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # plain `srun python -m ...` too
    t = TorchDistributedEnvironment()
    return DistEnv(
        t.rank, t.world_size, t.local_rank, t.local_world_size, t.master_addr, t.master_port
    )


def detect_job(launcher: str | None = None) -> DistEnv | None:
    """The rank this process already is, when started by torchrun or as a Slurm task. With
    launcher=local never one: local ranks are spawned here, whatever the environment holds."""
    if launcher == "local":
        return None
    return env_from_torchrun() or env_from_slurm()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_count() -> int:
    """GPUs this process can use (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_type(requested: str) -> str:
    """`device=` resolved for this host: auto means cuda when any GPU is visible, else cpu. Every
    rank of a node takes the same answer, so no job mixes cuda+NCCL ranks with cpu+gloo ones."""
    one_of("device", requested, DEVICES)
    if requested == "auto":
        return "cuda" if cuda_count() else "cpu"
    if requested == "cuda" and not cuda_count():
        raise UserError("device=cuda but this host sees no CUDA GPU: use device=cpu or device=auto")
    return requested


def pick_device(requested: str, local_rank: int) -> torch.device:
    """This rank's device: cuda:<local_rank> (one GPU per rank) or cpu."""
    import torch

    if device_type(requested) == "cpu":
        return torch.device("cpu")
    gpus = cuda_count()
    if local_rank >= gpus:
        raise UserError(
            f"local rank {local_rank} has no GPU of its own (this node has {gpus}; one rank per "
            f"GPU): start at most {gpus} ranks per node, or pass device=cpu"
        )
    return torch.device("cuda", local_rank)


def pick_backend(requested: str, device: torch.device) -> str:
    """NCCL when the rank has a GPU, gloo otherwise; an explicit choice must be possible."""
    import torch.distributed as dist

    one_of("backend", requested, BACKENDS)
    if requested == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise UserError(
            "backend=nccl needs a CUDA GPU on every rank and an NCCL build of torch: "
            "use backend=gloo (or auto)"
        )
    if requested == "auto":
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    return requested


def init(env: DistEnv, backend: str, device: torch.device, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    env.export()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def set_cpu_threads(threads_per_rank: int | None, local_world_size: int) -> int:
    """Split the host's cores between its ranks, so ranks do not fight over them."""
    import torch

    n = threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(n)
    return n


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_flat(
    tensors: list[torch.Tensor], group=None, collective=None, divisor: int = 1
) -> None:
    """Sum `tensors` in place over `group` with one collective on one flat bucket (as DDP does),
    then divide by `divisor` (gloo has no average). `collective(flat, group)` replaces
    torch.distributed.all_reduce (the TP layers pass their counted, profiled one)."""
    import torch
    import torch.distributed as dist

    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    (collective or (lambda t, g: dist.all_reduce(t, group=g)))(flat, group)
    if divisor != 1:
        flat /= divisor
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
