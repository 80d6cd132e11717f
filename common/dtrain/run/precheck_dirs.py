"""The folders a command line names, checked before Hydra creates any of them
(dtrain.run.precheck's stage): results_dir / hydra.*.dir values that cannot hold a run
(dtrain.core.checks), and an explicit hydra.run.dir / hydra.sweep.dir already used by a run or
holding anything but Hydra's bookkeeping (a folder of the user's, `.`), refused before Hydra writes
into it (rundir.claim is the atomic guarantee; this keeps the old run's .hydra/ and the user's
files intact)."""

from __future__ import annotations

from pathlib import Path

from dtrain.core.errors import UserError, clip
from dtrain.core.files import made_path
from dtrain.run import requeue, rundir
from dtrain.run.hydra_argv import NO_RUN, literal_override, split_argv
from dtrain.run.rundir import OWNER, foreign_entries, owner_text


def check_run_dirs(argv: list[str]) -> None:
    """An explicit hydra.run.dir (or a sweep dir holding runs) that a run already owns is
    refused."""
    if any(arg.split("=", 1)[0] in NO_RUN for arg in argv):
        return  # Hydra prints help or config and runs nothing
    for arg in split_argv(argv)[0]:
        key, _, value = arg.lstrip("+").partition("=")
        if (
            key not in ("hydra.run.dir", "hydra.sweep.dir")
            or not value
            or "$" in value
            or "," in value
        ):
            continue
        path = made_path(value)  # what Hydra will write into: `new/..` is the folder above
        if key == "hydra.run.dir" and rundir.same_job_restarted(path / OWNER):
            continue  # the same Slurm job requeued: its own run (rundir.claim lets it in)
        owned = [path / OWNER] if key == "hydra.run.dir" else sorted(path.glob(f"*/{OWNER}"))
        owned = [o for o in owned if o.exists()]
        if owned:
            raise UserError(
                f"{key}={clip(value)} already holds a run ({owner_text(owned[0])}): "
                "pass a new directory (or delete the old run); a run directory is never reused"
            )
        others = foreign_entries(path)
        if others:
            raise UserError(
                f"{key}={clip(value)} is not empty (it holds "
                f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): pass a new or "
                "empty directory; a run writes only into a folder it creates, never among files "
                "it did not make"
            )


def check_literal_paths(argv: list[str]) -> None:
    """results_dir / hydra.run.dir / hydra.sweep.dir given as a plain value: Hydra creates a
    folder from them before any of our code runs, so an empty, too long, looping or unwritable
    path is refused here."""
    from dtrain.core.checks import check_path

    if any(arg.split("=", 1)[0] in NO_RUN for arg in argv):
        return
    for key in ("results_dir", "hydra.run.dir", "hydra.sweep.dir"):
        value = literal_override(argv, key)
        if value is not None:
            check_path(key, value)
    run = literal_override(argv, "hydra.run.dir")
    if (
        run is not None
    ):  # a requeued job whose run is complete exits 0, before Hydra rewrites its .hydra/
        requeue.exit_if_complete(Path(run))
    rundir.check_command_line(lambda key: literal_override(argv, key))  # nesting, chdir, ...
