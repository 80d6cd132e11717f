"""Finding files under folders that runs are writing into.

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
