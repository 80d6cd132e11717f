"""What `dtrain runs` knows about Slurm: job states from sacct, and sweep points that left no run.

A run launched on Slurm has `slurm_job`, `slurm_nodelist` and `slurm_logs` in its env.json
(envinfo.slurm_facts). A sweep point that failed before its run directory was complete (bad
input removes it, a crash leaves it without a summary) is found through submitit's log folders:
`<sweep>/.submitit/<job>/` (hydra-submitit-launcher) or `<run>/slurm/` (launcher=slurm), each
holding `<job>_<task>_log.err`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dtrain.core.files import files_named

_LOG = re.compile(r"^(?P<job>\d+(?:_\d+)?)_(?P<task>\d+)_log\.err$")


@dataclass
class SlurmJob:
    job: str  # as sacct and submitit name it: 123, or 120_3 for an array task
    logs: Path  # the folder with its submitit logs
    state: str = "?"  # sacct State (COMPLETED, FAILED, CANCELLED, PENDING, ...), "?" without sacct
    nodes: str = ""
    error_tail: str = ""  # last lines of task 0's stderr (the first task whose log says error)

    @property
    def sweep_point(self) -> str | None:
        """The sweep subfolder of an array task (hydra.sweep.subdir = job num = array task id)."""
        if "_" in self.job and self.logs.parent.name == ".submitit":
            return str(self.logs.parent.parent / self.job.split("_", 1)[1])
        return None


def job_of(env: dict) -> str:
    """The Slurm job id a run's env.json names ("" for a run that did not run on Slurm)."""
    return str(env.get("slurm_job") or env.get("slurm_job_id") or "")


def sacct_problem() -> str | None:
    """Why job states are unknown (sacct absent, or no cluster to ask), or None when sacct
    answers."""
    from dtrain.slurm.queue import CLUSTER_HINT, no_cluster

    if shutil.which("sacct") is None:
        return "sacct is not on PATH: " + CLUSTER_HINT
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-j", "1", "-o", "JobID"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sacct did not answer ({e})"
    if out.returncode:
        return no_cluster(out.stderr) or f"sacct failed ({out.stderr.strip().splitlines()[-1:]})"
    return None


def sacct(jobs: Iterable[str]) -> dict[str, tuple[str, str]]:
    """{job: (state, node list)} for the given ids; empty when sacct is absent or fails."""
    jobs = sorted(set(j for j in jobs if j))
    if not jobs or shutil.which("sacct") is None:
        return {}
    try:
        out = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-j", ",".join(jobs), "-o", "JobID,State,NodeList"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 3:
            found[parts[0]] = (
                parts[1].split()[0] if parts[1] else "?",
                parts[2],
            )  # "CANCELLED by 0" -> CANCELLED
    return found


def error_tail(log: Path, n: int = 3) -> str:
    """The last meaningful lines of a task's stderr (submitit's own INFO lines left out)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [
        ln for ln in lines if ln.strip() and "submitit INFO" not in ln and not ln.startswith("[W")
    ]
    return "\n".join(keep[-n:])


def _rank(tail: str) -> int:
    """Which task's error to show: a real one before a peer's "connection closed", before noise."""
    from dtrain.run.rank_failure import is_peer_symptom

    if "error" not in tail.lower():
        return 2
    return 1 if is_peer_symptom(tail) else 0


def jobs_in(paths: Iterable[str | Path]) -> list[SlurmJob]:
    """Every submitit job whose log folder lies under `paths`, with its state and error tail."""
    found: dict[str, SlurmJob] = {}
    for root in map(Path, paths):
        for err in files_named(root, "*_log.err"):  # jobs may be writing: folders come and go
            m = _LOG.match(err.name)
            if not m or not (err.parent.parent.name == ".submitit" or err.parent.name == "slurm"):
                continue
            job = found.setdefault(m["job"], SlurmJob(m["job"], err.parent))
            tail = error_tail(err)
            if tail and (not job.error_tail or _rank(tail) < _rank(job.error_tail)):
                job.error_tail = tail
    states = sacct(found)
    for job in found.values():
        job.state, job.nodes = states.get(job.job, ("?", ""))
    return sorted(found.values(), key=lambda j: j.job)


def unfinished(jobs: list[SlurmJob], complete_jobs: set[str]) -> list[SlurmJob]:
    """Jobs that produced no complete run: failed sweep points, crashed or cancelled runs."""
    return [
        j
        for j in jobs
        if j.job not in complete_jobs and j.state not in ("PENDING", "RUNNING", "REQUEUED")
    ]
