"""Load run directories (single runs or Hydra multirun trees) into pandas.

The guide and every report read results only through here. A run directory is any folder
holding our `config.yaml` (Hydra's own `.hydra/` copies are ignored). A run without
`summary.json` is incomplete; one whose files do not parse is corrupt; both are skipped with a
warning that names them, never silently mixed in.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pandas as pd
import yaml

from dtrain.core.errors import UserError
from dtrain.core.files import files_named
from dtrain.results.contract import DERIVED_FROM
from dtrain.results.metrics import CONFIG, ENV, EVENTS, RECORDS, SUMMARY


@dataclass
class Run:
    path: Path
    status: str  # complete | incomplete | corrupt
    reason: str = ""
    config: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)

    @property
    def subproject(self) -> str:
        return self.config.get("subproject", self.path.parent.name)

    @property
    def derived(self) -> bool:
        """Made from other runs (dtrain.results.derived: a study report, an FP8 comparison, the
        gemm-probe), not a measurement of its own: readers of measurements skip it by this flag."""
        return DERIVED_FROM in self.summary


def flatten(d: dict, prefix: str = "") -> dict:
    """{'model': {'n_layer': 2}} -> {'model.n_layer': 2}; lists stay values."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every line one JSON object; anything else is a ValueError naming the file and line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path.name} line {n}: {e.msg}") from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{path.name} line {n}: {type(row).__name__} {line.strip()[:40]!r}, not "
                        "an object"
                    )
                rows.append(row)
    return rows


def _read_mapping(path: Path, parse) -> dict:
    """config.yaml / env.json / summary.json: must hold one mapping (a list or a number is
    corrupt)."""
    value = parse(path.read_text())
    if value is None and path.suffix == ".yaml":
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} holds a {type(value).__name__}, not a mapping")
    return value


def read_run(path: Path) -> Run:
    path = Path(path)
    try:
        config = _read_mapping(path / CONFIG, yaml.safe_load)
        env = _read_mapping(path / ENV, json.loads) if (path / ENV).exists() else {}
        if not (path / SUMMARY).exists():
            return Run(path, "incomplete", "no summary.json", config, env)
        summary = _read_mapping(path / SUMMARY, json.loads)
        for name in (RECORDS, EVENTS):  # a complete run's measurements must all read back
            for f in [path / name, *sorted(path.glob(name.replace(".jsonl", ".rank*.jsonl")))]:
                if f.exists():
                    read_jsonl(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        return Run(path, "corrupt", f"{type(e).__name__}: {e}")
    return Run(path, "complete", "", config, env, summary)


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run directory under `paths` (each may be a run dir or any folder above run dirs)."""
    dirs: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such results path: {p}")
        candidates = (
            [p / CONFIG] if (p / CONFIG).exists() else files_named(p, CONFIG)
        )  # runs may be writing
        dirs.update(c.parent for c in candidates if ".hydra" not in c.parts)
    return [read_run(d) for d in sorted(dirs)]


def complete_runs(paths: Iterable[str | Path], warn: bool = True) -> list[Run]:
    good = []
    for run in find_runs(paths):
        if run.status == "complete":
            good.append(run)
        elif warn:
            warnings.warn(f"skipping {run.status} run {run.path}: {run.reason}", stacklevel=2)
    return good


def require_complete(paths: Iterable[str | Path], what: str = "this command") -> list[Run]:
    """The complete runs under `paths`, or a UserError that says why there are none (no run at all,
    or each one incomplete/corrupt, with the file at fault) instead of a misleading later
    failure."""
    paths = [str(p) for p in paths]
    runs = find_runs(paths)
    good = [r for r in runs if r.status == "complete"]
    for r in runs:
        if r.status != "complete" and good:
            warnings.warn(f"skipping {r.status} run {r.path}: {r.reason}", stacklevel=2)
    if good:
        return good
    if not runs:
        raise UserError(
            f"no run directory (with config.yaml) under {', '.join(paths)}: pass a run directory"
        )
    r = runs[0]
    more = f" (and {len(runs) - 1} more, none complete)" if len(runs) > 1 else ""
    raise UserError(f"cannot use run {r.path} for {what}: it is {r.status} ({r.reason}){more}")


def _records_of(run: Run, name: str, kind: str | None) -> list[dict]:
    files = [run.path / name] + sorted(run.path.glob(name.replace(".jsonl", ".rank*.jsonl")))
    rows = []
    for f in files:
        if f.exists():
            rows += [r for r in read_jsonl(f) if kind is None or r.get("kind") == kind]
    return rows


def _frame(runs: list[Run], name: str, kind: str | None, warn: bool) -> pd.DataFrame:
    rows = []
    for run in runs:
        try:
            records = _records_of(run, name, kind)
        except (OSError, ValueError) as e:
            if warn:
                warnings.warn(f"skipping corrupt run {run.path}: {e}", stacklevel=3)
            continue
        cfg = flatten(run.config)
        for r in records:
            # record fields win; a config field with the same name is kept as config.<name>
            row = {(f"config.{k}" if k in r else k): v for k, v in cfg.items()}
            row.update(r)
            row["run"] = str(run.path)
            rows.append(row)
    return pd.DataFrame(rows)


def load(paths: Iterable[str | Path], kind: str | None = None, warn: bool = True) -> pd.DataFrame:
    """records.jsonl of every complete run, one row per record, config flattened into columns."""
    return _frame(complete_runs(paths, warn), RECORDS, kind, warn)


def load_events(
    paths: Iterable[str | Path], kind: str | None = None, warn: bool = True
) -> pd.DataFrame:
    return _frame(complete_runs(paths, warn), EVENTS, kind, warn)


def load_runs(paths: Iterable[str | Path], warn: bool = True) -> pd.DataFrame:
    """One row per complete run: config columns, `summary.*`, `env.*` and `derived`
    (Run.derived)."""
    rows = []
    for run in complete_runs(paths, warn):
        row = flatten(run.config)
        row.update(flatten(run.summary, "summary."))
        row.update(flatten(run.env, "env."))
        row["run"], row["derived"] = str(run.path), run.derived
        rows.append(row)
    return pd.DataFrame(rows)
