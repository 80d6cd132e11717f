"""Checks on the command line before Hydra starts (Hydra creates run directories and prints its
own multi-line errors with exit code 1; the project promises one `error:` line and exit 2).

    check_overrides(...)  every override parses and composes against the typed config (an unknown
                          or renamed key, a wrong type is one line); in a sweep (-m) every point is
                          also validated before any point runs (this module)
    check_run_dirs(argv)  an explicit hydra.run.dir / hydra.sweep.dir already used by a run, or
                          holding anything but Hydra's bookkeeping, is refused before Hydra writes
                          into it (dtrain.run.precheck_dirs)
    check_literal_paths   results_dir / hydra.*.dir values that cannot hold a run
                          (dtrain.run.precheck_dirs, dtrain.core.checks)
    check_job_size        world_size= asked for against the job this process is already a rank of
                          (dtrain.run.precheck_job)

A key given twice is refused (Hydra would keep the last silently); a sweep's size, its points'
progress bar and their grouped errors are dtrain.run.precheck_sweep's; Hydra's errors become one
line in dtrain.run.override_messages; the command line is read by dtrain.run.hydra_argv.
Every user value an error line quotes is clipped (dtrain.core.errors.clip).
"""

from __future__ import annotations

import importlib
from typing import Callable

from omegaconf import DictConfig, open_dict

from dtrain.core.errors import VALUE_LIMIT, UserError, clip, clip_words
from dtrain.run.hydra_argv import override_key, parse_overrides, split_argv
from dtrain.run.override_messages import one_line, quote_hint, typed_message
from dtrain.run.precheck_sweep import Progress, check_sweep_size, group_errors, sweep_points


def check_renamed(overrides: list[str], renamed: dict[str, str]) -> None:
    """An override of a renamed key is refused with its new name (never silently accepted)."""
    from dtrain.core.nodes import renamed_key

    for o in overrides:
        new = renamed_key(o, renamed)
        if new is not None:
            raise UserError(f"{clip(o.split('=', 1)[0].lstrip('+~'))} was renamed: use {new}")


def check_long_keys(overrides: list[str]) -> None:
    """No key is hundreds of characters long; Hydra would look such a key up as a config file
    and fail with a traceback (a name longer than the filesystem's 255)."""
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if len(key) > VALUE_LIMIT:
            raise UserError(f"unknown key {clip(key)}: no key is that long: check the override")


def check_duplicates(overrides: list[str], parsed: list) -> None:
    """A key given twice: Hydra keeps the last one silently; refused, naming both."""
    given: dict[str, list[str]] = {}
    for text, override in zip(overrides, parsed):
        given.setdefault(override_key(override), []).append(text)
    for key, texts in given.items():
        if len(texts) > 1:
            times = "twice" if len(texts) == 2 else f"{len(texts)} times"
            shown = ", ".join(clip(t) for t in texts)
            raise UserError(f"{clip(key)} is given {times} ({shown}): keep one")


def check_overrides(
    config_module: str,
    config_name: str,
    argv: list[str],
    validate: Callable[[DictConfig], None] | None,
) -> None:
    """Raise UserError on a renamed key (the conf module's `RENAMED`), a key given twice or an
    override Hydra would reject; in a sweep, on too many points or any invalid point."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides, multirun, checkable = split_argv(argv)
    if not checkable:
        return
    conf = importlib.import_module(
        config_module
    )  # registers its typed config in Hydra's ConfigStore
    check_long_keys(overrides)
    check_renamed(overrides, getattr(conf, "RENAMED", {}))
    try:
        parsed = parse_overrides(overrides)
        check_duplicates(overrides, parsed)
        if multirun:
            check_sweep_size(parsed)
        points = sweep_points(overrides, parsed) if multirun else [overrides]
    except (HydraException, OmegaConfBaseException) as e:
        if multirun:
            raise UserError(f"bad override: {one_line(e)}{quote_hint(e, overrides)}") from None
        points = [overrides]  # composing names it, with the key's type when it is one
    errors = _check_points(config_module, config_name, points, validate, remote=_remote(overrides))
    if errors and not multirun:
        raise UserError(clip_words(errors[0][2]))
    if errors:
        raise UserError(clip_words("\nerror: ".join(group_errors(errors, len(points)))))


def _remote(overrides: list[str]) -> bool:
    """Points a Hydra launcher plugin sends elsewhere (submitit_slurm) are checked as Slurm runs:
    this host's devices and memory say nothing about the compute nodes'."""
    return any(o.startswith("hydra/launcher=") and o != "hydra/launcher=basic" for o in overrides)


def _check_points(
    config_module: str,
    config_name: str,
    points: list[list[str]],
    validate: Callable[[DictConfig], None] | None,
    remote: bool,
) -> list[tuple[int, str, str]]:
    """(point number, its overrides, error) of every point that does not compose or validate."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    errors, progress = [], Progress(len(points))
    try:
        with initialize_config_module(config_module=config_module, version_base="1.3"):
            for n, point in enumerate(points):
                # Hydra's own keys are Hydra's to check
                job = [o for o in point if not o.lstrip("+~").startswith("hydra")]
                error = _check_point(
                    compose,
                    config_name,
                    job,
                    validate,
                    remote,
                    (HydraException, OmegaConfBaseException),
                )
                if error is not None:
                    errors.append((n, " ".join(job), error))
                progress.step()
    finally:
        progress.close()
    return errors


def _check_point(
    compose, config_name: str, job: list[str], validate, remote: bool, hydra_errors
) -> str | None:
    """One point's error, or None."""
    try:
        cfg = compose(config_name=config_name, overrides=job)
    except hydra_errors as e:
        return typed_message(e) or one_line(e) + quote_hint(e, job)
    if validate is not None:  # single runs too: bad input never reaches Hydra's run folder
        if remote:
            with open_dict(cfg):
                cfg.launcher = "slurm"
        try:
            validate(cfg)
        except UserError as e:
            return str(e)
    return None
