"""A Hydra sweep on Slurm (`-m ... hydra/launcher=submitit_slurm`) as the other launch paths behave.

hydra-submitit-launcher submits the sweep as one job array from this process and waits for it.
Two things it does not do our way, which `install` adds around its `launch`:

* sbatch refuses the array (an unknown gres, partition or account; no Slurm configuration): submitit
  prints sbatch's stderr, raises, and Hydra prints a 39-line traceback, exit 1. Here it is one
  `error:` line, exit 2 (`slurm_queue.refused`), and the sweep folder, which holds no run, keeps a
  `SUBMISSION_FAILED` note naming the error so `dtrain runs` lists the sweep.
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


@contextlib.contextmanager
def _refusals():
    """While the sweep submits: sbatch's refusal raises SubmissionRefused instead of being printed."""
    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmExecutor

    submit = SlurmExecutor._submit_command

    def quiet_submit(self, command):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                return submit(self, command)
        except FailedJobError as e:
            raise SubmissionRefused(str(e)) from None

    SlurmExecutor._submit_command = quiet_submit
    try:
        yield
    finally:
        SlurmExecutor._submit_command = submit


def record_refusal(sweep_dir: Path, error: str, argv: list[str]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SUBMISSION_FAILED).write_text(json.dumps(
        {"error": error, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "argv": argv}, indent=1))


def run_dir_of(r) -> str | None:
    """A point's run directory: Hydra's output dir for the job (dtrain.app.run_dir_for), not its working dir,
    which is the submitting directory (hydra.job.chdir is false)."""
    try:
        return str(r.hydra_cfg.hydra.runtime.output_dir)
    except AttributeError:
        return None


def report(returns) -> None:
    """One line per point, as a local run prints (`run complete: <dir>  (summary.json written)`)."""
    for r in returns:
        where = run_dir_of(r)
        done = where and (Path(where) / "summary.json").exists()
        print(f"run complete: {where}  (summary.json written)" if done else
              f"run without summary.json: {where or '?'} (see dtrain runs --all)", flush=True)


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
        from dtrain.app import fail
        from dtrain.slurm_queue import refused

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        try:
            with _refusals():
                returns = original(self, job_overrides, initial_job_idx)
        except SubmissionRefused as e:
            message = str(refused(str(e), "sweep", "check the hydra.launcher.* keys (gres, partition, account, "
                                                   "constraint, qos, gpus_per_node)"))
            record_refusal(sweep_dir, message, list(argv))
            fail(f"{message}; nothing ran (noted in {sweep_dir / SUBMISSION_FAILED})", 2)
        print(f"sweep complete: {len(returns)} point(s) in {sweep_dir}", flush=True)
        report(returns)
        return returns

    launch.dtrain_wrapped = True
    BaseSubmititLauncher.launch = launch
