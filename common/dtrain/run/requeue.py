"""Preemption and time limits on Slurm: the job-side half (the trainer's half is
train/preemption.py).

A Slurm job is stopped early in two ways, and both end in a requeue of the *same* job (same id,
same run directory, `SLURM_RESTART_COUNT` + 1):

    USR2  sent `slurm.signal_delay_s` before the time limit (sbatch --signal, set by submitit), or
          by a site's preemption; submitit's handler then asks the callable for `checkpoint()`
          (launch.SlurmTask), counts time-outs against `slurm.max_requeues` and runs
          `scontrol requeue`
    TERM  `scontrol requeue`, preemption with PreemptMode=REQUEUE, scancel: Slurm itself requeues
          (or ends) the job and sends SIGKILL KillWait/GraceTime seconds later

While a trainer runs, both signals only set a flag; at the next step boundary every rank agrees,
saves a DCP checkpoint and exits (the trainer's half). A requeued attempt resumes from the latest
complete checkpoint, and each rank's records file is cut back to its length when that checkpoint
was saved, so no record is duplicated or lost. Events: `preempted` (the checkpoint was saved),
`requeued` (written by the next attempt), `resumed` (after loading).

Runs without a trainer (benchmarks) simply start again: their records are cleared when a
requeued attempt starts. A requeue of a job that already finished (`scontrol requeue` of a completed
job) finds `summary.json`: the attempt says so in the job's log and exits 0 before writing anything
(`exit_if_complete`), so a complete run is never trained again under its own summary.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from dtrain.results.metrics import RECORDS, SUMMARY, write_json_atomic
from dtrain.run import rundir

OFFSETS = (
    ".records-offsets.rank{rank}.json"  # {step: bytes of this rank's records file at that step}
)


def restart_count() -> int:
    """How many times Slurm requeued this job (0 outside Slurm or on the first attempt)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def exit_if_complete(run_dir: Path, check_owner: bool = True) -> None:
    """A requeued attempt of a run that already completed: one line in the job's log, exit 0, before
    any file is written. ``check_owner``: only when this job owns the run dir (a task started by
    `launcher=slurm` was handed its run dir by the client, which owns it)."""
    run_dir = Path(run_dir)
    if restart_count() == 0 or not (run_dir / SUMMARY).is_file():
        return
    if check_owner and not rundir.same_job_restarted(run_dir / rundir.OWNER):
        return  # another job's run: the claim refuses it
    print(f"requeue: run {run_dir} is already complete ({SUMMARY}); nothing to do", flush=True)
    sys.exit(0)  # not a return: submitit and Hydra would write this attempt's result in the run


def enabled(cfg) -> bool:
    """Stop-and-requeue handling applies: in a task of a Slurm job step (srun; not a shell inside
    salloc spawning local ranks), with slurm.requeue on."""
    slurm = cfg.get("slurm") if hasattr(cfg, "get") else None
    in_step = "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" in os.environ
    return in_step and bool(slurm is None or slurm.get("requeue", True))


def preempt_signal() -> signal.Signals:
    """The signal submitit treats as 'checkpoint and requeue' (USR2 unless
    SUBMITIT_PREEMPT_SIGNAL says otherwise)."""
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))


def records_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / (
        RECORDS if rank == 0 else RECORDS.replace(".jsonl", f".rank{rank}.jsonl")
    )


def _offsets_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / OFFSETS.format(rank=rank)


def read_offsets(run_dir: Path, rank: int) -> dict[int, int]:
    path = _offsets_path(run_dir, rank)
    if not path.exists():
        return {}
    try:
        return {int(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (ValueError, AttributeError):
        return {}


def note_offset(run_dir: Path, rank: int, step: int) -> None:
    """Remember how long this rank's records file is at `step` (training start and each
    checkpoint)."""
    f = records_file(run_dir, rank)
    offsets = read_offsets(run_dir, rank)
    offsets[step] = f.stat().st_size if f.exists() else 0
    write_json_atomic(_offsets_path(run_dir, rank), {str(k): v for k, v in sorted(offsets.items())})


def rewind_records(run_dir: Path, rank: int, step: int) -> int | None:
    """Cut this rank's records back to their length at `step`: what an interrupted attempt wrote
    after its checkpoint, and what this attempt wrote again before resuming, goes. Returns the
    bytes dropped, or None when no length was noted for that step."""
    offset = read_offsets(run_dir, rank).get(step)
    f = records_file(run_dir, rank)
    if offset is None or not f.exists():
        return None
    size = f.stat().st_size
    if size > offset:
        os.truncate(f, offset)
    return max(0, size - offset)


def start_attempt(run_dir: Path, rank: int, writer) -> None:
    """At the start of every rank's run: on a requeued attempt, say so; a run that never reached
    its trainer (no offsets noted) starts its records again from nothing."""
    n = restart_count()
    if n == 0:
        return
    writer.event("requeued", restart_count=n, slurm_job_id=os.environ.get("SLURM_JOB_ID"))
    if not read_offsets(run_dir, rank):
        f = records_file(run_dir, rank)
        if f.exists():
            os.truncate(f, 0)
