"""The routed experts' communication in the cost model (issue 41): the EP all-to-all of one MoE
layer and micro-batch (``ep_comm``: dispatch + combine, forward and backward, after the token
counts' exchange, the busiest rank receiving ρ x the even share, over the EP group's real link;
the alltoall, allgather and DeepEP dispatchers) and one step's data-parallel traffic of a rank's
weights (``_dp_time``: the experts' over the expert-data-parallel group). Bytes:
``dtrain.parallel.traffic``; times: ``collectives``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from dtrain.parallel import traffic as volume

from .collectives import (
    all_gather_time,
    all_to_all_time,
    all_to_all_uneven_time,
    allreduce_time,
    group_link,
    reduce_scatter_time,
)
from .hardware import LINK_EFFICIENCY, Cluster, LinkModel
from .moe_layout import rank_tokens
from .moe_model import MoEModel
from .shapes import Layout

# DeepEP's normal (training) kernels on H800 with CX7 400 Gbit/s NICs, DeepSeek-V3's setting
# (DeepEP README, V1 performance table, docs/legacy.md): internode EP 16 / 32 / 64 dispatch
# 43 / 58 / 51 GB/s and combine 43 / 57 / 50 GB/s RDMA bottleneck bandwidth, counted on the
# tokens sent once per target node: a median 50.5 GB/s, the 50 GB/s line rate; intranode EP 8
# 153 / 158 GB/s over NVLink of "~160 GB/s": 0.97. Where NCCL's rings reach LINK_EFFICIENCY of a
# link (the links' calibration), DeepEP's kernels are priced at these shares.
DEEPEP_RDMA_SHARE = 50.5 / 50
DEEPEP_NVLINK_SHARE = 155.5 / 160


def _a2a(nbytes: float, ep: int, rho: float, link: LinkModel) -> float:
    """One uneven all-to-all of a rank's ``nbytes`` input over ``ep`` ranks: every rank sends
    nbytes/ep to each peer, one rank receives ρ x that from each (``all_to_all_uneven_time``)."""
    if ep <= 1:
        return 0.0
    even = nbytes / ep
    sends = [[even * (rho if j == 0 and i != 0 else 1.0) for j in range(ep)] for i in range(ep)]
    return all_to_all_uneven_time(sends, link)


@dataclass(frozen=True)
class EpComm:
    """One MoE layer's dispatch + combine, forward + backward, for one micro-batch."""

    seconds: float
    wire_bytes: float  # per rank, the traffic module's count (or the dispatcher's own)
    link: str


def ep_link(cluster: Cluster, lay: Layout) -> tuple[LinkModel, int]:
    """(link, EP ranks per node): an EP group of ep ranks (etp apart: EP folds from the innermost
    ranks) inside a node runs over NVLink; across nodes each rank's share that leaves the node
    goes over its own NIC (``group_link`` without multi-rail: one NIC per rank)."""
    stride = lay.etp
    per_node = max(1, min(lay.ep, cluster.node_size // stride))
    if lay.ep * stride <= cluster.node_size:
        return cluster.nvlink, lay.ep
    return group_link(cluster, lay.ep, stride, multi_rail=False), per_node


@lru_cache(maxsize=1 << 14)
def ep_comm(
    model: MoEModel, lay: Layout, cluster: Cluster, dispatch_bytes: float, combine_bytes: float
) -> EpComm:
    """Dispatch and combine of one MoE layer and micro-batch on the busiest rank (``moe_cost``'s
    module docstring). Across nodes, the share of an all-to-all that leaves the node ((ep − g)/ep
    of the bytes, g ranks per node) runs over the NIC while the rest crosses NVLink: the slower
    sets the time. DeepEP sends each token's row once per target node (``traffic.ep_nodes_reached``)
    instead of once per expert there, then forwards it over NVLink."""
    m, d, ep, rho = model.moe, model.base.d_model, lay.ep, model.moe.imbalance
    if ep <= 1:
        return EpComm(0.0, 0.0, "none")
    t = rank_tokens(model, lay)
    link, g = ep_link(cluster, lay)
    nvlink = cluster.nvlink
    if m.dispatcher == "deepep":  # its measured shares of the links (DEEPEP_*_SHARE)
        link = replace(link, beta_Bps=link.beta_Bps * DEEPEP_RDMA_SHARE / LINK_EFFICIENCY)
        nvlink = replace(nvlink, beta_Bps=nvlink.beta_Bps * DEEPEP_NVLINK_SHARE / LINK_EFFICIENCY)
        if g == ep:
            link = nvlink
    wire = volume.ep_layer_bytes(t, m.top_k, d, ep, dispatch_bytes, combine_bytes)
    if m.dispatcher == "allgather":  # every rank gathers the group's tokens, reduce-scatters back
        gathered = t * ep * d
        s = 2 * (
            all_gather_time(gathered * dispatch_bytes, ep, link)
            + reduce_scatter_time(gathered * combine_bytes * rho, ep, link)
        )
        return EpComm(s, 2 * (dispatch_bytes + combine_bytes) * t * d * (ep - 1), link.name)
    passes = (dispatch_bytes, combine_bytes, combine_bytes, dispatch_bytes)
    # before the dispatch each rank tells every other how many rows it sends each expert (one
    # small even all-to-all, forward: latency-bound, Megatron's and DeepEP's too)
    counts = all_to_all_time(volume.ep_counts_bytes(m.experts), ep, link)
    if g == ep:  # one node: NVLink
        s = sum(_a2a(volume.ep_dispatch_bytes(t, m.top_k, d, b), ep, rho, link) for b in passes)
        return EpComm(s + counts, wire, link.name)
    nodes = ep // g
    cross = (ep - g) / ep
    copies = m.top_k
    if m.dispatcher == "deepep":  # once per target node over the NIC
        copies = volume.ep_nodes_reached(m.top_k, nodes) * (nodes - 1) / nodes / cross
        wire = 2 * (dispatch_bytes + combine_bytes) * t * d * copies * cross
    s = 0.0
    for b in passes:
        ib = t * copies * d * b * cross * rho / link.beta_Bps + (nodes - 1) * link.alpha_s
        nv = t * m.top_k * d * b * (g - 1) / ep * rho / nvlink.beta_Bps
        s += max(ib, nv + (g - 1) * nvlink.alpha_s)
    return EpComm(s + counts, wire, f"{link.name} ({g} per node)")


def _dp_time(
    psi: float, n: int, zero: int, m: int, pp: int, link: LinkModel, vb: int, gb: int
) -> float:
    """One step's DP traffic of a rank's ``psi`` parameters over ``n`` ranks, as
    ``comm_time.dp_comm_time`` counts it: ZeRO-0 an all-reduce of the gradients; 1 (and 3 under
    PP) a reduce-scatter and an all-gather of the weights; 2 a reduce-scatter per micro-batch;
    3 per micro-batch two gathers and a reduce-scatter."""
    if n <= 1 or psi <= 0:
        return 0.0
    grads, weights = volume.dp_grad_bytes(psi, gb), volume.zero_gather_bytes(psi, vb)
    if zero == 0:
        return allreduce_time(grads, n, link)
    if zero == 1 or (zero == 3 and pp > 1):
        return reduce_scatter_time(grads, n, link) + all_gather_time(weights, n, link)
    if zero == 2:
        return m * reduce_scatter_time(grads, n, link) + all_gather_time(weights, n, link)
    return m * (2 * all_gather_time(weights, n, link) + reduce_scatter_time(grads, n, link))
