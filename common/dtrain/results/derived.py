"""Runs made from other runs: a study report, an FP8 comparison, the GEMM probe.

    write_derived_run(out, "fp8-train", sources=[run dirs], config={...}, summary={...},
                      guide_inputs=[Fp8Comparison(...)])

writes ``out`` as a run directory like any other (config.yaml, env.json, summary.json last and
atomic) whose summary names the run directories it was derived from (``derived_from``, relative
to ``out`` so a results tree can be moved or copied; ``dtrain.results.contract.derived_from``
resolves them). It
publishes only what it derived (``dtrain.results.contract``): its sources keep their own records, so
calibration reads each measurement once, with no de-duplication.

A derived run owns its folder as a run owns its run directory (dtrain.run.rundir): ``claim_output``,
called before any work, refuses another run's folder, a folder inside one, a folder holding
anything, a file or an unwritable path (one UserError), and claims the folder with ``.run-owner``
(O_EXCL); ``claim_fresh`` makes a new, collision-free ``<prefix><time with µs>`` folder.
``write_derived_run`` claims ``out`` itself when this process has not, so no writer of a derived
run can skip the check.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import yaml

from dtrain.core import checks
from dtrain.core.errors import UserError
from dtrain.results import contract
from dtrain.results.metrics import CONFIG, ENV, write_json_atomic, write_summary, write_text_atomic
from dtrain.run import rundir
from dtrain.run.rundir import OWNER, RunDirTaken, check_outside_runs, claim, owner_text

_CLAIMED: set[Path] = set()  # folders this process claimed for a derived run (resolved)


def _listing(entries: list[str]) -> str:
    return ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")


def _taken(out: Path, key: str, fix: str | None) -> RunDirTaken:
    return RunDirTaken(
        f"{key} {out} already holds a run ({owner_text(out / OWNER)}): "
        f"{fix or f'pass a new {key}'}; a derived run never writes into another "
        "run's folder"
    )


def check_output(out: str | Path, key: str = "--out", fix: str | None = None) -> Path:
    """What ``claim_output`` refuses, checked without creating anything (before the work that needs
    no folder yet). ``fix``: what to do instead (default: pass a new ``key``)."""
    out = Path(out)
    checks.check_path(key, str(out))
    if os.path.lexists(out / OWNER):  # a run's folder, or one claimed for runs (a capstone's)
        raise _taken(out, key, fix)
    # inside a run's folder; a capstone's results folder holds runs by design (its report too)
    check_outside_runs(f"{key} {out}", out, key, include_self=False)
    entries = sorted(os.listdir(out)) if out.is_dir() else []
    if entries:
        raise UserError(
            f"{key} {out} is not empty (it holds {_listing(entries)}): "
            f"{fix or f'pass a new or empty {key}'}; a derived run writes only into "
            "a folder it creates"
        )
    return out


def claim_output(
    out: str | Path, key: str = "--out", holds_runs: bool = False, fix: str | None = None
) -> Path:
    """Make ``out`` this process's derived run before any work (see the module's doc); returns it.
    ``holds_runs``: the runs it is made from are started inside it (an FP8 comparison's
    ``runs/``), so it is claimed as a folder for runs (``rundir.claim_folder``, no run_dir)."""
    out = Path(out)
    if out.resolve() in _CLAIMED and (out / OWNER).is_file():  # claimed here, not removed since
        return out
    check_output(out, key, fix)
    if holds_runs:
        rundir.claim_folder(out, key, None)  # O_EXCL too; a lost race is its one line
    else:
        out.mkdir(parents=True, exist_ok=True)
        try:
            claim(out)  # O_EXCL: of two processes at once, one wins
        except RunDirTaken:
            raise _taken(out, key, fix) from None
    _CLAIMED.add(out.resolve())
    return out


def claim_fresh(
    parent: str | Path, prefix: str, key: str = "--out", holds_runs: bool = False
) -> Path:
    """A new folder ``<parent>/<prefix><time with µs>``, created exclusively and claimed: two
    commands started in the same second (or microsecond) get two folders."""
    checks.check_path(key, str(parent))
    check_outside_runs(f"{key} {parent}", parent, key)
    while True:
        out = Path(parent) / f"{prefix}{datetime.now():%Y%m%d-%H%M%S-%f}"
        try:
            out.mkdir(parents=True)  # exist_ok=False: the one that creates it owns it
        except FileExistsError:
            continue
        return claim_output(out, key, holds_runs)


def write_derived_run(
    out: str | Path,
    subproject: str,
    sources,
    config: dict,
    summary: dict,
    guide_inputs=(),
    env: dict | None = None,
) -> Path:
    """``env`` defaults to the first source's env.json (where the measurements ran). ``out`` is
    claimed here unless this process claimed it before its work (``claim_output``,
    ``claim_fresh``)."""
    out = claim_output(out, "derived run folder")
    sources = [Path(s) for s in sources]
    names = [os.path.relpath(s.resolve(), out.resolve()) for s in sources]
    write_text_atomic(
        out / CONFIG,
        yaml.safe_dump(
            {"subproject": subproject, **config, contract.DERIVED_FROM: names}, sort_keys=True
        ),
    )
    if env is None and sources and (sources[0] / ENV).exists():
        env = json.loads((sources[0] / ENV).read_text())
    if env is not None:
        write_json_atomic(out / ENV, env)
    write_summary(
        out,
        {
            "subproject": subproject,
            "run_dir": str(out),
            "status": "complete",
            **summary,
            contract.DERIVED_FROM: names,
            contract.KEY: list(guide_inputs),
        },
    )
    return out
