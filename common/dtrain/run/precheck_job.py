"""The job this process may already be a rank of (RANK / WORLD_SIZE set by torchrun, srun, or left
over in the shell), checked against the command line before any rank starts (dtrain.run.precheck's
stage): a world_size= that disagrees is refused, and leftover variables are named in a note."""

from __future__ import annotations

import os
import sys

from dtrain.core.errors import UserError, clip
from dtrain.run.hydra_argv import literal_override


def check_job_size(argv: list[str], job) -> None:
    """Inside a job (RANK/WORLD_SIZE set: torchrun, srun, or left over in the shell) the job's
    size is the run's; an explicit world_size= that disagrees is refused instead of silently
    running another size."""
    asked = literal_override(argv, "world_size")
    if (
        job is None
        or asked is None
        or not asked.isdigit()
        or asked.lstrip("0") == str(job.world_size)
    ):  # not int(): a 100 kB number is refused
        return
    asked = clip(asked)
    raise UserError(
        f"world_size={asked} but this process is rank {job.rank} of a {job.world_size}-rank job "
        "(RANK and WORLD_SIZE are set: torchrun, srun, or left over in this shell): drop "
        f"world_size= to run as that rank, pass launcher=local to start {asked} ranks here, or "
        "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT"
    )


def note_job_environment(argv: list[str], job) -> None:
    """Say which way torchrun's variables were taken when they may be a leftover: no torchrun
    agent set them."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(n in os.environ for n in names) or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    if job is None:
        print(
            "note: launcher=local: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the "
            "environment are ignored; ranks are started here",
            file=sys.stderr,
            flush=True,
        )
    elif "SLURM_STEP_ID" not in os.environ:
        print(
            f"note: RANK={job.rank} WORLD_SIZE={job.world_size} are set without torchrun: running "
            "as that rank (it waits up to dist_timeout_s for its peers); pass launcher=local to "
            "start ranks here instead",
            file=sys.stderr,
            flush=True,
        )
