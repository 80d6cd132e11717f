"""Low-precision number formats and the fake-quant round trip every FP8 path here is built on.

    E4M3  max 448,   no Inf: values past the max SATURATE to +-448 (forward tensors)
    E5M2  max 57344, has Inf: values past the max OVERFLOW to +-Inf (gradients)
    E2M1  max 6, the FP4 element format (see fp4.py for its block scaling)

`quantize(x, scale, fmt)` returns the high-precision value that an FP8 kernel would see:
cast(x * scale) / scale. The FP8 casts are torch's own float8 dtypes, which work on CPU, so
emulation rounds exactly like the hardware (round to nearest even).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    max: float  # largest finite magnitude
    min_subnormal: float  # smallest non-zero magnitude
    dtype: torch.dtype | None  # torch storage dtype; None = emulated by a value grid (FP4)
    saturate: bool  # clamp to +-max before the cast (else values past max become Inf)


E4M3 = Format("e4m3", 448.0, 2.0**-9, torch.float8_e4m3fn, saturate=True)
E5M2 = Format("e5m2", 57344.0, 2.0**-16, torch.float8_e5m2, saturate=False)
E2M1 = Format("e2m1", 6.0, 0.5, None, saturate=True)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}

# E2M1 magnitudes and the rounding boundaries between them. A value exactly on a boundary goes to
# the neighbour with the even mantissa (round half to even), which is the upper one at these:
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDS = (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def cast(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round already-scaled values onto the format's grid; result in x's dtype."""
    if fmt.saturate:
        x = x.clamp(-fmt.max, fmt.max)  # NaN stays NaN
    if fmt.dtype is not None:
        return x.to(fmt.dtype).to(x.dtype)
    return _cast_e2m1(x)


def _cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    a = x.abs().float()
    mids, tie_up = _E2M1_MIDS.to(a.device), _E2M1_TIE_UP.to(a.device)
    idx = torch.bucketize(a, mids)  # ties land in the lower bucket
    on_tie = (idx < len(mids)) & (a == mids[idx.clamp(max=len(mids) - 1)])
    idx = idx + (on_tie & tie_up[idx.clamp(max=len(mids) - 1)]).long()
    out = _E2M1_GRID.to(a.device)[idx] * x.sign()
    out = torch.where(torch.isnan(x), x, out)
    return out.to(x.dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Format) -> torch.Tensor:
    """FP8 round trip: cast(x * scale) / scale, in x's dtype."""
    return cast(x * scale, fmt) / scale
