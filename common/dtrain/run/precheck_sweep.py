"""A command-line sweep (-m) before any point runs (dtrain.run.precheck): its size, counted from
the sizes of its values before any point is made (more than MAX_SWEEP_POINTS is refused), its
points, a progress bar while they are checked, and the errors of many points grouped into a few
lines (one error shared by many points is one line)."""

from __future__ import annotations

import decimal
import math
import re
import sys

from dtrain.core.errors import UserError, clip
from dtrain.run.hydra_argv import override_key, parse_overrides

# A local sweep runs its points one after the other, each a whole run of seconds to hours, and
# checking one point takes ~0.1 s; on Slurm, hydra-submitit submits the sweep as one job array,
# and Slurm's default MaxArraySize (1001) takes at most 1,000 tasks. More points is a typo in a
# range (`range(1e-3,1,1e-7)`), refused from the sizes of its values before anything is expanded.
MAX_SWEEP_POINTS = 1000
PROGRESS_EVERY = 250  # off a terminal, one `checked N of M sweep points` line this often
SHOWN_POINTS = 3  # point numbers named in a line shared by many points, then a count
SHOWN_KINDS = 5  # lines for different errors of a sweep, then one line for the rest


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
    sizes = {override_key(o): sweep_size(o) for o in parsed}
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

    parsed = parsed if parsed is not None else parse_overrides(overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


class Progress:
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
