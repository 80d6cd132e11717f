"""One row of the guide's predicted-vs-measured table (``Check``) and why it misses the goal, if it
does.

Kept apart from ``local_check`` (which predicts the rows with dtrain's model, importing torch) so
the guide's text and plots read rows without it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

GOAL = 0.15
# A run is judged only when the host was quiet enough during its timed steps: its measured load
# factor (``dtrain.run.hostload``: (cpu + wait) / cpu, 1 = idle) at most MAX_LOAD, and its 90th
# percentile at most MAX_LOAD_SPREAD times its 10th. Beyond that the prediction's spread is wider
# than the goal can be checked against (a capstone at load 3-5 on 2 cores: x2-3, a +-60% band);
# an idle 2-core capstone measures x1.00-1.10 with spreads up to 1.65.
MAX_LOAD = 1.5
MAX_LOAD_SPREAD = 1.8
# the verdict needs at least this share of the rows judged; else the guide keeps the last valid one
MIN_JUDGED_SHARE = 0.5
VERDICT_FILE = "local-check.json"  # the last valid verdict, beside the guide's plots
CALLBACKS_NOTE = "not modelled: per-step callbacks on"  # TrainingMeasurement.step_callbacks


@dataclass(frozen=True)
class Check:
    experiment: str
    run: str
    what: str
    measured_s: float
    predicted_s: float
    basis: str
    detail: str = ""  # where the difference sits, when the run measured its parts
    predicted_range: tuple[float, float] | None = (
        None  # at the 10th / 90th percentile of the measured load
    )
    copies: tuple[str, ...] = ()  # folders repeating this run's guide inputs, checked once
    load: tuple[float, float, float] | None = None  # the run's measured load: median, 10th, 90th

    @property
    def judged(self) -> bool:
        """The host was quiet enough during the run to check the model against it (``MAX_LOAD``,
        ``MAX_LOAD_SPREAD``); a run without a measured load is judged."""
        if self.load is None:
            return True
        median, low, high = self.load
        return median <= MAX_LOAD and high <= MAX_LOAD_SPREAD * max(low, 1.0)

    @property
    def not_judged(self) -> str:
        """Why the row is not judged ("" when it is)."""
        if self.judged:
            return ""
        median, low, high = self.load
        return (
            f"not judged: the host was loaded (x{median:.2f} during the run, {low:.2f}-{high:.2f} "
            f"at its 10th-90th percentile; judged up to x{MAX_LOAD:g} and a {MAX_LOAD_SPREAD:g}x "
            "spread)"
        )

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def within_goal(self) -> bool:
        return abs(self.error) <= GOAL

    @property
    def within_spread(self) -> bool:
        """Within the goal somewhere in the prediction's spread (the load varied during the run)."""
        lo, hi = self.predicted_range or (self.predicted_s, self.predicted_s)
        return lo <= self.measured_s * (1 + GOAL) and hi >= self.measured_s * (1 - GOAL)

    def miss_reason(self, checks: list[Check]) -> str:
        """Why a row misses the goal, from what the runs measured ("" when within it)."""
        if self.within_goal:
            return ""
        twins = [
            c.measured_s
            for c in checks
            if c is not self and (c.experiment, c.what) == (self.experiment, self.what)
        ]
        if twins and any(abs(self.predicted_s / t - 1) <= GOAL for t in twins):
            alt = ", ".join(f"{t * 1e3:.0f}" for t in twins)
            return (
                f"run-to-run noise: the identical run measured {alt} ms vs "
                f"{self.measured_s * 1e3:.0f} ms here (other processes on the shared cores), and "
                "the prediction is within the goal of that one"
            )
        if self.predicted_range and self.within_spread:
            lo, hi = self.predicted_range
            return (
                "the load on the shared cores varied during the run: at its 10th-90th percentile "
                f"the prediction is {lo * 1e3:.0f}-{hi * 1e3:.0f} ms, which reaches the goal"
            )
        if self.error < 0 and CALLBACKS_NOTE in self.detail:
            tools = self.detail.split(CALLBACKS_NOTE + ": ", 1)[-1]
            return (
                f"the run's per-step tooling ({tools}: fp8-train's NaN guard's hooks on every "
                "linear layer, the health and debug statistics) runs every step; the model "
                "predicts training compute and communication only, and at this model size the "
                "tooling dominates the step"
            )
        if "comm measured" in self.detail:
            parts = [
                float(x)
                for x in self.detail.replace("ms", " ").split()
                if x.replace(".", "", 1).isdigit()
            ]
            gap = abs(self.measured_s - self.predicted_s) * 1e3
            if len(parts) >= 2 and parts[0] - parts[1] >= 0.3 * gap:
                return (
                    "in-training gloo communication is slower than allreduce-bench's isolated "
                    f"α–β: {parts[0] - parts[1]:.0f} of the {gap:.0f} ms gap"
                )
        load = (
            "" if self.predicted_range else " or more load on the shared cores than at probe time"
        )
        if self.error < 0:
            return (
                "the run spent more than the probe's GEMM curve and fixed overhead predict: "
                "per-step work of the distributed trainer that the single-process probe does not "
                f"run (DDP/FSDP/TP hooks, callbacks, FP8 casts){load}"
            )
        return "the run computed faster than the single-process probe predicts" + (
            "" if self.predicted_range else " (less load at run time)"
        )


@dataclass(frozen=True)
class Verdict:
    """The local check's verdict: ``within`` of ``judged`` judged rows within the goal, of ``rows``
    rows; ``date``: when the newest checked run ran, ``results``: what the guide read."""

    within: int
    judged: int
    rows: int
    date: str
    results: str

    @property
    def text(self) -> str:
        return f"{self.within} of {self.judged} within the goal" + (
            f" ({self.rows - self.judged} not judged: loaded host)"
            if self.judged < self.rows
            else ""
        )


def verdict(checks: list[Check], date: str = "", results: str = "") -> Verdict | None:
    """The verdict over the judged rows; None when too few could be judged (``MIN_JUDGED_SHARE``):
    the check could not be made under this load."""
    judged = [c for c in checks if c.judged]
    if not checks or not judged or len(judged) < MIN_JUDGED_SHARE * len(checks):
        return None
    return Verdict(sum(c.within_goal for c in judged), len(judged), len(checks), date, results)


def save_verdict(folder: str | Path, v: Verdict) -> Path:
    """Write ``v`` as the last valid verdict (``VERDICT_FILE`` in the guide's plots folder)."""
    from dtrain.results.metrics import write_json_atomic

    path = Path(folder) / VERDICT_FILE
    write_json_atomic(path, {"written_by": "dtrain guide", **asdict(v)})
    return path


def load_verdict(folder: str | Path) -> Verdict | None:
    """The last valid verdict stored in ``folder`` (None when there is none or it is unreadable)."""
    try:
        data = json.loads((Path(folder) / VERDICT_FILE).read_text())
        return Verdict(
            int(data["within"]),
            int(data["judged"]),
            int(data["rows"]),
            str(data["date"]),
            str(data["results"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
