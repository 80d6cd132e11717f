"""One row of the guide's predicted-vs-measured table (``Check``) and why it misses the goal, if it
does.

Kept apart from ``local_check`` (which predicts the rows with dtrain's model, importing torch) so
the guide's text and plots read rows without it.
"""

from __future__ import annotations

from dataclasses import dataclass

GOAL = 0.15
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
