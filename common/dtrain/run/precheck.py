"""Checks on the command line before Hydra starts (Hydra creates run directories and prints its
own multi-line errors with exit code 1; the project promises one `error:` line and exit 2).

    check_overrides(...)  every override parses and composes against the typed config (an unknown
                          or renamed key, a wrong type is one line); in a sweep (-m) every point is
                          also validated before any point runs
    check_run_dirs(argv)  an explicit hydra.run.dir / hydra.sweep.dir already used by a run, or
                          holding anything but Hydra's bookkeeping (a folder of the user's, `.`), is
                          refused before Hydra writes into it (rundir.claim is the atomic guarantee;
                          this keeps the old run's .hydra/ and the user's files intact)
    check_literal_paths   results_dir / hydra.*.dir values that cannot hold a run
                          (dtrain.core.checks)
    check_job_size        world_size= asked for against the job this process is already a rank of

A key given twice is refused (Hydra would keep the last silently), a sweep of more than
MAX_SWEEP_POINTS points is refused from the sizes of its values before any point is made, the
points are checked under a progress bar, and one error shared by many points is one line.
Every user value an error line quotes is clipped (dtrain.core.errors.clip).
"""

from __future__ import annotations

import contextlib
import decimal
import importlib
import math
import re
import sys
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, open_dict

from dtrain.core.errors import VALUE_LIMIT, UserError, clip, clip_words, unknown_key
from dtrain.run import requeue, rundir
from dtrain.run.rundir import OWNER, foreign_entries, owner_text

# command-line flags after which Hydra does not run the app (help, config printing, completion)
_NO_RUN = (
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "--shell-completion",
    "-sc",
    "--resolve",
    "-p",
    "--package",
    "--experimental-rerun",
)
_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")

# A local sweep runs its points one after the other, each a whole run of seconds to hours, and
# checking one point takes ~0.1 s; on Slurm, hydra-submitit submits the sweep as one job array,
# and Slurm's default MaxArraySize (1001) takes at most 1,000 tasks. More points is a typo in a
# range (`range(1e-3,1,1e-7)`), refused from the sizes of its values before anything is expanded.
MAX_SWEEP_POINTS = 1000
PROGRESS_EVERY = 250  # off a terminal, one `checked N of M sweep points` line this often
SHOWN_POINTS = 3  # point numbers named in a line shared by many points, then a count
SHOWN_KINDS = 5  # lines for different errors of a sweep, then one line for the rest


def _one_line(e: BaseException) -> str:
    """Hydra's message (and its cause's first line) as one line; it quotes the override: clipped."""
    text = " ".join(str(e).split())
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in text:
            text += f" ({first})"
    return clip_words(text)


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


def check_renamed(overrides: list[str], renamed: dict[str, str]) -> None:
    """An override of a renamed key is refused with its new name (never silently accepted)."""
    from dtrain.core.nodes import renamed_key

    for o in overrides:
        new = renamed_key(o, renamed)
        if new is not None:
            raise UserError(f"{clip(o.split('=', 1)[0].lstrip('+~'))} was renamed: use {new}")


_WORDS = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "String": "a string",
}


def _typed_message(e: BaseException) -> str | None:
    """OmegaConf's type error for `train.steps=abc` as `train.steps='abc' must be an integer`, and
    its unknown key `model.n_laye=4` as `unknown key model.n_laye: model's keys are ...`."""
    import dataclasses
    import re
    import typing

    from omegaconf.errors import ConfigAttributeError, ValidationError

    cause = e if isinstance(e, (ValidationError, ConfigAttributeError)) else e.__cause__
    if isinstance(cause, ConfigAttributeError) and dataclasses.is_dataclass(
        getattr(cause, "object_type", None)
    ):
        key = str(cause.full_key)
        parent = key.rsplit(".", 1)[0] + "'s" if "." in key else "the top-level"
        known = [f.name for f in dataclasses.fields(cause.object_type)]
        return unknown_key(key, known, _dotted_keys(cause.parent_node), parent)
    match = re.search(r"could not be converted to (\w+)", str(getattr(cause, "msg", "")))
    if not isinstance(cause, ValidationError) or not match or match.group(1) not in _WORDS:
        return None
    key = str(cause.full_key)
    with contextlib.suppress(Exception):  # an Optional field also takes null
        hint = typing.get_type_hints(cause.object_type)[key.rsplit(".", 1)[-1]]
        if type(None) in typing.get_args(hint):
            return f"{key}={clip(repr(cause.value))} must be {_WORDS[match.group(1)]} or null"
    return f"{key}={clip(repr(cause.value))} must be {_WORDS[match.group(1)]}"


def _dotted_keys(node) -> list[str]:
    """Every key of the config `node` belongs to, dotted (`train.timing_warmup`), Hydra's own left
    out: what a did-you-mean picks from."""
    from omegaconf import DictConfig

    def walk(n, prefix: str):
        for k in n.keys():
            child = n._get_node(k)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                yield from walk(child, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    if node is None:
        return []
    root = node._get_root()
    return [k for k in walk(root, "") if not k.startswith("hydra")]


def _quote_hint(e: BaseException, overrides: list[str]) -> str:
    """Hydra's grammar takes non-ASCII characters (`results_dir=résultats`) only in a quoted
    value."""
    if "token recognition error" in _one_line(e) and not "".join(overrides).isascii():
        return ": quote a value with non-ASCII characters, e.g. 'results_dir=\"résultats\"'"
    return ""


def _parse(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides=overrides)


def _key(override) -> str:
    """The key an override sets, whatever its form (`+k`, `++k`, `~k`, `group@package`)."""
    return override.key_or_group + (f"@{override.package}" if override.package else "")


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
        given.setdefault(_key(override), []).append(text)
    for key, texts in given.items():
        if len(texts) > 1:
            times = "twice" if len(texts) == 2 else f"{len(texts)} times"
            shown = ", ".join(clip(t) for t in texts)
            raise UserError(f"{clip(key)} is given {times} ({shown}): keep one")


def sweep_size(override) -> int:
    """How many values a sweep override takes, counted without making them (a range's length)."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    value = override.value() if override.is_sweep_override() else None
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    if isinstance(value, RangeSweep) and value.start is not None and value.stop is not None:
        start, stop, step = (decimal.Decimal(v) for v in (value.start, value.stop, value.step))
        if step == 0:
            return 1  # Hydra's own error names it when the points are made
        return max(0, math.ceil((stop - start) / step))
    return 1  # one value, or a sweep the basic sweeper refuses with its own message


def check_sweep_size(parsed: list) -> None:
    """More than MAX_SWEEP_POINTS points is refused from the product of the value counts, before
    any point is made (a 10^7-point range would take minutes just to list)."""
    sizes = {_key(o): sweep_size(o) for o in parsed}
    total = math.prod(sizes.values())
    if total <= MAX_SWEEP_POINTS:
        return
    parts = " x ".join(f"{clip(k)}: {n:,} values" for k, n in sizes.items() if n > 1)
    raise UserError(
        f"the sweep has {total:,} points ({parts}); at most "
        f"{MAX_SWEEP_POINTS:,} points are run in one sweep: narrow the ranges or split "
        "the sweep"
    )


def sweep_points(overrides: list[str], parsed: list | None = None) -> list[list[str]]:
    """The override list of every point of a command-line sweep (Hydra's basic sweeper's
    product)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = parsed if parsed is not None else _parse(overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


class _Progress:
    """While the points are checked: a bar on a terminal (as the trainer's), a line every
    PROGRESS_EVERY points off one (a log then shows it is not stuck), nothing for a single run."""

    def __init__(self, total: int):
        from dtrain.core.terminal import bar, on_terminal

        self.total, self.done, self.bar = total, 0, None
        if total > 1 and on_terminal():
            self.bar = bar(total=total, desc="checking sweep points")

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif self.done % PROGRESS_EVERY == 0 and self.done < self.total:
            print(
                f"checked {self.done:,} of {self.total:,} sweep points", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_VALUE = re.compile(r"('[^']*'|\"[^\"]*\"|(?<==)[^\s,;:()\[\]]+)")  # a quoted or `key=` value


def _shape(message: str) -> str:
    """A point's error without its values (`train.lr=-3 must be` -> `train.lr=... must be`): points
    failing the same way share one line."""
    return _VALUE.sub("...", message)


def _common(messages: list[str]) -> str:
    """Messages of one shape as one: a value they all share is kept, one that differs is `...`."""
    parts = [_VALUE.split(m) for m in messages]

    def part(i: int, p: str) -> str:
        if i % 2 == 0 or all(q[i] == p for q in parts):
            return p
        return f"{p[0]}...{p[0]}" if p[0] in "'\"" else "..."

    return "".join(part(i, p) for i, p in enumerate(parts[0]))


def group_errors(errors: list[tuple[int, str, str]], n_points: int) -> list[str]:
    """One line per kind of error of a sweep ((point number, its overrides, message) each), naming
    a few points then their count; at most SHOWN_KINDS lines, then one for the rest, and the
    total."""
    groups: dict[str, list[tuple[int, str, str]]] = {}
    for error in errors:
        groups.setdefault(_shape(error[2]), []).append(error)
    lines = []
    for members in list(groups.values())[:SHOWN_KINDS]:
        if len(members) == 1:
            n, job, message = members[0]
            lines.append(f"sweep point #{n} ({clip(job)}): {message}")
            continue
        numbers = ", ".join(f"#{n}" for n, _, _ in members[:SHOWN_POINTS])
        more = ", ..." if len(members) > SHOWN_POINTS else ""
        message = _common([m for _, _, m in members])
        lines.append(f"sweep points {numbers}{more} ({len(members):,} points): {message}")
    rest = sum(len(m) for m in list(groups.values())[SHOWN_KINDS:])
    if rest:
        kinds = len(groups) - SHOWN_KINDS
        lines.append(f"{rest:,} more sweep points fail in {kinds:,} other ways (not shown)")
    lines.append(f"{len(errors):,} of {n_points:,} sweep points are invalid; none was run")
    return lines


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
        parsed = _parse(overrides)
        check_duplicates(overrides, parsed)
        if multirun:
            check_sweep_size(parsed)
        points = sweep_points(overrides, parsed) if multirun else [overrides]
    except (HydraException, OmegaConfBaseException) as e:
        if multirun:
            raise UserError(f"bad override: {_one_line(e)}{_quote_hint(e, overrides)}") from None
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

    errors, progress = [], _Progress(len(points))
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
        return _typed_message(e) or _one_line(e) + _quote_hint(e, job)
    if validate is not None:  # single runs too: bad input never reaches Hydra's run folder
        if remote:
            with open_dict(cfg):
                cfg.launcher = "slurm"
        try:
            validate(cfg)
        except UserError as e:
            return str(e)
    return None


def check_run_dirs(argv: list[str]) -> None:
    """An explicit hydra.run.dir (or a sweep dir holding runs) that a run already owns is
    refused."""
    if any(arg.split("=", 1)[0] in _NO_RUN for arg in argv):
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
        path = Path(value)
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


def literal_override(argv: list[str], key: str) -> str | None:
    """The value of `key=...` on the command line when it is one plain value (no sweep, no
    interpolation)."""
    value = None
    for arg in split_argv(argv)[0]:
        k, eq, v = arg.lstrip("+").partition("=")
        if eq and k == key:
            value = v
    if value is None or any(c in value for c in ",$()[]"):
        return None
    return value.strip("'\"")


def check_literal_paths(argv: list[str]) -> None:
    """results_dir / hydra.run.dir / hydra.sweep.dir given as a plain value: Hydra creates a
    folder from them before any of our code runs, so an empty, too long, looping or unwritable
    path is refused here."""
    from dtrain.core.checks import check_path

    if any(arg.split("=", 1)[0] in _NO_RUN for arg in argv):
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
    import os
    import sys

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
