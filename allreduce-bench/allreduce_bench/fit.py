"""Latency/bandwidth (α–β, Hockney) fit per collective and link class.

    t(S) = α + S·c/β        c = the collective's bus factor (busbw.bus_factor), so β is a bus
                            bandwidth: the busbw the collective approaches at large S

Linear in x = S·c: t = α + x·(1/β). Sizes are swept geometrically and their times span orders of
magnitude, so an ordinary least squares fit would be decided by the largest sizes alone and leave
α to their noise; we minimise *relative* residuals instead (weights 1/t²), so every size counts
alike. A negative α (noise at the small sizes) is refitted with α = 0 and flagged. R² is that of
the weighted regression (relative residuals), so small sizes count in it as much as large ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    alpha_us: float
    beta_GBps: float
    r2: float
    n_points: int
    alpha_clamped: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def r_squared(y: np.ndarray, predicted: np.ndarray, weights: np.ndarray | None = None) -> float:
    """1 - SS_res/SS_tot, with the regression's weights (none: the ordinary R²)."""
    w = np.ones_like(y) if weights is None else weights
    mean = float((w * y).sum() / w.sum())
    ss_res = float((w * (y - predicted) ** 2).sum())
    ss_tot = float((w * (y - mean) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def fit_alpha_beta(nbytes, seconds, bus_factor: float) -> Fit | None:
    """α (µs), β (GB/s) and R² from (S, t) pairs; None when they cannot define a line
    (fewer than 2 sizes, c = 0 on one rank, or times that fall with size)."""
    x = np.asarray(nbytes, dtype=float) * bus_factor
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2 or bus_factor <= 0 or np.ptp(x) == 0 or np.any(y <= 0):
        return None
    w = 1.0 / y  # sqrt of the 1/t² weights: scales each row so its residual is relative
    design = np.column_stack([np.ones_like(x), x])
    (alpha, slope), *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
    clamped = False
    if alpha < 0:
        slope = float((x * y * w**2).sum() / (x * x * w**2).sum())  # same weights, line through 0
        alpha, clamped = 0.0, True
    if slope <= 0:
        return None
    return Fit(
        alpha_us=float(alpha) * 1e6,
        beta_GBps=1.0 / float(slope) / 1e9,
        r2=r_squared(y, alpha + slope * x, w**2),
        n_points=len(x),
        alpha_clamped=clamped,
    )


def predict_seconds(fit: Fit, nbytes: float, bus_factor: float) -> float:
    return fit.alpha_us * 1e-6 + nbytes * bus_factor / (fit.beta_GBps * 1e9)
