"""The attention core's time for one layer and micro-batch on one rank (``attention_s``): fused
(flash) attention's FLOPs at its benchmark's rate, or eager attention as batched GEMMs plus the
softmax (and dropout) passes over the stored scores; and the heads a TP rank holds."""

from __future__ import annotations

from .device_rates import Device
from .efficiency import Gemm
from .shapes import Layout, ModelShape


def local_heads(shape: ModelShape, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one TP rank; KV heads are replicated when tp > n_kv_head."""
    return max(1, shape.n_head // tp), max(1, shape.n_kv_head // tp)


def attention_s(
    shape: ModelShape, layout: Layout, dev: Device, forward_only: bool = False
) -> float:
    """The attention core of one layer and micro-batch on one rank (forward+backward, or its forward
    alone).

    With context parallelism each rank does 1/cp of the causal work: the ring's (and PyTorch's)
    load-balanced chunks in kernel calls over s/cp queries and keys (the benchmark's rate at
    s/cp), the all-to-all's full sequence for heads/cp of the heads (the rate at s)."""
    s, b, cp = shape.seq_len, layout.micro_batch, layout.cp
    hd = shape.d_model // shape.n_head
    heads, _ = local_heads(shape, layout.tp)
    if dev.kernels.attention is not None:  # fused kernel: FLOPs executed over the benchmark's rate
        fwd = (
            2 * 2 * b * heads * s * s * hd / 2 / cp
        )  # causal: half of the s x s products; 1/cp per rank
        work = fwd if forward_only else 3.5 * fwd
        call = s if layout.cp_impl == "ulysses" else s // cp
        curve = dev.kernels.attention
        return (
            work
            / (dev.peak_bf16 * curve.share(call, hd))
            * dev.power_scale
            * (curve.dropout if shape.dropout else 1.0)
        )
    sq = s // cp  # eager: the rank's queries against every key, scores stored
    qk, av = Gemm(sq, s, hd, b * heads, "scores"), Gemm(sq, hd, s, b * heads, "av")
    t = (dev.gemm_s(qk) + dev.gemm_s(av)) * (1 if forward_only else 3)
    elems = (
        b * heads * sq * s
    )  # the stored scores: QKᵀ written, softmax forward (r+w) and backward (r, r, w)
    t += dev.mem_s(elems * (6 if forward_only else 12), "softmax") if dev.kernels.memory else 0.0
    if (
        shape.dropout and dev.kernels.memory
    ):  # dropout on the probabilities: r+w+mask forward, again backward
        t += dev.mem_s(elems * (5 if forward_only else 10), "dropout")
    return t
