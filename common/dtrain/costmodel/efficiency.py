"""Compute time from the work: a roofline per GEMM times an achieved-fraction curve.

Each GEMM of a layer (m×k by k×n, 2·m·n·k FLOPs, 2-byte operands) is bounded by the roofline
(Williams et al. 2009, CACM "Roofline"): time ≥ max(FLOPs / peak, bytes / HBM bandwidth),
arithmetic intensity = FLOPs / bytes against the ridge point peak / bandwidth. Real kernels
reach a fraction of that bound that grows with the GEMM's size (tile quantisation, wave
quantisation, launch latency): the achieved fraction is modelled as

    f(W) = e_max · W / (W + W_half),   W = 2·m·n·k

``e_max`` (``Calibration.mfu``) and ``W_half`` (``Calibration.gemm_half_flops``) are fitted by
``fit_curve`` to a matmul probe over the model's own GEMM shapes (``gemm_probe``: CPU here,
CUDA on a GPU). So a smaller micro-batch or a wider TP shard (smaller GEMMs) computes at a lower
rate, as on real GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .shapes import Layout, ModelShape

__all__ = [
    "Gemm",
    "GemmCurve",
    "layer_gemms",
    "op_recompute_gemms",
    "head_gemm",
    "gemm_time",
    "fit_curve",
]


@dataclass(frozen=True)
class Gemm:
    """``count`` independent m×k·k×n products (a batched GEMM for attention)."""

    m: int
    n: int
    k: int
    count: int = 1
    name: str = ""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmCurve:
    e_max: float
    w_half: float

    def fraction(self, flops: float) -> float:
        return self.e_max * flops / (flops + self.w_half)


def gemm_time(
    g: Gemm, peak_flops: float, hbm_Bps: float, curve: GemmCurve, value_bytes: int = 2
) -> float:
    """Seconds for ``g``: roofline bound max(W/peak, bytes/HBM) over the achieved fraction f(W),
    W the whole (batched) GEMM's FLOPs: one strided-batched kernel fills the GPU with all
    ``count`` products at once, so a per-head attention product is not priced as a lone small
    GEMM."""
    bound = g.flops / peak_flops
    if hbm_Bps > 0:
        bound = max(bound, value_bytes * (g.m * g.k + g.k * g.n + g.m * g.n) / hbm_Bps)
    return g.count * bound / curve.fraction(g.flops * g.count)


def layer_gemms(shape: ModelShape, layout: Layout) -> list[Gemm]:
    """Forward GEMMs of one transformer layer for one micro-batch on one TP rank (Megatron
    column/row-parallel split: QKV and fc1 split their outputs, proj and fc2 their inputs);
    attention core as batched s×s×hd products (QKᵀ, then AV) over the local heads. With tp >
    n_kv_head each rank computes one whole K and V head (replicated)."""
    t, s, h = layout.tp, shape.seq_len, shape.d_model
    tokens = layout.micro_batch * s
    hd = h // shape.n_head
    kv_local = max(shape.n_kv_head // t, 1) * hd
    f = shape.ffn_hidden
    heads = max(1, shape.n_head // t)
    return [
        Gemm(tokens, max(1, h // t + 2 * kv_local), h, 1, "qkv"),
        Gemm(tokens, h, max(1, h // t), 1, "proj"),
        Gemm(tokens, max(1, (2 if shape.gated_mlp else 1) * f // t), h, 1, "fc1"),
        Gemm(tokens, h, max(1, f // t), 1, "fc2"),
        Gemm(s, s, hd, layout.micro_batch * heads, "scores"),
        Gemm(s, hd, s, layout.micro_batch * heads, "av"),
    ]


def op_recompute_gemms(shape: ModelShape, layout: Layout) -> list[Gemm]:
    """The forward GEMMs torchtitan's selective op AC re-runs in backward (every even-numbered
    matmul of a block: wk, wo, and w3 of a gated MLP or w2 of a GELU one; see
    ``activations.op_checkpoint_bytes``)."""
    t, s, h = layout.tp, shape.seq_len, shape.d_model
    tokens = layout.micro_batch * s
    kv = shape.n_kv_head * (h // shape.n_head)
    f = shape.ffn_hidden
    third = (
        Gemm(tokens, max(1, f // t), h, 1, "w3")
        if shape.gated_mlp
        else Gemm(tokens, h, max(1, f // t), 1, "fc2")
    )
    return [
        Gemm(tokens, max(1, kv // t), h, 1, "k"),
        Gemm(tokens, h, max(1, h // t), 1, "proj"),
        third,
    ]


def head_gemm(shape: ModelShape, layout: Layout) -> Gemm:
    """The output projection (vocab-parallel over TP) for one micro-batch."""
    return Gemm(
        layout.micro_batch * shape.seq_len,
        max(1, shape.vocab // layout.tp),
        shape.d_model,
        1,
        "lm_head",
    )


def fit_curve(points: list[tuple[float, float]]) -> GemmCurve:
    """Least-squares fit of f(W) = e_max·W/(W + W_half) to (W, achieved fraction) points.

    Linearised as 1/f = 1/e_max + (W_half/e_max)·(1/W) (a Lineweaver–Burk fit), weighted by f²
    so the large GEMMs that dominate the time are not swamped by the smallest ones."""
    pts = [(1.0 / w, 1.0 / f, f * f) for w, f in points if w > 0 and f > 0]
    if len(pts) < 2:
        raise ValueError("fit_curve needs at least two probe points")
    sw = sum(p[2] for p in pts)
    mx = sum(p[2] * p[0] for p in pts) / sw
    my = sum(p[2] * p[1] for p in pts) / sw
    sxx = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
    slope = sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else 0.0
    slope = max(slope, 0.0)
    intercept = my - slope * mx
    if intercept <= 0 or not math.isfinite(intercept):
        intercept = min(p[1] for p in pts)
    e_max = 1.0 / intercept
    return GemmCurve(e_max, slope * e_max)
