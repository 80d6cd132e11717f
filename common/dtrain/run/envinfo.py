"""What ran where: the facts that go into env.json, so every number can be traced to a machine."""

from __future__ import annotations

import os
import platform
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path


def gpu_facts() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 2),
                "capability": f"{p.major}.{p.minor}",
                "sm_count": p.multi_processor_count,
            }
        )
    return out


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The host CPU's model name (Linux's /proc/cpuinfo, else ``platform.processor()``): eager
    PyTorch's issue time per op is the host's, so a launch-bound step is traced to its CPU too."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:  # no /proc (macOS, some containers): the platform's name below
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return platform.processor() or None


def nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    except Exception:  # NCCL absent from this build
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)


def slurm_facts() -> dict:
    """Inside a Slurm job: the id sacct and submitit use (`<array>_<task>` in an array), the node
    list and the folder of the job's logs, for `dtrain runs`."""
    e = os.environ
    if "SLURM_JOB_ID" not in e:
        return {}
    array = "SLURM_ARRAY_JOB_ID" in e and "SLURM_ARRAY_TASK_ID" in e
    job = f"{e['SLURM_ARRAY_JOB_ID']}_{e['SLURM_ARRAY_TASK_ID']}" if array else e["SLURM_JOB_ID"]
    logs = e.get("SUBMITIT_FOLDER")
    if logs:
        logs = str(
            Path(logs).absolute()
        )  # submitit's placeholders: %j job, %A array job, %a array task
        logs = (
            logs.replace("%j", job)
            .replace("%A", e.get("SLURM_ARRAY_JOB_ID", job))
            .replace("%a", e.get("SLURM_ARRAY_TASK_ID", ""))
        )
    return {
        "slurm_job": job,
        "slurm_nodelist": e.get("SLURM_JOB_NODELIST"),
        "slurm_logs": logs,
        "slurm_restart_count": int(e.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def collect(
    *,
    backend: str,
    world_size: int,
    device: str,
    launcher: str,
    hosts: list[str] | None = None,
    threads_per_rank: int | None = None,
) -> dict:
    import torch

    hosts = hosts or [socket.gethostname()]
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "hosts": sorted(set(hosts)),
        "rank_hosts": list(hosts),  # host of each rank, in rank order
        "num_nodes": len(set(hosts)),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "threads_per_rank": threads_per_rank,
        "gpus": gpu_facts(),
        "backend": backend,
        "device": device,
        "world_size": world_size,
        "launcher": launcher,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        **slurm_facts(),
        "topology": {
            "gpus_per_node": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "nodes": len(set(hosts)),
        },
    }
