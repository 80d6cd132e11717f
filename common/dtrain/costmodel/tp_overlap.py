"""TP's hidden share on tuned stacks: TransformerEngine's communication-GEMM overlap (userbuffers,
Megatron ``--tp-comm-overlap``, ``Stack.tp_overlap``) priced per GEMM by its mechanism.

With sequence parallelism every TP collective of a layer sits next to the GEMM it feeds or drains
(TE ``module/base.py`` ``initialize_ub``, its default methods):

  forward   qkv, fc1: all-gather of the input, "ring_exchange" under the GEMM (tp chunks)
            proj, fc2: reduce-scatter of the output, "pipeline" under the GEMM (4 chunks)
  backward  proj, fc2 dgrad: all-gather of the output gradient, "ring_exchange" under the dgrad
            qkv, fc1: reduce-scatter of the input gradient, "bulk" under the wgrad GEMM

A ring exchange computes on the rank's own chunk while the next arrives: the last of its tp GEMM
chunks has nothing left to hide, so (tp−1)/tp of the GEMM can hide the gather; a pipelined
reduce-scatter sends a chunk after its GEMM chunk: the last chunk's transfer is always exposed;
bulk runs the whole collective beside the whole GEMM. What the GEMM cannot cover is exposed.

The SM cost: ring exchanges run on the copy engines with one SM and leave the GEMM every SM
(``set_sm_margin`` off); pipelined and bulk overlaps hold ``UB_SMS`` (16) SMs and the GEMM runs on
the rest (``set_sm_margin`` on), so it slows by SMs/(SMs − 16). The copies themselves take HBM
(``collectives.overlap_cost`` with the copy engines' passes), paid on the hidden share.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "UB_SMS",
    "RS_PIPELINE_SPLITS",
    "TPOverlap",
    "gpu_sms",
    "ring_exposed",
    "pipeline_exposed",
    "bulk_exposed",
    "layer_overlap",
]

# TE module/base.py get_default_config: "num_sm": 1 if ring_exchange else 16, "num_splits": tp if
# ring_exchange else 4, "set_sm_margin": not ring_exchange, "use_ce": True
UB_SMS = 16
RS_PIPELINE_SPLITS = 4

# streaming multiprocessors per GPU (NVIDIA's architecture whitepapers: A100 108, H100 SXM5 132,
# H100 PCIe 114; H200 and H100 NVL the H100 SXM5 die, 132; B200 148); by hardware.yaml name prefix
_SMS = (("a100", 108), ("h100-pcie", 114), ("h100", 132), ("h200", 132), ("b200", 148))


def gpu_sms(gpu_name: str) -> int | None:
    """SMs of the GPU ``hardware.yaml`` calls ``gpu_name``; None for one not listed (the CPU)."""
    return next((n for prefix, n in _SMS if gpu_name.startswith(prefix)), None)


def ring_exposed(comm: float, gemm: float, chunks: int) -> float:
    """Exposed time of an all-gather ring-exchanged under a GEMM split in ``chunks``: the first
    chunk is the rank's own (computes at once), each later one arrives behind the GEMM on the one
    before, so (chunks−1)/chunks of the GEMM covers the transfer."""
    return max(0.0, comm - gemm * (chunks - 1) / chunks)


def pipeline_exposed(comm: float, gemm: float, chunks: int = RS_PIPELINE_SPLITS) -> float:
    """Exposed time of a reduce-scatter pipelined behind a GEMM in ``chunks``: chunk i's transfer
    runs under GEMM chunk i+1, the last transfer under nothing: (chunks−1)·max(0, c−g) + c, with c,
    g one chunk's transfer and GEMM."""
    return max(comm / chunks, comm - gemm * (chunks - 1) / chunks)


def bulk_exposed(comm: float, gemm: float) -> float:
    """Exposed time of a collective run whole beside a whole GEMM."""
    return max(0.0, comm - gemm)


@dataclass(frozen=True)
class TPOverlap:
    """Seconds of TP traffic, split: ``exposed`` (on the critical path), ``hidden`` (under GEMMs),
    ``sm_cost`` (what the GEMMs lose to the SMs the pipelined and bulk overlaps hold), ``copy_cost``
    (the HBM the hidden copies take). ``total``: what the step pays."""

    exposed: float = 0.0
    hidden: float = 0.0
    sm_cost: float = 0.0
    copy_cost: float = 0.0

    @property
    def total(self) -> float:
        return self.exposed + self.sm_cost + self.copy_cost

    def times(self, k: float) -> TPOverlap:
        return TPOverlap(self.exposed * k, self.hidden * k, self.sm_cost * k, self.copy_cost * k)

    def plus(self, o: TPOverlap) -> TPOverlap:
        return TPOverlap(
            self.exposed + o.exposed,
            self.hidden + o.hidden,
            self.sm_cost + o.sm_cost,
            self.copy_cost + o.copy_cost,
        )


def layer_overlap(
    gemms: dict[str, float],
    gather: float,
    scatter: float,
    tp: int,
    sms: int | None,
    copy_share: float,
    forwards: int = 1,
) -> TPOverlap:
    """One layer's TP traffic for one micro-batch under TE's default overlaps.

    ``gemms``: forward time of each linear ("qkv", "proj", "fc1", "fc2"; dgrad and wgrad each take
    as long); ``gather`` / ``scatter``: one all-gather / reduce-scatter of the layer's b·s·h
    activation over tp; ``sms``: the GPU's SMs (None: no SM cost); ``copy_share``: share of a hidden
    transfer's time its copies' HBM still costs; ``forwards``: 2 with full recompute (the forward's
    overlaps run again)."""
    margin = sms / (sms - UB_SMS) - 1 if sms else 0.0  # the GEMM's slow-down on SMs − 16
    parts = []  # (comm, exposed, GEMM time slowed by the SM margin)
    for _ in range(forwards):
        for name in ("qkv", "fc1"):  # all-gather of the input, ring exchange
            parts.append((gather, ring_exposed(gather, gemms[name], tp), 0.0))
        for name in ("proj", "fc2"):  # reduce-scatter of the output, pipelined, 16 SMs held
            g = gemms[name] * (1 + margin)
            parts.append((scatter, pipeline_exposed(scatter, g), gemms[name] * margin))
    for name in ("proj", "fc2"):  # dgrad: all-gather of the output gradient, ring exchange
        parts.append((gather, ring_exposed(gather, gemms[name], tp), 0.0))
    for name in ("qkv", "fc1"):  # the input gradient's reduce-scatter, bulk under the wgrad
        g = gemms[name] * (1 + margin)
        parts.append((scatter, bulk_exposed(scatter, g), gemms[name] * margin))
    exposed = sum(e for _, e, _ in parts)
    hidden = sum(c - e for c, e, _ in parts)
    return TPOverlap(exposed, hidden, sum(s for _, _, s in parts), hidden * copy_share)


def linear_shares(shape) -> dict[str, float]:
    """Each linear's share of a layer's GEMM FLOPs (``ModelShape``): qkv h·(q + 2·kv heads)·hd,
    proj q·hd·h, fc1 h·ffn (twice when gated), fc2 ffn·h."""
    hd = shape.d_model // shape.n_head
    flops = {
        "qkv": shape.d_model * (shape.n_head + 2 * shape.n_kv_head) * hd,
        "proj": shape.n_head * hd * shape.d_model,
        "fc1": shape.d_model * shape.ffn_hidden * (2 if shape.gated_mlp else 1),
        "fc2": shape.ffn_hidden * shape.d_model,
    }
    total = sum(flops.values())
    return {k: v / total for k, v in flops.items()}


def step_overlap(
    shape,
    lay,
    layers: int,
    gemm_s: float,
    gather: float,
    scatter: float,
    sms: int | None,
    copy_share: float,
) -> TPOverlap:
    """A step's TP traffic on the busiest stage under TE's overlaps: ``layers`` layers x
    ``lay.grad_accum`` micro-batches of ``layer_overlap``, the step's layer GEMM time ``gemm_s``
    (forward, dgrad and wgrad, a third each) split over the linears by their FLOPs."""
    per_fwd = gemm_s / (3 * layers * lay.grad_accum)
    gemms = {k: per_fwd * v for k, v in linear_shares(shape).items()}
    forwards = 2 if lay.recompute == "full" else 1
    one = layer_overlap(gemms, gather, scatter, lay.tp, sms, copy_share, forwards)
    return one.times(layers * lay.grad_accum)
