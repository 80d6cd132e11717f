"""How far to trust a decision: the backtest's error band beside each choice.

Two figures, both from ``dtrain.costmodel.backtest.summary`` over the development set
(``backtest_runs.yaml``, predicted leave-one-source-out):

* ``time``: the median |error| of the predicted tokens/s per GPU. A runner-up whose predicted
  throughput is within it of the best is a tie: the model cannot tell the two apart.
* ``memory_low`` / ``memory_high``: the lowest and highest error of the predicted memory per GPU
  against the peak of the rows whose source prints one (predicted / reported − 1). A plan whose
  prediction divided by (1 + ``memory_low``) exceeds the GPU's HBM may run out of memory.

The guide computes the band once from its own backtest rows (``ErrorBand.from_rows``);
``dtrain plan`` uses ``PLAN_BAND``, the same figures recorded from ``dtrain backtest`` (a test
recomputes them, so they cannot drift from the code).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorBand:
    time: float  # median |error| of predicted tokens/s (0.087 = 8.7%)
    memory_low: float  # lowest predicted/reported peak memory − 1 (−0.21: predicted 21% low)
    memory_high: float  # highest (+0.08)
    rows: int = 0  # rows behind ``time``
    memory_rows: int = 0  # rows behind the memory figures

    @classmethod
    def from_rows(cls, rows: list) -> ErrorBand:
        """From ``backtest()``'s rows (``rank`` not needed)."""
        from .backtest import summary

        s = summary(rows)
        lo, hi = s["memory_error_range"] or (0.0, 0.0)
        return cls(s["median_abs_error"] or 0.0, lo, hi, s["rows"], s["memory_rows"])

    def tie(self, best_tps: float, other_tps: float) -> bool:
        """``other`` is within the time error of ``best``: the model cannot rank them."""
        return best_tps > 0 and 1 - other_tps / best_tps <= self.time

    def memory_worst(self, predicted: float) -> float:
        """The peak the prediction stands for at the low end of the memory check."""
        return predicted / (1 + self.memory_low) if self.memory_low > -1 else float("inf")

    def memory_risk(self, predicted: float, hbm: float) -> bool:
        """``predicted`` (any unit, as ``hbm``) is within the memory check's band of the HBM: at
        the check's low end the real peak would not fit."""
        return self.memory_worst(predicted) > hbm

    def time_text(self) -> str:
        return f"the backtest's median |error| {self.time:.1%}"

    def memory_text(self) -> str:
        return (
            f"the memory check's {self.memory_low:+.0%} to {self.memory_high:+.0%} against "
            "reported peaks"
        )


# `dtrain backtest` on the 55 development rows (leave-one-source-out, 2026-11-27): median |error|
# 7.4% (summary()["median_abs_error"]); memory against the 18 rows that print their peak: −21% to
# +8% (summary()["memory_error_range"]). tests/test_guide_uncertainty.py recomputes both.
PLAN_BAND = ErrorBand(time=0.074, memory_low=-0.21, memory_high=0.08, rows=55, memory_rows=18)
