"""A Hydra sweep on Slurm (`-m ... hydra/launcher=submitit_slurm`) as the other launch paths behave.

hydra-submitit-launcher submits the sweep as one job array from this process and waits for it.
Two things it does not do our way, which `install` adds around its `launch`:

* sbatch refuses the array (an unknown gres, partition or account; no Slurm configuration): submitit
  prints sbatch's stderr, raises, and Hydra prints a 39-line traceback, exit 1. Here it is one
  `error:` line, exit 2 (`queue.refused`), and the sweep folder, which holds no run, keeps a
  `SUBMISSION_FAILED` note naming the error so `dtrain runs` lists the sweep.
* a request no node of the partition can hold (a partition that does not exist, more CPUs or GPUs
  per node than a node has): sbatch answers with a raw gres or partition error, or Slurm queues the
  array forever. Before submitting, the `launcher=slurm` check (`queue.check_fits`) runs on
  the launcher's keys and names the cause with their names (`hydra.launcher.partition`).
* the job id is printed as soon as sbatch returns (the launcher itself says nothing until every
  point has finished), as `launcher=slurm` prints its own.
* the sweep succeeds: each point's run directory is printed, as a local run prints its own.
"""

from __future__ import annotations

import contextlib
import io
import json
from datetime import datetime, timezone
from pathlib import Path

SUBMISSION_FAILED = "submission-failed.json"  # in the sweep folder: {"error", "time", "argv"}


class SubmissionRefused(Exception):
    """sbatch said no; carries its stderr."""


def wanted(argv: list[str]) -> bool:
    return any(a.startswith("hydra/launcher=submitit") for a in argv)


# keys of cfg.slurm in check_fits' messages -> the launcher's keys a sweep sets instead
_LAUNCHER_KEYS = {
    f"slurm.{k}": f"hydra.launcher.{k}"
    for k in ("partition", "nodes", "cpus_per_task", "mem_gb", "gpus_per_node", "tasks_per_node")
}
_LAUNCHER_KEYS["world_size"] = "hydra.launcher.tasks_per_node"


def check_fits(launcher) -> None:
    """UserError, with the launcher's key names, when no node of the partition can hold one point's
    request (the check `launcher=slurm` runs before sbatch). `launcher` = cfg.hydra.launcher."""
    import re

    from omegaconf import OmegaConf

    from dtrain.core.errors import UserError
    from dtrain.slurm import queue

    gpus = launcher.get("gpus_per_node") or queue._gpus(str(launcher.get("gres") or ""))
    request = OmegaConf.create(
        {
            "partition": launcher.get("partition"),
            "nodes": launcher.get("nodes") or 1,
            "cpus_per_task": launcher.get("cpus_per_task") or 1,
            "mem_gb": launcher.get("mem_gb"),
            "gpus_per_node": gpus,
        }
    )
    try:
        queue.check_fits(request, launcher.get("tasks_per_node") or 1)
    except UserError as e:
        pattern = "|".join(re.escape(k) for k in sorted(_LAUNCHER_KEYS, key=len, reverse=True))
        named = re.sub(rf"\b({pattern})\b", lambda m: _LAUNCHER_KEYS[m.group(1)], str(e))
        raise UserError(named) from None


def submitted_line(job_id: str, points: int, folder: str) -> str:
    """What `launcher=slurm` prints after sbatch; each point's logs are in `<id>_<point>` (%j)."""
    return (
        f"submitted Slurm job array {job_id} ({points} point(s)); logs in "
        f"{folder.replace('%j', f'{job_id}_*')}"
    )


@contextlib.contextmanager
def _refusals(on_submit=None):
    """While the sweep submits: sbatch's refusal raises SubmissionRefused instead of being printed;
    `on_submit(job)` as soon as sbatch has answered."""
    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmExecutor

    submit = SlurmExecutor._submit_command

    def quiet_submit(self, command):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                job = submit(self, command)
        except FailedJobError as e:
            raise SubmissionRefused(str(e)) from None
        if on_submit is not None:
            on_submit(job)
        return job

    SlurmExecutor._submit_command = quiet_submit
    try:
        yield
    finally:
        SlurmExecutor._submit_command = submit


def record_refusal(sweep_dir: Path, error: str, argv: list[str]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SUBMISSION_FAILED).write_text(
        json.dumps(
            {
                "error": error,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "argv": argv,
            },
            indent=1,
        )
    )


def run_dir_of(r) -> str | None:
    """A point's run directory: Hydra's output dir for the job (dtrain.run.app.run_dir_for), not
    its working dir, which is the submitting directory (hydra.job.chdir is false)."""
    try:
        return str(r.hydra_cfg.hydra.runtime.output_dir)
    except AttributeError:
        return None


def report(returns) -> None:
    """One line per point, as a local run prints (`run complete: <dir>  (summary.json written)`)."""
    for r in returns:
        where = run_dir_of(r)
        done = where and (Path(where) / "summary.json").exists()
        print(
            f"run complete: {where}  (summary.json written)"
            if done
            else f"run without summary.json: {where or '?'} (see dtrain runs --all)",
            flush=True,
        )


def install(argv: list[str]) -> None:
    """Wrap hydra-submitit-launcher's `launch` (no-op for other launchers, or when it is absent)."""
    if not wanted(argv):
        return
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
    except ImportError:
        return
    original = BaseSubmititLauncher.launch
    if getattr(original, "dtrain_wrapped", False):
        return

    def launch(self, job_overrides, initial_job_idx):
        from dtrain.core.errors import UserError, fail
        from dtrain.slurm.queue import refused

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        launcher = self.config.hydra.launcher
        try:
            check_fits(launcher)
        except UserError as e:  # nothing submitted: the sweep folder Hydra made for it goes too
            from dtrain.run import rundir

            rundir.discard(sweep_dir, claimed=False)
            fail(str(e), 2)
        folder = str(launcher.get("submitit_folder") or sweep_dir)

        def announce(job) -> None:
            print(submitted_line(job.job_id, len(job_overrides), folder), flush=True)

        try:
            with _refusals(announce):
                returns = original(self, job_overrides, initial_job_idx)
        except SubmissionRefused as e:
            message = str(
                refused(
                    str(e),
                    "sweep",
                    "check the hydra.launcher.* keys (gres, partition, account, "
                    "constraint, qos, gpus_per_node)",
                )
            )
            record_refusal(sweep_dir, message, list(argv))
            fail(f"{message}; nothing ran (noted in {sweep_dir / SUBMISSION_FAILED})", 2)
        print(f"sweep complete: {len(returns)} point(s) in {sweep_dir}", flush=True)
        report(returns)
        return returns

    launch.dtrain_wrapped = True
    BaseSubmititLauncher.launch = launch
