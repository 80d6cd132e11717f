"""The calibration's records: one run's guide inputs (``RunInputs``, dtrain.results.contract),
where they were measured (``Source``), and a value of a calibration field read from them with its
provenance (``Candidate``); ``leave_one_out`` pools the other runs' candidates. One reader per
record kind turns records into candidates (``calibration_links``: allreduce-bench's fits,
``calibration_training``: training runs, ``calibration_tp``: tp-attention's TP and CP layers,
``calibration_probe``: the gemm-probe); ``calibrate.calibrate`` picks among them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dtrain.results import contract
from dtrain.results.loader import Run

from .calibration import Param


@dataclass(frozen=True)
class Source:
    """The run a measured value comes from."""

    run: str
    date: str
    device: str
    backend: str
    world_size: int
    gpu_name: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def gpu_profile(self) -> str | None:
        """The hardware.yaml profile of the GPU it ran on (None off GPUs or for an unknown GPU)."""
        from .hardware import gpu_profile_name

        return gpu_profile_name(self.gpu_name) if self.on_gpu and self.gpu_name else None

    def provenance(self, detail: str = "") -> str:
        what = self.gpu_name or self.device
        extra = f"; {detail}" if detail else ""
        return (
            f"measured here: {self.run}, {self.date}, {what} ({self.backend}, "
            f"{self.world_size} ranks){extra}"
        )


@dataclass(frozen=True)
class Candidate:
    """One measured value of a calibration field, with the run it comes from."""

    name: str
    value: float
    source: Source
    detail: str = ""
    # leave_one_out's median: the other runs' candidates it is taken over (() for a measured one)
    pooled: tuple[Candidate, ...] = ()

    def param(self) -> Param:
        return Param(self.value, self.source.provenance(self.detail))


@dataclass(frozen=True)
class RunInputs:
    """One run's guide inputs and where they were measured."""

    run: Run
    source: Source
    records: tuple

    def of(self, kind) -> list:
        return [r for r in self.records if isinstance(r, kind)]


def finite_number(x) -> float | None:
    """``x`` as a float; None when it is missing, not a number, NaN or infinite."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def training_entries(inputs: RunInputs, recipe: bool = False) -> list[contract.TrainingMeasurement]:
    """The run's plain training records (they measure compute efficiency), or with ``recipe`` its
    numerics-recipe runs (fp8-train's)."""
    return [m for m in inputs.of(contract.TrainingMeasurement) if (m.recipe is not None) == recipe]


def leave_one_out(
    cands: list[Candidate], name: str, run: str, on_gpu: bool = False
) -> Candidate | None:
    """The median of every ``name`` value measured on this kind of device by a run other than
    ``run`` (a display path, as ``Source.run``); None when no other run measured it."""
    pool = [
        c for c in cands if c.name == name and c.source.run != run and c.source.on_gpu == on_gpu
    ]
    if not pool:
        return None
    vals = sorted(c.value for c in pool)
    med = statistics.median(vals)
    runs = ", ".join(
        f"{c.source.run} {c.value:.2f}" for c in sorted(pool, key=lambda c: c.source.run)
    )
    detail = f"leave-one-out: median of {len(pool)} other run(s) ({runs})"
    return Candidate(name, med, pool[0].source, detail, pooled=tuple(pool))
