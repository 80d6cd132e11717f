"""Quantization statistics of the FP8 debug tool, as pure functions over tensors.

`per_tensor_stats` is the plain reference for one tensor and one scale; `batch_roundtrip`,
`count_above` and friends compute the same numbers for many tensors x recipes in one pass (the
debug tool batches them at step end to keep its cost under 5% of a step). Reductions that feed
MSE and cosine are float64; counts are exact.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fp8_train import fp4
from fp8_train.formats import E4M3, E5M2, Format, quantize

F64 = torch.float64
BLOCK = 1024  # |x| is kept in blocks of this many, with each block's max (overflow counts)


def fmt_for(tensor: str, e5m2_saturates: bool = True) -> Format:
    if tensor == "gradient":
        return replace(E5M2, saturate=True) if e5m2_saturates else E5M2
    return E4M3


def stats_from_sums(
    underflow, n_nonzero, overflow, err, power, dpower, n: int, n_overflow: int
) -> dict:
    """A record's numbers from one round trip's float64 sums (n elements; overflow over n_overflow).
    Cosine from three norms: (|x|^2 + |d|^2 - |x-d|^2) / 2|x||d|."""
    n = max(1, n)
    denom = 2 * math.sqrt(power * dpower)
    cos = (power + dpower - err) / denom if denom > 0 else (1.0 if err == 0 else 0.0)
    return {
        "underflows_pct": 100.0 * underflow / max(1.0, n_nonzero),
        "overflows_pct": 100.0 * overflow / max(1, n_overflow),
        "mse": err / n,
        "rel_mse": err / power if power > 0 else 0.0,
        "cos_sim": cos,
    }


def roundtrip_stats(x: torch.Tensor, deq: torch.Tensor, scaled: torch.Tensor, fmt: Format) -> dict:
    """Quantization error of one round trip (block recipes); reductions in float64, one sync."""
    x, deq = x.detach().reshape(-1).float(), deq.detach().reshape(-1).float()
    nonzero = x != 0
    sums = torch.stack(
        [
            (nonzero & (deq == 0)).sum(dtype=F64),
            nonzero.sum(dtype=F64),
            (scaled.detach().abs() > fmt.max).sum(dtype=F64),
            torch.linalg.vector_norm(x - deq, dtype=F64) ** 2,
            torch.linalg.vector_norm(x, dtype=F64) ** 2,
            torch.linalg.vector_norm(deq, dtype=F64) ** 2,
        ]
    )
    underflow, n_nonzero, overflow, err, power, dpower = sums.tolist()
    return stats_from_sums(underflow, n_nonzero, overflow, err, power, dpower, x.numel(), x.numel())


_TABLES: dict = {}  # (FP8 dtype, device) -> the float32 value of each of its 256 codes


def roundtrip(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """formats.quantize(x, scale, fmt) in float32; FP8 codes decoded by a 256-entry table (the same
    values as .float(), a ~6x slower scalar loop on CPU)."""
    if fmt.dtype is None:
        return quantize(x, scale, fmt)
    y = x * scale
    if fmt.saturate:
        y.clamp_(-fmt.max, fmt.max)
    key = (fmt.dtype, y.device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8, device=y.device).view(fmt.dtype).float()
    torch.index_select(
        _TABLES[key], 0, y.to(fmt.dtype).view(torch.uint8).reshape(-1).int(), out=y.view(-1)
    )
    return y.div_(scale)


def count(ones: torch.Tensor) -> torch.Tensor:
    """Sum of 0/1 values over the last dim: float32 (exact to 2**24, ~15x faster here), else
    float64."""
    return ones.sum(-1, dtype=torch.float32 if ones.shape[-1] <= 2**24 else F64)


def count_nonzero(t: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """(t != 0).sum(-1) with NaN non-zero (sign(NaN) is 0), without a bool tensor (comparisons into
    bool are ~10x slower than arithmetic here). inplace: t is overwritten."""
    return count((t.nan_to_num_(nan=1.0) if inplace else t.nan_to_num(nan=1.0)).sign_().abs_())


def count_above(
    blocks: torch.Tensor, block_amax: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """(|x| > threshold).sum(), looking only at blocks whose max is not <= threshold (usually one
    or none). a > b gives a - b > 0 (gradual underflow); NaN - b, inf - inf are NaN: not counted,
    as NaN > b and inf > inf are false; inf - b becomes the largest float: counted."""
    t = blocks[~(block_amax <= threshold)].reshape(-1)
    return count((t - threshold).nan_to_num_(nan=0.0).clamp_(min=0).sign_())


def batch_roundtrip(x: torch.Tensor, scales: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Many scaled round trips in one pass: row x[i] ((T, L) float32) cast with each scales[i, r]
    ((T, R)). Returns (T, 2 + 3R) float64 sums per row: [non-zeros, |x|^2, underflows (R),
    |x - deq|^2 (R), |deq|^2 (R)]; underflows = non-zeros(x) - non-zeros(deq), as x == 0 gives
    deq == 0. x - deq is exact (float32 or float64); norms in float64."""
    deq = roundtrip(x[:, None, :], scales[:, :, None], fmt)  # (T, R, L)
    x64, deq64 = x.to(F64), deq.to(F64)
    nonzero = count_nonzero(x)
    underflow = nonzero[:, None] - count_nonzero(deq, inplace=True)
    norm2 = lambda t: torch.linalg.vector_norm(t, dim=-1) ** 2  # noqa: E731
    dpower = norm2(deq64)
    err = norm2(deq64.sub_(x64[:, None, :]))
    return torch.cat(
        [nonzero[:, None].to(F64), norm2(x64)[:, None], underflow.to(F64), err, dpower], 1
    )


def overflow_thresholds(scales: torch.Tensor, fmt: Format) -> torch.Tensor:
    """|x| > max / scale (float64 division, compared in float32, as `x > python_float` does)."""
    return (fmt.max / scales.to(F64)).float()


def per_tensor_stats(
    x: torch.Tensor, scale, fmt: Format, sample: torch.Tensor | None = None
) -> dict:
    """Stats of the scaled round trip. With `sample` (flat indices), underflow, mse and cosine are
    estimated on those elements; the overflow count is always exact over the whole tensor."""
    xf = x.detach().reshape(-1).float()
    part = xf if sample is None else xf[sample]
    s = torch.as_tensor(scale, dtype=torch.float32, device=xf.device).reshape(1, 1)
    n_nonzero, power, underflow, err, dpower = batch_roundtrip(part[None], s, fmt)[0].tolist()
    overflow = float((xf.abs() > overflow_thresholds(s, fmt)[0, 0]).sum())
    return {
        "scale": float(s),
        **stats_from_sums(
            underflow, n_nonzero, overflow, err, power, dpower, part.numel(), xf.numel()
        ),
    }


def block_stats(x: torch.Tensor, recipe: str) -> dict:
    q = fp4.block_quantize(x.detach().float(), recipe)
    return {"scale": None, **roundtrip_stats(x, q.dequantized, q.scaled, q.fmt)}
