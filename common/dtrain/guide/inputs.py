"""What the guide reads, the same whichever command makes it.

`dtrain capstone` makes the guide from its own folder's runs plus the committed GPU measurements
(`measured/`, `--measured`) and records the latter in its folder (INPUTS_FILE) before it writes
the guide. `dtrain guide` without `--results` reads the same: the latest such capstone under
results/capstone/ with what it recorded, so `make guide` after `make capstone` gives the same
cells. Without any capstone it reads results/ plus measured/. Light: no torch, no cost model (the
capstone checks its --measured before any step starts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dtrain.core.errors import UserError

MEASURED = "measured"  # the committed GPU measurements (`make gpu-check` reports)
RESULTS = Path("results")
CAPSTONES = RESULTS / "capstone"  # dtrain.cli.capstone.results_folder's default parent
INPUTS_FILE = "guide-inputs.json"  # in a capstone's folder: {"measured": [paths relative to it]}
CHOOSE = "(--results DIR to choose)"


def gpu_measurements(measured: str = MEASURED) -> list[str]:
    """The committed GPU measurements the guide reads besides the runs: ``measured`` when it is
    a folder, nothing for ``none`` or the default when the checkout has none; a folder named but
    missing is an error (checked before any experiment starts)."""
    if measured == "none":
        return []
    if Path(measured).is_dir():
        return [measured]
    if measured == MEASURED:
        return []
    raise UserError(
        f"--measured {measured}: no such folder: give the folder `make gpu-check` "
        "reports were copied to, or --measured none"
    )


def record(folder: Path, measured: list[str]) -> list[str]:
    """The capstone, before its guide: note in its folder what the guide reads besides the
    folder's runs; returns the guide's inputs, read back as `dtrain guide` will read them."""
    from dtrain.results.metrics import write_json_atomic

    folder = Path(folder)
    # relative to the folder: the record stays right when the checkout moves or is read from
    # another working directory
    rel = [os.path.relpath(Path(m).resolve(), folder.resolve()) for m in measured]
    write_json_atomic(folder / INPUTS_FILE, {"measured": rel})
    return recorded(folder)


def recorded(folder: Path) -> list[str]:
    """A capstone's guide inputs: its folder, then the measurements it recorded (resolved from
    the folder)."""
    path = Path(folder) / INPUTS_FILE
    try:
        measured = [str(p) for p in json.loads(path.read_text())["measured"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable ({e}): pass --results DIR") from e
    return [str(folder), *(os.path.normpath(Path(folder) / m) for m in measured)]


def latest_capstone(root: Path = CAPSTONES) -> Path | None:
    """The newest capstone folder (names are start times) that got as far as its guide."""
    try:
        done = sorted(p.name for p in root.iterdir() if (p / INPUTS_FILE).is_file())
    except OSError:  # no results/capstone yet
        return None
    return root / done[-1] if done else None


def default_inputs() -> tuple[list[str], str]:
    """`dtrain guide` without --results: (inputs, a line saying what they are)."""
    capstone = latest_capstone()
    if capstone is not None:
        inputs = recorded(capstone)
        extra = f" and {', '.join(inputs[1:])}" if inputs[1:] else ""
        return inputs, (
            f"guide: reading the latest capstone, {capstone}{extra}, as `dtrain "
            f"capstone` did {CHOOSE}"
        )
    inputs = [str(RESULTS), *gpu_measurements()]
    return inputs, f"guide: no capstone under {CAPSTONES}: reading {' and '.join(inputs)} {CHOOSE}"
