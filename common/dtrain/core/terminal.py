"""What a command prints, sized for a person: lines within WIDTH columns, bars only on a terminal.

Every progress bar of dtrain and the experiments comes from here (`bar` for tqdm loops,
`rich_progress` for rich displays), so none is written into a pipe or a log: there a loop prints
at most one line per stage (`bar(..., lines=True)`). Tables are printed through `console()`, at
most WIDTH columns wide on a terminal and exactly WIDTH in a pipe (rich's own default there is
80, which squeezes the columns).
"""

from __future__ import annotations

import os
import sys

WIDTH = 100  # the widest line a command prints (a table, a note), on a terminal and in a pipe


def on_terminal() -> bool:
    """Progress is drawn where a person watches: stderr, where every bar goes, is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr (pytest, a daemon)
        return False


def width(stream=None) -> int:
    """Columns to print in: $COLUMNS or ``stream``'s terminal (stdout's by default) when
    narrower than WIDTH, else WIDTH (also in a pipe)."""
    cols = os.environ.get("COLUMNS", "")
    if not cols.isdigit():
        try:
            cols = os.get_terminal_size((stream or sys.stdout).fileno()).columns
        except (AttributeError, ValueError, OSError):  # a pipe, a file, a captured stream
            cols = WIDTH
    return max(20, min(WIDTH, int(cols)))


def console(stderr: bool = False):
    """A rich Console for tables and notes, at most WIDTH columns (colour only on a terminal)."""
    from rich.console import Console

    return Console(width=width(sys.stderr if stderr else sys.stdout), stderr=stderr)


def print_table(title: str, columns, rows, *, left=(), note: str = "") -> None:
    """One table as every experiment prints it: short headers, a legend of what they mean under
    it (``note``, then each "header = meaning"), right-aligned numbers (``left``: the headers of
    text columns), within WIDTH columns. ``columns``: (header, meaning or "") pairs; ``rows``:
    lists of cell strings."""
    from rich import box
    from rich.table import Table

    said = "; ".join(f"{h} = {m}" for h, m in columns if m)
    t = Table(
        title=title,
        caption="; ".join(x for x in (note, said) if x),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for header, _ in columns:
        t.add_column(header, justify="left" if header in left else "right")
    for row in rows:
        t.add_row(*row)
    console().print(t)


class _Lines:
    """A loop's progress off a terminal: one line per item on stderr ("<desc>: 1/4 done")."""

    def __init__(self, items, desc: str):
        self.items, self.desc = list(items), desc

    def __iter__(self):
        for i, item in enumerate(self.items, 1):
            yield item
            print(f"{self.desc}: {i}/{len(self.items)} done", file=sys.stderr, flush=True)


def bar(items=None, desc: str = "", show: bool = True, lines: bool = False, **kwargs):
    """tqdm over ``items`` (or a manual bar with total=...) on stderr, drawn only on a terminal
    and when ``show`` (e.g. rank 0). Off a terminal: silent, or with ``lines`` (slow stages) a
    line per item."""
    if show and lines and items is not None and not on_terminal():
        return _Lines(items, desc)
    from tqdm import tqdm

    kwargs.setdefault("leave", False)
    kwargs.setdefault("ncols", width(sys.stderr))
    return tqdm(items, desc=desc, file=sys.stderr, disable=not (show and on_terminal()), **kwargs)


def rich_progress(*columns, show: bool = True, **kwargs):
    """A rich Progress on stderr, disabled (no output) off a terminal or when not ``show``."""
    from rich.console import Console
    from rich.progress import Progress

    out = Console(stderr=True, width=width(sys.stderr))
    return Progress(*columns, console=out, disable=not (show and on_terminal()), **kwargs)


def shell_command(argv: list[str], indent: str = "  ") -> str:
    """``argv`` as a shell command a person can paste, broken between arguments (`` \\``) to fit
    WIDTH."""
    import shlex

    lines, line = [], indent
    for word in map(shlex.quote, argv):
        if line.strip() and len(line) + 1 + len(word) + 2 > WIDTH:
            lines.append(line)
            line = indent + "  "
        line += ("" if not line.strip() else " ") + word
    return " \\\n".join(lines + [line])
