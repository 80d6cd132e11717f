"""α–β (Hockney) times of the collectives a step runs, ring algorithms as in NCCL.

β is the nccl-tests *bus* bandwidth (nccl-tests doc/PERFORMANCE.md), so an all-reduce moves 2(n−1)/n·B
over β; α is paid per ring hop. ``group_link`` picks the link a group of ranks runs over.
"""
from __future__ import annotations

from functools import lru_cache

from .hardware import Cluster, LinkModel


def allreduce_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring all-reduce: 2(n−1)/n · B/β + 2(n−1)·α (β = bus bandwidth, nccl-tests convention)."""
    if n <= 1:
        return 0.0
    link = link.of("all_reduce")
    return 2 * (n - 1) / n * nbytes / link.beta_Bps + 2 * (n - 1) * link.alpha_s


def _ring_half(nbytes: float, n: int, link: LinkModel) -> float:
    return (n - 1) / n * nbytes / link.beta_Bps + (n - 1) * link.alpha_s if n > 1 else 0.0


def all_gather_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring all-gather of a B-byte result: (n−1)/n · B/β + (n−1)·α (the link's all_gather α–β when
    measured apart, ``LinkModel.of``)."""
    return _ring_half(nbytes, n, link.of("all_gather"))


def reduce_scatter_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring reduce-scatter of a B-byte input: (n−1)/n · B/β + (n−1)·α (mirror of all-gather; its own
    α–β when measured apart)."""
    return _ring_half(nbytes, n, link.of("reduce_scatter"))


# HBM bytes an overlapped transfer moves per byte it receives. An NCCL ring on unregistered buffers (PyTorch's
# default; NCCL user guide, "User Buffer Registration": registration removes the "extra internal copy"): the peer
# writes the chunk into this GPU's internal buffer, the kernel reads it back and writes it out (the all-gather's
# output; the reduce-scatter's sum with the local chunk, sent on). A copy-engine copy (Transformer Engine's
# userbuffers, use_ce): the sender's read and the receiver's write.
RING_HBM_PASSES = 3
COPY_ENGINE_HBM_PASSES = 2


def overlap_cost(link: LinkModel, hbm_Bps: float | None, sm_share: float, passes: int = RING_HBM_PASSES) -> float:
    """Share of a transfer's time that still lengthens the step while it runs behind compute: the SMs its kernel
    holds (``sm_share``: NCCL runs one CTA per channel; 0 for copy engines) plus the HBM bandwidth its copies take
    from the kernels beside it, ``passes`` x β / HBM. An H100's NVLink ring (β 315 GB/s, HBM 3.35 TB/s) adds 0.28,
    one NIC's (35 GB/s) 0.03. ``hbm_Bps`` None: the SM share alone (a measured overlap holds the HBM part)."""
    hbm = passes * link.beta_Bps / hbm_Bps if hbm_Bps else 0.0
    return min(1.0, sm_share + hbm)


def p2p_time(nbytes: float, link: LinkModel) -> float:
    """One point-to-point send: B/β + α (the link's sendrecv α–β when measured apart)."""
    link = link.of("sendrecv")
    return nbytes / link.beta_Bps + link.alpha_s


@lru_cache(maxsize=1 << 12)  # a search asks for the same few groups' links tens of thousands of times
def group_link(cluster: Cluster, size: int, stride: int, multi_rail: bool = True) -> LinkModel:
    """The link a group of ``size`` ranks ``stride`` apart runs its collectives over.

    Inside one node: the intra-node link (NVLink). Across nodes the inter-node hop is the
    bottleneck. With ``multi_rail`` (DP, bandwidth-bound), NCCL runs one ring per NIC and each
    of the k group members in a node drives its own NIC, so β = min(β_NVLink, k·β_IB) with
    k = GPUs of the group per node; α is the IB latency for every hop (pessimistic: real rings
    mix NVLink and IB hops, and NCCL switches to trees for small messages). Without it (TP, on
    the critical path, sharing NICs with DP and PP traffic) the group gets one NIC: β = β_IB.
    """
    node = cluster.node_size
    if size * stride <= node:
        return cluster.nvlink
    k = max(1, min(size, node // stride)) if multi_rail else 1
    beta = min(cluster.nvlink.beta_Bps, k * cluster.ib.beta_Bps)
    return LinkModel(cluster.ib.alpha_s, beta, "IB" if k == 1 else f"IB x{k} rails")
