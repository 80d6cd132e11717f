"""Checks on the command line before Hydra starts (Hydra creates run directories and prints its
own multi-line errors with exit code 1; the project promises one `error:` line and exit 2).

    check_overrides(...)  every override parses and composes against the typed config (an unknown
                          or renamed key, a wrong type is one line); in a sweep (-m) every point is
                          also validated before any point runs
    check_run_dirs(argv)  an explicit hydra.run.dir / hydra.sweep.dir already used by a run, or
                          holding anything but Hydra's bookkeeping (a folder of the user's, `.`), is
                          refused before Hydra writes into it (rundir.claim is the atomic guarantee;
                          this keeps the old run's .hydra/ and the user's files intact)
    check_literal_paths   results_dir / hydra.*.dir values that cannot hold a run (dtrain.checks)
    check_job_size        world_size= asked for against the job this process is already a rank of
"""
from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, open_dict

from dtrain.errors import UserError
from dtrain.rundir import OWNER, foreign_entries, owner_text

# command-line flags after which Hydra does not run the app (help, config printing, completion)
_NO_RUN = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--shell-completion", "-sc",
           "--resolve", "-p", "--package", "--experimental-rerun")
_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def _one_line(e: BaseException) -> str:
    """Hydra's message (and its cause's first line) as one line."""
    text = " ".join(str(e).split())
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in text:
            text += f" ({first})"
    return text


def split_argv(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun, checkable) from a Hydra command line. Not checkable: Hydra will not run
    the app (--help, --cfg, ...) or composes another config (--config-name/-path/-dir); Hydra
    handles those as usual."""
    overrides, multirun, checkable, skip = [], False, True, False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if arg in ("-m", "--multirun"):
            multirun = True
        elif flag in _NO_RUN or flag in _WITH_VALUE:
            checkable = False
            skip = arg in _WITH_VALUE  # its value is the next argument
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun, checkable


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The override list of every point of a command-line sweep (Hydra's basic sweeper's product)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


def check_renamed(overrides: list[str], renamed: dict[str, str]) -> None:
    """An override of a renamed key is refused with its new name (never silently accepted)."""
    from dtrain.config import renamed_key

    for o in overrides:
        new = renamed_key(o, renamed)
        if new is not None:
            raise UserError(f"{o.split('=', 1)[0].lstrip('+~')} was renamed: use {new}")


_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def _typed_message(e: BaseException) -> str | None:
    """OmegaConf's type error for `train.steps=abc` as `train.steps='abc' must be an integer`, and
    its unknown key `model.n_laye=4` as `unknown key model.n_laye: model's keys are ...`."""
    import dataclasses
    import re
    import typing

    from omegaconf.errors import ConfigAttributeError, ValidationError

    cause = e if isinstance(e, (ValidationError, ConfigAttributeError)) else e.__cause__
    if isinstance(cause, ConfigAttributeError) and dataclasses.is_dataclass(getattr(cause, "object_type", None)):
        key = str(cause.full_key)
        parent = key.rsplit(".", 1)[0] + "'s" if "." in key else "the top-level"
        known = ", ".join(f.name for f in dataclasses.fields(cause.object_type))
        return f"unknown key {key}: {parent} keys are {known}"
    match = re.search(r"could not be converted to (\w+)", str(getattr(cause, "msg", "")))
    if not isinstance(cause, ValidationError) or not match or match.group(1) not in _WORDS:
        return None
    key = str(cause.full_key)
    with contextlib.suppress(Exception):  # an Optional field also takes null
        hint = typing.get_type_hints(cause.object_type)[key.rsplit(".", 1)[-1]]
        if type(None) in typing.get_args(hint):
            return f"{key}={cause.value!r} must be {_WORDS[match.group(1)]} or null"
    return f"{key}={cause.value!r} must be {_WORDS[match.group(1)]}"


def _quote_hint(e: BaseException, overrides: list[str]) -> str:
    """Hydra's grammar takes non-ASCII characters (`results_dir=résultats`) only in a quoted value."""
    if "token recognition error" in _one_line(e) and not "".join(overrides).isascii():
        return ": quote a value with non-ASCII characters, e.g. 'results_dir=\"résultats\"'"
    return ""


def check_overrides(config_module: str, config_name: str, argv: list[str],
                    validate: Callable[[DictConfig], None] | None) -> None:
    """Raise UserError on a renamed key (the conf module's `RENAMED`) or an override Hydra would reject;
    in a sweep, on any invalid point."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides, multirun, checkable = split_argv(argv)
    if not checkable:
        return
    conf = importlib.import_module(config_module)  # registers its typed config in Hydra's ConfigStore
    check_renamed(overrides, getattr(conf, "RENAMED", {}))
    try:
        points = sweep_points(overrides) if multirun else [overrides]
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"bad override: {_one_line(e)}{_quote_hint(e, overrides)}") from None
    # Points a Hydra launcher plugin sends elsewhere (submitit_slurm) are checked as Slurm runs:
    # this host's devices and memory say nothing about the compute nodes'.
    remote = any(o.startswith("hydra/launcher=") and o != "hydra/launcher=basic" for o in overrides)
    errors = []
    with initialize_config_module(config_module=config_module, version_base="1.3"):
        for n, point in enumerate(points):
            job = [o for o in point if not o.lstrip("+~").startswith("hydra")]  # Hydra's own keys: Hydra's
            where = f"sweep point #{n} ({' '.join(job)}): " if multirun else ""
            try:
                cfg = compose(config_name=config_name, overrides=job)
            except (HydraException, OmegaConfBaseException) as e:
                errors.append(f"{where}{_typed_message(e) or _one_line(e) + _quote_hint(e, job)}")
                continue
            if validate is not None:  # single runs too: bad input never reaches Hydra's run folder
                if remote:
                    with open_dict(cfg):
                        cfg.launcher = "slurm"
                try:
                    validate(cfg)
                except UserError as e:
                    errors.append(f"{where}{e}")
    if errors:
        if multirun:
            errors.append(f"{len(errors)} of {len(points)} sweep points are invalid; none was run")
        raise UserError("\nerror: ".join(errors))


def check_run_dirs(argv: list[str]) -> None:
    """An explicit hydra.run.dir (or a sweep dir holding runs) that a run already owns is refused."""
    if any(arg.split("=", 1)[0] in _NO_RUN for arg in argv):
        return  # Hydra prints help or config and runs nothing
    for arg in split_argv(argv)[0]:
        key, _, value = arg.lstrip("+").partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value or "$" in value or "," in value:
            continue
        path = Path(value)
        owned = [path / OWNER] if key == "hydra.run.dir" else sorted(path.glob(f"*/{OWNER}"))
        owned = [o for o in owned if o.exists()]
        if owned:
            raise UserError(f"{key}={value} already holds a run ({owner_text(owned[0])}): "
                            "pass a new directory (or delete the old run); a run directory is never reused")
        others = foreign_entries(path)
        if others:
            raise UserError(f"{key}={value} is not empty (it holds {', '.join(others[:3])}"
                            f"{', ...' if len(others) > 3 else ''}): pass a new or empty directory; a run writes "
                            "only into a folder it creates, never among files it did not make")


def literal_override(argv: list[str], key: str) -> str | None:
    """The value of `key=...` on the command line when it is one plain value (no sweep, no interpolation)."""
    value = None
    for arg in split_argv(argv)[0]:
        k, eq, v = arg.lstrip("+").partition("=")
        if eq and k == key:
            value = v
    if value is None or any(c in value for c in ",$()[]"):
        return None
    return value.strip("'\"")


def check_literal_paths(argv: list[str]) -> None:
    """results_dir / hydra.run.dir / hydra.sweep.dir given as a plain value: Hydra creates a folder from
    them before any of our code runs, so an empty, too long, looping or unwritable path is refused here."""
    from dtrain.checks import check_path

    if any(arg.split("=", 1)[0] in _NO_RUN for arg in argv):
        return
    for key in ("results_dir", "hydra.run.dir", "hydra.sweep.dir"):
        value = literal_override(argv, key)
        if value is not None:
            check_path(key, value)


def check_job_size(argv: list[str], job) -> None:
    """Inside a job (RANK/WORLD_SIZE set: torchrun, srun, or left over in the shell) the job's size is the
    run's; an explicit world_size= that disagrees is refused instead of silently running another size."""
    asked = literal_override(argv, "world_size")
    if job is None or asked is None or not asked.isdigit() or int(asked) == job.world_size:
        return
    raise UserError(f"world_size={asked} but this process is rank {job.rank} of a {job.world_size}-rank job "
                    "(RANK and WORLD_SIZE are set: torchrun, srun, or left over in this shell): drop world_size= "
                    f"to run as that rank, pass launcher=local to start {asked} ranks here, or unset RANK "
                    "WORLD_SIZE MASTER_ADDR MASTER_PORT")


def note_job_environment(argv: list[str], job) -> None:
    """Say which way torchrun's variables were taken when they may be a leftover: no torchrun agent set them."""
    import os
    import sys

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(n in os.environ for n in names) or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    if job is None:
        print("note: launcher=local: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment are "
              "ignored; ranks are started here", file=sys.stderr, flush=True)
    elif "SLURM_STEP_ID" not in os.environ:
        print(f"note: RANK={job.rank} WORLD_SIZE={job.world_size} are set without torchrun: running as that rank "
              f"(it waits up to dist_timeout_s for its peers); pass launcher=local to start ranks here instead",
              file=sys.stderr, flush=True)
