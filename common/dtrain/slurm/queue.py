"""Will Slurm ever run this job? Asked before submitting (sinfo) and while it waits (squeue).

Slurm queues a job that no node of its partition can hold (more CPUs, GPUs or memory per node
than any node has, more nodes than the partition has) with a reason such as `PartitionConfig`
and waits forever. We refuse such a request up front, and cancel a pending job whose reason
says it can never start.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess

from dtrain.core.errors import UserError

# what Slurm's client tools say when they have no configuration or no controller to talk to
NO_CLUSTER = (
    "configuration source",
    "configuration file",
    "slurm.conf",
    "Unable to contact slurm controller",
    "Unable to establish controller machine",
)
CLUSTER_HINT = (
    'for the local cluster run eval "$(scripts/slurm-cluster env)" (start it first: make '
    "slurm-up); "
    "on a real cluster set SLURM_CONF to its slurm.conf or log in to a node that has one"
)


def no_cluster(text: str) -> str | None:
    """One line saying why Slurm cannot be asked at all (no configuration, no controller), or
    None."""
    if not any(s in text for s in NO_CLUSTER):
        return None
    from dtrain.run.rank_failure import error_line

    conf = os.environ.get("SLURM_CONF")
    return (
        f"Slurm cannot be reached ({error_line(text)}; "
        f"{f'SLURM_CONF={conf}' if conf else 'SLURM_CONF is not set'}): {CLUSTER_HINT}"
    )


def refused(text: str, what: str, fix: str) -> UserError:
    """sbatch's refusal (its stderr in `text`) as one line: the missing cluster when that is the
    cause."""
    from dtrain.run.rank_failure import error_line

    return UserError(no_cluster(text) or f"Slurm refused the {what} ({error_line(text)}): {fix}")


# squeue reasons that do not go away by waiting (other jobs finishing); see `man squeue`, JOB REASON
# CODES.
NEVER_REASONS = {
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSNotAllowed",
    "DependencyNeverSatisfied",
}
_PER_JOB_LIMIT = re.compile(r"^(Assoc|QOS)\w*PerJob\w*Limit$")


def _run(args: list[str], need_cluster: bool = False) -> str | None:
    """stdout, or None when the tool failed (`need_cluster`: UserError when for want of a
    cluster)."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode and need_cluster and no_cluster(out.stderr):
        raise UserError(no_cluster(out.stderr))
    return out.stdout if out.returncode == 0 else None


def _gpus(gres: str) -> int:
    """'gpu:8', 'gpu:a100:4(S:0-1)', 'gpu:2,shard:4' -> GPUs per node."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def check_fits(s, tasks_per_node: int) -> None:
    """UserError when no `s.nodes` nodes of the partition can each hold the request, or when
    sinfo finds no cluster to ask (no SLURM_CONF, no controller). `s` = cfg.slurm. Silent when
    sinfo cannot answer otherwise: the pending-reason watch is the backstop."""
    part = s.get("partition")
    out = _run(
        ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"] + (["-p", part] if part else []),
        need_cluster=True,
    )
    if out is None:
        return
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 4]
    if not part:  # the default partition is the one sinfo marks with '*'
        defaults = {r[1] for r in rows if r[1].endswith("*")}
        rows = [r for r in rows if r[1] in defaults]
        part = next(iter(defaults), "?").rstrip("*")
    nodes = {}
    for name, _, cpus, mem_mb, gres in rows:
        with_digits = re.sub(r"\D", "", cpus), re.sub(r"\D", "", mem_mb)
        nodes[name] = (int(with_digits[0] or 0), int(with_digits[1] or 0), _gpus(gres))
    if not nodes:
        raise UserError(
            f"Slurm partition {part!r} has no nodes (sinfo): set slurm.partition to one that "
            "`sinfo` lists"
        )
    need_cpus = tasks_per_node * (s.cpus_per_task or 1)
    need_mem = (s.mem_gb or 0) * 1024
    need_gpus = s.gpus_per_node or 0
    fit = [
        n for n, (c, m, g) in nodes.items() if c >= need_cpus and m >= need_mem and g >= need_gpus
    ]
    if len(fit) >= s.nodes:
        return
    big = max(nodes.values())
    asked = (
        f"{s.nodes} node(s) with {need_cpus} CPUs"
        + (f", {s.mem_gb} GB" if need_mem else "")
        + (f", {need_gpus} GPUs" if need_gpus else "")
        + " each"
    )
    raise UserError(
        f"Slurm can never run this job: it asks for {asked} ({tasks_per_node} tasks x "
        f"{s.cpus_per_task or 1} CPUs), and partition {part!r} has {len(fit)} such node(s) of "
        f"{len(nodes)} (largest: {big[0]} CPUs, {big[1] // 1024} GB, {big[2]} GPUs): lower "
        "world_size or slurm.cpus_per_task, add slurm.nodes, or pick another slurm.partition"
    )


def state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) from squeue, e.g. ("PENDING", "Resources"); None once the job left the
    queue."""
    out = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"])
    if not out or "|" not in out:
        return None
    job_state, reason = out.splitlines()[0].strip().split("|", 1)
    return job_state, reason


def never_starts(job_state: tuple[str, str] | None) -> str | None:
    """The reason, when a job's squeue (state, reason) says it waits for something waiting does
    not cure."""
    if not job_state or job_state[0] != "PENDING":
        return None
    reason = job_state[1]
    return reason if reason in NEVER_REASONS or _PER_JOB_LIMIT.match(reason) else None


# squeue states of a job that still runs or will run again
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "STOPPED",
}


def cancelled(job_id: str, job_state: tuple[str, str] | None) -> str | None:
    """ "by <user> at <time>" (what sacct knows) when the job was cancelled, else None. Asked only
    when squeue no longer shows it active: a cancelled job is COMPLETING for a while, then gone."""
    if job_state and job_state[0] in ACTIVE:
        return None
    out = _run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,End"])
    row = out.splitlines()[0].split("|") if out and "|" in out else None
    if row is None:  # no accounting: squeue's own word, while it still lists the job
        return "" if job_state and job_state[0] == "CANCELLED" else None
    words = row[0].split()
    if not words or words[0] != "CANCELLED":
        return None
    who = words[2] if len(words) == 3 and words[1] == "by" else ""
    if who.isdigit():
        try:
            who = pwd.getpwuid(int(who)).pw_name
        except KeyError:
            who = f"uid {who}"
    end = row[1] if row[1] not in ("", "Unknown", "None") else ""
    return " ".join(p for p in (f"by {who}" if who else "", f"at {end}" if end else "") if p)


def _points_to_nodes(reason: str) -> bool:
    """Whether a pending reason may come from nodes that are drained or down."""
    return (
        reason == "Resources"
        or reason.startswith("ReqNodeNotAvail")
        or "DOWN" in reason
        or "DRAIN" in reason
    )


def pending_reason(reason: str, partition: str | None = None) -> str:
    """squeue's pending reason, with the drained or down nodes (and why, from `sinfo -R`) when the
    reason may come from them: 'Resources: node1 drained "maintenance"'."""
    if not _points_to_nodes(reason):
        return reason
    out = _run(["sinfo", "-R", "-h", "-o", "%n|%T|%E"] + (["-p", partition] if partition else []))
    nodes = [row.split("|", 2) for row in (out or "").splitlines() if row.count("|") >= 2]
    if not nodes:
        return reason
    said = [f'{name} {state.lower().rstrip("*~#!%$@^-")} "{why}"' for name, state, why in nodes[:3]]
    more = f" and {len(nodes) - 3} more" if len(nodes) > 3 else ""
    return f"{reason}{'; ' if ':' in reason else ': '}{', '.join(said)}{more}"
