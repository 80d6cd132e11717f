"""A checkpoint folder's step folders: <checkpoint_dir>/step-000123/ (DCP files; `.metadata` is
written last, so a folder without it is an interrupted save and is ignored when looking for the
latest). `prune` keeps the newest `train.keep_checkpoints` of a run's own checkpoint folder.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from dtrain.core.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def resolve(path: str | Path) -> Path:
    """A step folder as given, or the latest complete step-N folder inside a checkpoint folder."""
    path = Path(path)
    if is_complete(path):
        return path
    steps = sorted(
        (int(m.group(1)), p)
        for p in path.glob("step-*")
        if (m := _STEP_DIR.match(p.name)) and is_complete(p)
    )
    if not steps:
        raise UserError(
            f"train.resume_from={str(path)!r} holds no complete checkpoint (no .metadata): "
            "pass a step-N folder written by a finished save"
        )
    return steps[-1][1]


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def prune(checkpoint_dir: str | Path, keep: int | None, pinned=()) -> list[Path]:
    """Remove all but the newest `keep` complete step folders of a run's own checkpoint folder (and
    never one in `pinned`, e.g. the NaN guard's rollback target). Returns what was removed."""
    if not keep:
        return []
    pinned = {Path(p).resolve() for p in pinned if p}
    steps = sorted(
        (s, p)
        for p in Path(checkpoint_dir).glob("step-*")
        if (s := step_of(p)) is not None and is_complete(p)
    )
    gone = [p for _, p in steps[:-keep] if p.resolve() not in pinned]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
