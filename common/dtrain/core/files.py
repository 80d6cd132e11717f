"""Paths of folders runs write into: finding files under them while runs write, and the folder a
path names once the folders it passes through are made (``made_path``).

``Path.rglob`` raises FileNotFoundError when a folder goes between being listed and being entered;
a live results tree has such folders (a path check's temporary folder, a checkpoint being replaced,
a launcher's side folder), so anything that walks one while runs write uses ``files_named``.
"""

from __future__ import annotations

import os
from pathlib import Path


def files_named(root: str | Path, pattern: str) -> list[Path]:
    """The files under ``root`` whose path ends in ``pattern`` (``Path.match``: "config.yaml",
    "*_log.err", ".heartbeats/heartbeat.rank1"), sorted; folders that vanish mid-walk are
    skipped."""
    found = []
    for folder, _, names in os.walk(root):  # os.walk ignores folders it cannot list
        found += [p for n in names if (p := Path(folder, n)).match(pattern)]
    return sorted(found)


def made_path(value: str | Path) -> Path:
    """The folder a path names once its missing folders are made (as Hydra's ``os.makedirs``
    makes them): a ``..`` after a folder that does not exist yet cancels it (``new/..`` is the
    folder ``new`` sits in), after one that exists the system's parent of where it leads (a
    symlink's target's parent). ``Path(value)`` alone cannot say: ``a/new/..`` does not exist
    until ``new`` does, and then it is ``a``."""
    path = Path(value)
    here = Path(path.anchor) if path.is_absolute() else Path(".")
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        if part == "..":
            here = here.resolve().parent if here.exists() else here.parent
        elif part != ".":
            here = here / part
    return here
