"""α–β (Hockney) times of the collectives a step runs, ring algorithms as in NCCL.

β is the nccl-tests *bus* bandwidth (nccl-tests doc/PERFORMANCE.md), so an all-reduce moves
2(n−1)/n·B over β; α is paid per ring hop (all-to-all: per peer). ``group_link`` picks the link a
group of ranks runs over.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def all_to_all_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Even all-to-all of a rank's B-byte send buffer: a chunk of B/n to each of the n−1 peers,
    (n−1)·(B/n/β + α) = (n−1)/n · B/β + (n−1)·α. β is its bus bandwidth as nccl-tests reports it
    (busbw = algbw · (n−1)/n, algbw = B / t): the link's all_to_all α–β when allreduce-bench fitted
    one (``LinkModel.of``), else the all-reduce's."""
    if n <= 1:
        return 0.0
    link = link.of("all_to_all")
    return (n - 1) * (nbytes / n / link.beta_Bps + link.alpha_s)


def all_to_all_uneven_time(sends: Sequence[Sequence[float]], link: LinkModel) -> float:
    """All-to-all with uneven splits: ``sends[i][j]`` bytes go from rank i to rank j (the diagonal
    stays on the rank). Every rank sends and receives at once, so the busiest rank sets the time:
    max over ranks of max(bytes it sends, bytes it receives) / β + (n−1)·α, the α–β of the
    link's uneven all-to-all (``all_to_all_v``) where allreduce-bench fitted one, else its
    all_to_all's as in ``all_to_all_time`` (which this then equals for even splits)."""
    n = len(sends)
    if any(len(row) != n for row in sends) or any(b < 0 for row in sends for b in row):
        raise ValueError(f"all_to_all sends must be a square matrix of bytes >= 0, got {sends}")
    if n <= 1:
        return 0.0
    out = [sum(row) - row[i] for i, row in enumerate(sends)]
    into = [sum(sends[i][j] for i in range(n)) - sends[j][j] for j in range(n)]
    uneven = any(name == "all_to_all_v" for name, _, _ in link.collectives)
    link = link.of("all_to_all_v" if uneven else "all_to_all")
    return max(max(out), max(into)) / link.beta_Bps + (n - 1) * link.alpha_s


# HBM bytes an overlapped transfer moves per byte it receives. An NCCL ring on unregistered buffers
# (PyTorch's default; NCCL user guide, "User Buffer Registration": registration removes the "extra
# internal copy"): the peer writes the chunk into this GPU's internal buffer, the kernel reads it
# back and writes it out (the all-gather's output; the reduce-scatter's sum with the local chunk,
# sent on). A copy-engine copy (Transformer Engine's userbuffers, use_ce): the sender's read and the
# receiver's write.
RING_HBM_PASSES = 3
COPY_ENGINE_HBM_PASSES = 2


def overlap_cost(
    link: LinkModel, hbm_Bps: float | None, sm_share: float, passes: int = RING_HBM_PASSES
) -> float:
    """Share of a transfer's time that still lengthens the step while it runs behind compute: the
    SMs its kernel holds (``sm_share``: NCCL runs one CTA per channel; 0 for copy engines) plus
    the HBM bandwidth its copies take from the kernels beside it, ``passes`` x β / HBM. An H100's
    NVLink ring (β 315 GB/s, HBM 3.35 TB/s) adds 0.28, one NIC's (35 GB/s) 0.03. ``hbm_Bps``
    None: the SM share alone (a measured overlap holds the HBM part)."""
    hbm = passes * link.beta_Bps / hbm_Bps if hbm_Bps else 0.0
    return min(1.0, sm_share + hbm)


def p2p_time(nbytes: float, link: LinkModel) -> float:
    """One point-to-point send: B/β + α (the link's sendrecv α–β when measured apart)."""
    link = link.of("sendrecv")
    return nbytes / link.beta_Bps + link.alpha_s


@lru_cache(
    maxsize=1 << 12
)  # a search asks for the same few groups' links tens of thousands of times
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
