"""The folders show the architecture (docs/ARCHITECTURE.md, "Packages"): the root of common/dtrain
holds only packages and `__init__.py`, and no two modules under it share a name (`__init__` and
`__main__` aside), so a name says which module it is."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "common" / "dtrain"


def test_the_root_holds_only_packages():
    modules = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    folders = [p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert modules == []
    assert sorted(p.name for p in folders if not (p / "__init__.py").is_file()) == []


def test_no_two_modules_share_a_stem():
    where = defaultdict(list)
    for path in ROOT.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            where[path.stem].append(str(path.relative_to(ROOT)))
    assert {stem: paths for stem, paths in where.items() if len(paths) > 1} == {}
