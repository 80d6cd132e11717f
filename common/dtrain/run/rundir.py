"""One run directory, one run: the launching process claims the directory atomically.

`claim(run_dir)` creates `.run-owner` with O_CREAT | O_EXCL (atomic on local filesystems and on
NFSv3+), so of two runs pointed at the same directory - one after the other or both at once - only
the first writes there; the other gets `RunDirTaken`, one `error:` line, and leaves the directory
alone. The file stays after the run: a finished (or failed) run's directory is never reused, except
by the same Slurm job requeued (same job id), which continues its own run.

A run owns only what it created. `remember(path)` notes, before anything is written, which of a path
and its parents exist and what an existing folder holds (Hydra's callback `RememberRunDirs` does it
before Hydra creates the run or sweep folder); on bad input `discard(run_dir)` removes only what was
not there before: a folder this process created (and its parents it created, when empty), or the
entries it added to a folder that existed. `claim_folder` makes another folder (a checkpoint
directory, a capstone's results) this run's own the way `claim` does for the run directory.

A run never writes into a folder that is, or is inside, another run's (`check_outside_runs`: every
folder above is looked at for a `.run-owner`), so `dtrain runs` never finds a run inside a run; a
sweep's folder has no owner (its points do), and a capstone's claimed folder holds its runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback

from dtrain.core.errors import UserError, clip
from dtrain.core.files import made_path

OWNER = ".run-owner"
HYDRA_BOOKKEEPING = (
    ".hydra",
    "multirun.yaml",
)  # what Hydra writes into a run / sweep folder (and <job>.log)


class RunDirTaken(UserError):
    """Another run owns the directory; unlike other bad input, the directory is not ours to
    remove."""


def owner_text(path: Path) -> str:
    try:
        o = json.loads(Path(path).read_text())
        return f"started {o['started']} by pid {o['pid']} on {o['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"owner file {path}"


def slurm_job() -> str | None:
    """This Slurm job (array task included); a requeued job keeps it."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{job}_{task}" if job and task else job


def same_job_restarted(path: Path) -> bool:
    """A requeued Slurm job runs its task again into the directory it owns: not a second run."""
    job = slurm_job()
    try:
        return job is not None and json.loads(path.read_text()).get("slurm_job") == job
    except (OSError, ValueError, AttributeError):
        return False


def _owner_record(**extra) -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "argv": sys.argv,
        "slurm_job": slurm_job(),
        "started": datetime.now().isoformat(timespec="seconds"),
        **extra,
    }


def claim(run_dir: Path) -> Path:
    """Make this process the directory's only run, or raise RunDirTaken."""
    path = Path(run_dir) / OWNER
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if same_job_restarted(path):
            return path
        raise RunDirTaken(
            f"run directory {run_dir} already holds a run ({owner_text(path)}): pass a new "
            "hydra.run.dir (or delete the old run); a run directory is never reused"
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(_owner_record(), f)
    return path


def _record(owner: Path) -> dict | None:
    try:
        rec = json.loads(owner.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _folders_above(path, include_self: bool) -> list[Path]:
    """`path`'s folders from the nearest up, as written and with symlinks resolved."""
    found: list[Path] = []
    for p in (_abs(path), Path(os.path.realpath(path))):
        for q in ((p,) if include_self else ()) + tuple(p.parents):
            if q not in found:
                found.append(q)
    return found


def _same(a, b) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def owning_run(path, include_self: bool = True, own: Path | None = None):
    """(the run, its owner file) when `path` is, or is inside, a folder another run owns: a run's
    directory or a folder claimed for one (a checkpoint dir: the run its owner file names); None
    otherwise. A folder claimed for a group of runs (a capstone's results: run_dir null) holds runs
    by design; `own` (this run's directory) and a requeued job's own folders are this run's."""
    for folder in _folders_above(path, include_self):
        owner = folder / OWNER
        if not owner.is_file():
            continue
        rec = _record(owner) or {}
        if "run_dir" in rec and rec["run_dir"] is None:
            continue
        run = Path(rec.get("run_dir") or folder)
        if (own is not None and _same(run, own)) or same_job_restarted(owner):
            continue
        return run, owner
    return None


def check_outside_runs(
    what: str, path, key: str, include_self: bool = True, own: Path | None = None
) -> None:
    """Refuse `path` (`what`: "key=value" as the user wrote it) when it is, or is inside, another
    run's folder: a run never writes there (`dtrain runs` would list a run inside a run)."""
    found = owning_run(path, include_self, own)
    if found is None:
        return
    run, owner = found
    folder = owner.parent
    if _same(folder, path):
        where = f"is the folder of run {run}" if _same(folder, run) else f"belongs to run {run}"
    elif _same(folder, run):
        where = f"is inside run {run}"
    else:
        where = f"is inside {folder}, which belongs to run {run}"
    raise UserError(
        f"{clip(what)} {where} ({owner_text(owner)}): pass a {key} outside any run's "
        "folder; a run never writes into another run's folder"
    )


def check_results_folder(cfg) -> None:
    """<results_dir>/<subproject>/, where Hydra makes the run folders: a folder, if it exists."""
    sub = Path(cfg.results_dir) / cfg.get("subproject", "")
    if os.path.lexists(sub) and not os.path.isdir(sub):
        what = (
            f"a dangling symlink (to {os.readlink(sub)})"
            if os.path.islink(sub)
            else "a file, not a folder"
        )
        raise UserError(
            f"results_dir={clip(cfg.results_dir)} cannot hold runs: {clip(sub)} is {what}: "
            "move it or pass another results_dir"
        )


def check_command_line(literal) -> None:
    """The paths of a command line, before Hydra creates a folder from them (`literal(key)`: the
    key's plain value, or None): no folder inside another run's, no checkpoint dir that is the run
    dir or a file, no resume from a live run, no hydra.job.chdir (a requeued job whose run is
    complete has exited 0 before: dtrain.run.precheck_dirs calls dtrain.run.requeue.exit_if_complete
    first). run_app checks the composed values again."""
    from dtrain.core.checks import check_path

    run, ckpt = literal("hydra.run.dir"), literal("train.checkpoint_dir")
    chdir = literal("hydra.job.chdir")
    if chdir is not None and chdir.lower() == "true":  # relative paths would name other folders
        raise UserError(
            "hydra.job.chdir=true is not supported: dtrain resolves results_dir and "
            "paths from the launch folder; drop it"
        )
    for key, itself in (("hydra.run.dir", False), ("hydra.sweep.dir", True), ("results_dir", True)):
        if (value := literal(key)) is not None:
            check_outside_runs(f"{key}={value}", value, key, itself)
    if ckpt:
        if run is not None and _same(run, ckpt):
            raise UserError(
                f"train.checkpoint_dir={clip(ckpt)} is the run directory itself: leave it "
                f"unset (checkpoints go to {clip(ckpt)}/checkpoints) or pass another folder"
            )
        # the folder itself: claim_folder says whose it is (train.resume_from may read it)
        check_outside_runs(f"train.checkpoint_dir={ckpt}", ckpt, "train.checkpoint_dir", False)
        check_path("train.checkpoint_dir", ckpt)
    if resume := literal("train.resume_from"):
        check_not_running("train.resume_from", resume)


def _pid_runs(rec: dict) -> bool:
    """The owner record's launching process is alive on this host (its command line matches: a pid
    can be reused)."""
    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    argv = [os.fsencode(a) for a in rec.get("argv") or []][1:]
    return cmdline[-1 - len(argv) : -1] == argv if argv else True


def check_not_running(key: str, path) -> None:
    """A folder read while its run still writes there (`train.resume_from` of a live run: it saves
    and prunes checkpoints) is refused, naming that run. Only the nearest owner decides."""
    for folder in _folders_above(path, include_self=True):
        owner = folder / OWNER
        if not owner.is_file():
            continue
        rec = _record(owner) or {}
        run = Path(rec.get("run_dir") or folder)
        if _pid_runs(rec) and not (run / "summary.json").exists():
            raise UserError(
                f"{key}={clip(path)}: checkpoint folder belongs to run {run}, which is "
                f"still running (pid {rec['pid']} on {rec['host']}): wait for it to "
                "finish or pass a finished checkpoint"
            )
        return


def foreign_entries(folder: Path) -> list[str]:
    """What a folder holds besides Hydra's bookkeeping: a run must not write among these."""
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    return [n for n in names if n not in HYDRA_BOOKKEEPING and not n.endswith(".log")]


def claim_folder(folder: Path, key: str, run_dir: Path | None, hint: str = "") -> bool:
    """Make `folder` (the value of `key`) this run's own: create it, or take a new or empty one, and
    write its `.run-owner` naming `run_dir` atomically. Another run's folder, or one holding
    anything else, is a UserError; one claimed for the same `run_dir` (a requeued run) is this
    run's again. Returns True when this call created the folder (see `release_folder`). The
    folder is the one `folder` names once made (``made_path``: `mine/new/..` is `mine`)."""
    folder = made_path(folder)
    owner = folder / OWNER
    created = not folder.exists()
    if os.path.lexists(folder) and not folder.is_dir():  # mkdir: "exists", not another run's
        raise UserError(
            f"{key}={clip(folder)} is a file, not a folder: pass a new or empty folder as {key}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            mine = run_dir is not None and json.loads(owner.read_text()).get("run_dir") == str(
                run_dir
            )
        except (OSError, ValueError, AttributeError):
            mine = False
        if mine:  # the same run again (a requeued job)
            return False
        raise UserError(
            f"{key}={folder} belongs to another run ({owner_text(owner)}): pass a new {key}{hint}; "
            "a run never writes into another run's folder"
        ) from None
    except OSError as e:
        raise UserError(
            f"{key}={folder} cannot be created ({e.strerror}): pass a writable {key}"
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(_owner_record(run_dir=str(run_dir) if run_dir else None), f)
    others = [n for n in foreign_entries(folder) if n != OWNER]
    if others:
        owner.unlink(missing_ok=True)
        raise UserError(
            f"{key}={folder} is not empty (it holds {', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}): pass a new or empty {key}{hint}; a run writes "
            "only into folders it creates"
        )
    return created


def release_folder(folder: Path, created: bool) -> None:
    """Undo `claim_folder` for a run that never started: its owner file, and the folder if it
    created it."""
    folder = made_path(folder)
    (folder / OWNER).unlink(missing_ok=True)
    if created:
        with contextlib.suppress(OSError):  # only when empty
            folder.rmdir()


# ---------------------------------------------------------------- what existed before this process

_MISSING: set[Path] = set()  # paths that did not exist when first looked at
_LISTED: dict[Path, frozenset[str]] = {}  # an existing folder's entries when first looked at


def _abs(path) -> Path:
    return Path(os.path.abspath(path))


def remember(path) -> None:
    """Note (once per path) which of `path` and its parents exist, and what the deepest existing
    one holds."""
    for q in (p := _abs(path), *p.parents):
        if q in _MISSING or q in _LISTED:
            return
        try:
            _LISTED[q] = frozenset(os.listdir(q))
            return
        except FileNotFoundError:
            _MISSING.add(q)
        except OSError:  # a file, unreadable: never ours to remove
            _LISTED[q] = frozenset()
            return


def created_here(path) -> bool:
    """True only when this process saw `path` (or a parent of it) missing, or its parent without
    it."""
    p = _abs(path)
    if any(q in _MISSING for q in (p, *p.parents)):
        return True
    before = _LISTED.get(p.parent)
    return before is not None and p.name not in before


def discard(run_dir: Path, claimed: bool) -> None:
    """Bad input: remove what this process created for the run, never anything that was there before
    or another run's directory."""
    run_dir = _abs(run_dir)
    if not claimed and (run_dir / OWNER).exists():
        return
    if created_here(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
        for (
            parent
        ) in run_dir.parents:  # <results_dir>/<subproject>/ made for this run, if still empty
            if not created_here(parent):
                break
            try:
                parent.rmdir()
            except OSError:
                break
        return
    before = _LISTED.get(run_dir)
    if before is None:
        return
    for entry in run_dir.iterdir():
        if entry.name not in before:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


class RememberRunDirs(Callback):
    """A Hydra callback (dtrain_base.yaml): note the run / sweep folder before Hydra creates it."""

    def on_run_start(self, config, **kwargs) -> None:
        remember(config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        remember(config.hydra.sweep.dir)
