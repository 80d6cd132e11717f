"""Mixture-of-experts in the cost model: the shape, its parameters and FLOPs, and the terms a
routed-expert layer adds to a dense step (issue 41).

An MoE model is priced as its *dense proxy* plus the routed experts' own terms:

  proxy      ``MoEModel.proxy``: the same transformer with every layer's FFN the width a token
             meets (dense layers: their FFN; MoE layers: top_k·expert_ffn + the shared experts'),
             averaged over the layers (FLOPs are linear in the width, so the proxy's GEMM work and
             its memory-bound passes are the active model's). Everything dense prices it: attention,
             TP, CP, PP, the bubble, DP traffic of the non-expert weights.
  expert_gemm  the routed experts' GEMMs as grouped GEMMs: per local expert M = T·k·ρ/(E/ep)
             rows (T tokens per rank, k = top_k, ρ the imbalance), at the GEMM curve's rate for
             that size (it falls with M: why wide EP beats expert TP, and why FSDP with EP = 1 can
             beat EP on one node), minus what the proxy priced for the same FLOPs as one dense
             GEMM; plus the router's d x E GEMM (not model FLOPs) and the attention the proxy's
             d/H head dim misses (``--head-dim``, MLA)
  all_to_all dispatch + combine per MoE layer and micro-batch (``dtrain.parallel.traffic``:
             2·(b_dispatch + b_combine)·T·k·h·(ep−1)/ep per rank), four all-to-alls (forward and
             backward), the busiest rank receiving ρ x the even share
             (``collectives.all_to_all_uneven_time``), over the EP group's real link: NVLink
             when the group fits a node, else each rank's NIC for the share that leaves the
             node. DeepEP sends a token once per target node (``traffic.ep_nodes_reached``), the
             allgather dispatcher gathers every token of the group. Hidden with A2A overlap
             (DeepSeek-V3's DualPipe, Megatron's EP overlap) behind the step's compute, at the SM
             share its kernels hold (DeepSeek-V3 report §3.2.2: 20 of the H800's 132 SMs)
  expert_dp  the experts' gradient / weight traffic over the expert-data-parallel group
             (``Layout.expert_dp``) instead of the proxy's routed weights over dp·cp, exposed
             in the proxy's own exposed share
  memory     expert weights, gradients and Adam states: E/ep experts per rank (/etp), sharded by
             the ZeRO stage over ``expert_dp`` (Megatron's estimator: expert optimizer state over
             the expert-data-parallel group; FSDP2 + EP: over efsdp), replacing the proxy's
             routed weights; the permuted tokens (k copies) and ρ's extra rows as activations.

ρ (``MoESpec.imbalance``, 1.0 = balanced as vendor benchmarks force it) scales the busiest rank's
expert compute, the bytes it receives and its expert activations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from dtrain.model.flops import MLA, attention_matmul_params, moe_flops_per_token
from dtrain.parallel import traffic as volume

from .collectives import (
    all_gather_time,
    all_to_all_uneven_time,
    allreduce_time,
    group_link,
    reduce_scatter_time,
)
from .compute import Device, optimizer_s
from .efficiency import Gemm
from .hardware import LINK_EFFICIENCY, Cluster, LinkModel
from .hashing import cached_hash
from .memory import MemoryBreakdown, held_layer_microbatches, model_state_bytes
from .shapes import Layout, ModelShape, stage_layers

DISPATCHERS = ("alltoall", "allgather", "deepep")
# DeepSeek-V3 technical report §3.2.2: "only 20 SMs" of the H800's 132 run its all-to-all kernels
A2A_SM_SHARE = 20 / 132
# DeepEP's normal (training) kernels on H800 with CX7 400 Gbit/s NICs, DeepSeek-V3's setting
# (DeepEP README, V1 performance table, docs/legacy.md): internode EP 16 / 32 / 64 dispatch
# 43 / 58 / 51 GB/s and combine 43 / 57 / 50 GB/s RDMA bottleneck bandwidth, counted on the
# tokens sent once per target node: a median 50.5 GB/s, the 50 GB/s line rate; intranode EP 8
# 153 / 158 GB/s over NVLink of "~160 GB/s": 0.97. Where NCCL's rings reach LINK_EFFICIENCY of a
# link (the links' calibration), DeepEP's kernels are priced at these shares.
DEEPEP_RDMA_SHARE = 50.5 / 50
DEEPEP_NVLINK_SHARE = 155.5 / 160
# rows a grouped GEMM pads each expert's slice to (DeepGEMM README, contiguous layout: the M axis
# of each expert aligned to the GEMM M block, 128)
GROUP_ALIGN = 128


@dataclass(frozen=True)
class MoESpec:
    """The routed feed-forward: ``experts`` of width ``expert_ffn`` (SwiGLU), ``top_k`` per token,
    ``shared_experts`` always on (each ``shared_ffn`` wide; 0: ``expert_ffn``), the first
    ``dense_layers`` dense. ``imbalance`` ρ: the busiest rank's tokens over the balanced count
    (Megatron's overload factor). ``dispatcher``: alltoall, allgather or deepep;
    ``a2a_overlap``: dispatch/combine hidden behind other micro-batches' compute."""

    __hash__ = cached_hash

    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    imbalance: float = 1.0
    dispatcher: str = "alltoall"
    a2a_overlap: bool = False

    def __post_init__(self) -> None:
        if min(self.experts, self.top_k, self.expert_ffn) < 1:
            raise ValueError("experts, top_k and expert_ffn must be >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if min(self.shared_experts, self.shared_ffn, self.dense_layers) < 0:
            raise ValueError("shared_experts, shared_ffn and dense_layers must be >= 0")
        if not self.imbalance >= 1.0:
            raise ValueError(f"imbalance must be >= 1.0 (1.0 = balanced), got {self.imbalance}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")

    @property
    def shared_total(self) -> int:
        """The shared experts' total FFN width (Megatron's moe_shared_expert_intermediate_size)."""
        return self.shared_experts * (self.shared_ffn or self.expert_ffn)


@dataclass(frozen=True)
class MoEModel:
    """An MoE decoder: ``base`` holds the attention, the vocabulary, the layers and the dense
    layers' FFN (``base.ffn_hidden``, SwiGLU); ``head_dim`` when heads x head dim is not d_model
    (Qwen3, GPT-OSS); ``mla`` DeepSeek's latent attention."""

    __hash__ = cached_hash

    base: ModelShape
    moe: MoESpec
    head_dim: int = 0
    mla: MLA | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.moe.dense_layers >= self.base.n_layer:
            raise ValueError(
                f"dense_layers={self.moe.dense_layers} leaves no MoE layer of {self.base.n_layer}"
            )

    @property
    def moe_layers(self) -> int:
        return self.base.n_layer - self.moe.dense_layers

    @property
    def hd(self) -> int:
        return self.head_dim or self.base.d_model // self.base.n_head

    @cached_property
    def proxy(self) -> ModelShape:
        """The dense model a token meets: FFN width averaged over the layers (see the module
        docstring)."""
        b, m = self.base, self.moe
        active = m.dense_layers * b.ffn_hidden + self.moe_layers * (
            m.top_k * m.expert_ffn + m.shared_total
        )
        return replace(b, ffn_mult=active / b.n_layer / b.d_model, gated_mlp=True)

    def attention_params(self) -> int:
        b = self.base
        return attention_matmul_params(b.d_model, b.n_head, b.n_kv_head, self.hd, self.mla)

    def attention_extra_params(self) -> int:
        """Per layer, attention weights the proxy (d/H head dim, no MLA) does not count."""
        b = self.base
        return self.attention_params() - attention_matmul_params(b.d_model, b.n_head, b.n_kv_head)

    def expert_params(self) -> int:
        """One MoE layer's routed experts: E x 3·d·F."""
        return self.moe.experts * 3 * self.base.d_model * self.moe.expert_ffn

    def routed_active_params(self) -> int:
        """One MoE layer's routed weights a token meets (what the proxy holds for them)."""
        return self.moe.top_k * 3 * self.base.d_model * self.moe.expert_ffn

    def num_params(self) -> int:
        """Total parameters (Megatron's count: every expert; norms, router included)."""
        b, m = self.base, self.moe
        d = b.d_model
        router = d * m.experts
        dense_layer = self.attention_params() + 3 * d * b.ffn_hidden + 2 * d
        moe_layer = (
            self.attention_params() + self.expert_params() + 3 * d * m.shared_total + 2 * d + router
        )
        embed = b.vocab * d * (1 if b.tied_embeddings else 2)
        return m.dense_layers * dense_layer + self.moe_layers * moe_layer + embed + d

    def active_params(self) -> int:
        """Parameters a token meets (top_k routed experts of E)."""
        return self.num_params() - self.moe_layers * (
            self.expert_params() - self.routed_active_params()
        )

    def flops_per_token(self) -> float:
        """Model FLOPs per token by Megatron's MoE rule (``dtrain.model.flops``)."""
        b, m = self.base, self.moe
        return moe_flops_per_token(
            b.n_layer,
            b.d_model,
            b.n_head,
            b.n_kv_head,
            b.vocab,
            b.seq_len,
            dense_ffn=b.ffn_hidden,
            dense_layers=m.dense_layers,
            top_k=m.top_k,
            expert_ffn=m.expert_ffn,
            shared_ffn=m.shared_total,
            head_dim=self.hd,
            mla=self.mla,
        )


def stage_moe_layers(model: MoEModel, lay: Layout) -> int:
    """MoE layers on the busiest pipeline stage: ceil(L/pp) (a stage after the dense layers, which
    come first, holds that many), at most the MoE layers."""
    return min(stage_layers(model.base, lay.pp, lay.pp_split), model.moe_layers)


def rank_tokens(model: MoEModel, lay: Layout) -> float:
    """Tokens a rank dispatches per micro-batch: b·s/cp split over tp (torchtitan's EP splits the
    attention's tokens over the TP ranks before dispatch), all b·s/cp with expert TP (etp = tp,
    each rank then computes 1/etp of every expert)."""
    t = lay.micro_batch * model.base.seq_len / lay.cp
    return t if lay.etp > 1 else t / lay.tp


def rho(model: MoEModel, lay: Layout) -> float:
    """The imbalance a layout feels: ρ with EP; with ep = 1 every rank runs every expert on its
    own tokens, so uneven routing moves rows between its experts but adds none."""
    return model.moe.imbalance if lay.ep > 1 else 1.0


def tokens_per_expert(model: MoEModel, lay: Layout) -> float:
    """Rows of one local expert's grouped-GEMM slice on the busiest rank: T·k·ρ/(E/ep)."""
    m = model.moe
    return rank_tokens(model, lay) * m.top_k * rho(model, lay) * lay.ep / m.experts


# ---------------------------------------------------------------- memory


def expert_params_per_gpu(model: MoEModel, lay: Layout) -> float:
    """Routed-expert weights on the busiest rank: its stage's MoE layers x E/ep experts / etp."""
    return stage_moe_layers(model, lay) * model.expert_params() / (lay.ep * lay.etp)


def _proxy_routed_per_gpu(model: MoEModel, lay: Layout) -> float:
    """The routed weights the proxy holds on a rank (top_k experts' width, split over tp)."""
    return stage_moe_layers(model, lay) * model.routed_active_params() / lay.tp


def expert_shard_group(lay: Layout) -> int:
    """Ranks the experts' states shard over: efsdp (one HSDP replica's), or every expert-data-
    parallel rank without ZeRO."""
    return lay.efsdp if lay.zero_stage else lay.expert_dp


def moe_memory(
    model: MoEModel,
    lay: Layout,
    proxy: MemoryBreakdown,
    grad_bytes: int = 4,
    optimizer_states: str = "fp32",
    activation_factor: float = 1.0,
) -> tuple[MemoryBreakdown, dict]:
    """The proxy's memory with its routed weights replaced by the experts (sharded over
    ``expert_shard_group``), MLA / head-dim attention weights added, and the routed activations:
    per MoE layer and micro-batch held, the k permuted copies of each token and the experts'
    outputs before the combine (2·2·T·k·h bytes), ρ x the k·3·F SwiGLU rows the proxy counts once
    (the extra (ρ−1)), none with full recompute (a layer's input alone is kept)."""
    m, d = model.moe, model.base.d_model
    expert = expert_params_per_gpu(model, lay)
    routed = _proxy_routed_per_gpu(model, lay)
    attn = stage_layers(model.base, lay.pp, lay.pp_split) * model.attention_extra_params() / lay.tp
    states = [
        model_state_bytes(p, lay.zero_stage, g, grad_bytes, optimizer_states)
        for p, g in (
            (expert, expert_shard_group(lay)),
            (routed, lay.shard_group),
            (attn, lay.shard_group),
        )
    ]
    (pe, ge, oe), (pr, gr, orr), (pa, ga, oa) = states
    # ZeRO-3's gathered working set (``memory.memory_per_gpu``): under PP the stage's weights and
    # fp32 gradients, (2 + grad_bytes)·Ψ; else three layers' bf16 weights. The proxy's routed
    # weights leave it, the experts' enter it where their states are sharded (efsdp > 1).
    buffers = proxy.buffers
    if lay.zero_stage == 3:
        layer_r = model.routed_active_params() / lay.tp
        layer_e = model.expert_params() / (lay.ep * lay.etp)
        if lay.shard_group > 1:
            buffers -= (2 + grad_bytes) * routed if lay.pp > 1 else 3 * 2 * layer_r
        if expert_shard_group(lay) > 1:
            buffers += (2 + grad_bytes) * expert if lay.pp > 1 else 3 * 2 * layer_e
        buffers = max(buffers, 0.0)
    acts = 0.0
    if lay.recompute != "full":
        t = rank_tokens(model, lay)
        r = rho(model, lay)
        per_layer = 2 * t * d * (2 * m.top_k * r - 1) + (r - 1) * t * m.top_k * (
            2 * 3 * m.expert_ffn / lay.etp
        )
        held = held_layer_microbatches(model.proxy, lay)
        share = stage_moe_layers(model, lay) / max(
            stage_layers(model.base, lay.pp, lay.pp_split), 1
        )
        acts = per_layer * held * share * activation_factor
    mem = MemoryBreakdown(
        params=proxy.params - pr + pe + pa,
        grads=proxy.grads - gr + ge + ga,
        optimizer=proxy.optimizer - orr + oe + oa,
        activations=proxy.activations + acts,
        buffers=buffers,
    )
    terms = {
        "expert_params_per_gpu": expert,
        "expert_state_bytes": pe + ge + oe,
        "expert_shard_group": expert_shard_group(lay),
        "routed_activation_bytes": acts,
    }
    return mem, terms


# ---------------------------------------------------------------- time


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
    """Dispatch and combine of one MoE layer and micro-batch on the busiest rank (module
    docstring). Across nodes, the share of an all-to-all that leaves the node ((ep − g)/ep of the
    bytes, g ranks per node) runs over the NIC while the rest crosses NVLink: the slower sets the
    time. DeepEP sends each token's row once per target node (``traffic.ep_nodes_reached``)
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
    if g == ep:  # one node: NVLink
        s = sum(_a2a(volume.ep_dispatch_bytes(t, m.top_k, d, b), ep, rho, link) for b in passes)
        return EpComm(s, wire, link.name)
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
    return EpComm(s, wire, f"{link.name} ({g} per node)")


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


@dataclass(frozen=True)
class MoETerms:
    """Seconds per step a layout's routed experts add to its dense proxy (module docstring)."""

    expert_gemm: float
    router: float
    attention_extra: float
    all_to_all: float
    all_to_all_hidden: float
    a2a_contention: float
    expert_dp: float
    optimizer: float
    tokens_per_expert: float
    a2a_wire_bytes: float
    a2a_link: str
    exposed_with_overlap: float = 0.0  # what A2A overlap would leave exposed

    @property
    def exposed_all_to_all(self) -> float:
        return self.all_to_all - self.all_to_all_hidden + self.a2a_contention

    @property
    def total(self) -> float:
        return (
            self.expert_gemm
            + self.router
            + self.attention_extra
            + self.exposed_all_to_all
            + self.expert_dp
            + self.optimizer
        )


def _routed_gemms(model: MoEModel, rows: float, width: int, count: int) -> list[Gemm]:
    """Forward GEMMs of ``count`` experts' SwiGLU slices of ``width`` columns for ``rows`` each."""
    d, rows = model.base.d_model, max(1, round(rows))
    return [Gemm(rows, 2 * width, d, count, "w13"), Gemm(rows, d, width, count, "w2")]


def moe_terms(
    model: MoEModel,
    lay: Layout,
    cluster: Cluster,
    dev: Device,
    *,
    proxy_gemm_s: float,
    proxy_attention_s: float,
    proxy_work_s: float,
    dp_exposed_share: float,
    dtype: str = "bf16",
    dispatch_bytes: float = 2,
    combine_bytes: float = 2,
    value_bytes: int = 2,
    grad_bytes: int = 4,
) -> MoETerms:
    """The routed experts' seconds per step on the busiest rank (module docstring)."""
    return _moe_terms(
        model,
        lay,
        cluster,
        dev,
        proxy_gemm_s,
        proxy_attention_s,
        proxy_work_s,
        dp_exposed_share,
        dtype,
        dispatch_bytes,
        combine_bytes,
        value_bytes,
        grad_bytes,
    )


def _moe_terms(
    model,
    lay,
    cluster,
    dev,
    proxy_gemm_s,
    proxy_attention_s,
    proxy_work_s,
    dp_share,
    dtype,
    bd,
    bc,
    vb,
    gb,
) -> MoETerms:
    m, b = model.moe, model.base
    layers = stage_moe_layers(model, lay)
    micro = lay.grad_accum
    passes = 3 + (1 if lay.recompute == "full" else 0)  # forward, dgrad, wgrad (+ the re-run)
    key = Layout(
        micro_batch=lay.micro_batch,
        cp=lay.cp,
        tp=lay.tp,
        ep=lay.ep,
        etp=lay.etp,
        dp_shard=lay.ep * lay.etp,
        zero_stage=1,
    )
    gemm, router, extra_gemm = _layer_gemm_s(model, key, dev, dtype)
    expert_gemm = gemm * passes * layers * micro
    router = router * layers * micro
    # attention the proxy's d/H head dim misses: projections at the proxy's GEMM rate (per layer
    # above), the core scaled by H·(d_qk + d_v) / (2·d)
    all_layers = stage_layers(b, lay.pp, lay.pp_split)
    qk, v = (
        (model.hd, model.hd)
        if model.mla is None
        else (model.mla.qk_nope_dim + model.mla.qk_rope_dim, model.mla.v_head_dim)
    )
    core_ratio = b.n_head * (qk + v) / (2 * b.d_model)
    attention_extra = extra_gemm * passes * all_layers * micro + proxy_attention_s * (
        core_ratio - 1
    )
    rows = tokens_per_expert(model, lay)
    comm = ep_comm(model, key, cluster, bd, bc)
    a2a = comm.seconds * layers * micro * (1.5 if lay.recompute == "full" else 1.0)
    # with A2A overlap the dispatch/combine of one micro-batch runs behind another's compute, at
    # the SMs its kernels hold; priced both ways, the model's own setting picks one
    overlappable = min(a2a, proxy_work_s)
    with_overlap = a2a - overlappable * (1 - A2A_SM_SHARE)
    hidden = contention = 0.0
    if m.a2a_overlap and a2a > 0:
        hidden, contention = overlappable, overlappable * A2A_SM_SHARE
    # expert gradient / weight traffic over the expert-data-parallel group, replacing the proxy's
    # routed weights over dp·cp; exposed in the proxy's own exposed share
    ex_link = group_link(cluster, lay.expert_dp, lay.ep * lay.etp, multi_rail=True)
    dp_link = group_link(cluster, lay.data_shards, lay.tp, multi_rail=True)
    expert = expert_params_per_gpu(model, lay)
    routed = _proxy_routed_per_gpu(model, lay)
    n_ex = expert_shard_group(lay) if lay.zero_stage else lay.expert_dp
    expert_dp = dp_share * (
        _dp_time(expert, n_ex, lay.zero_stage, micro, lay.pp, ex_link, vb, gb)
        - _dp_time(routed, lay.shard_group, lay.zero_stage, micro, lay.pp, dp_link, vb, gb)
    )
    if lay.hsdp_replicate > 1:  # the expert shards all-reduced across the replica groups
        expert_dp += dp_share * allreduce_time(gb * expert / n_ex, lay.hsdp_replicate, dp_link)
    with_states = lambda p, g: p / g if lay.zero_stage >= 1 else p  # noqa: E731
    local_p = lambda p, g: p / g if lay.zero_stage >= 2 else p  # noqa: E731
    optimizer = optimizer_s(with_states(expert, n_ex), local_p(expert, n_ex), dev) - optimizer_s(
        with_states(routed, lay.shard_group), local_p(routed, lay.shard_group), dev
    )
    return MoETerms(
        expert_gemm=expert_gemm,
        router=router,
        attention_extra=attention_extra,
        all_to_all=a2a,
        all_to_all_hidden=hidden,
        a2a_contention=contention,
        expert_dp=expert_dp,
        optimizer=optimizer,
        tokens_per_expert=rows,
        a2a_wire_bytes=comm.wire_bytes,
        a2a_link=comm.link,
        exposed_with_overlap=with_overlap,
    )


@lru_cache(maxsize=1 << 14)
def _layer_gemm_s(model: MoEModel, key: Layout, dev: Device, dtype: str) -> tuple:
    """Per MoE layer and micro-batch, forward: (the routed experts' grouped GEMMs less the dense
    GEMM the proxy priced for the same balanced FLOPs, the router's GEMM x 3 (forward and
    backward), the attention projections the proxy misses). ``key``: the layout's micro-batch,
    cp, tp, ep and etp."""
    m, b, lay = model.moe, model.base, key
    tokens = lay.micro_batch * b.seq_len / lay.cp
    rows = tokens_per_expert(model, lay)
    # a grouped GEMM pads each expert's rows to the kernel's M block (DeepGEMM's contiguous
    # layout: 128 rows), and each expert's weights are read whatever its rows
    padded = -(-rows // GROUP_ALIGN) * GROUP_ALIGN
    local = m.experts // lay.ep
    grouped = sum(
        dev.gemm_s(g, dtype) for g in _routed_gemms(model, padded, m.expert_ffn // lay.etp, local)
    )
    # what the proxy priced for the balanced routed FLOPs: one dense GEMM of k·F over the tokens
    width = m.top_k * m.expert_ffn // lay.tp
    dense = sum(dev.gemm_s(g, dtype) for g in _routed_gemms(model, tokens, width, 1))
    router = 3 * dev.gemm_s(Gemm(max(1, round(rank_tokens(model, lay))), m.experts, b.d_model))
    extra_n = max(0, round(model.attention_extra_params() / b.d_model / lay.tp))
    extra = dev.gemm_s(Gemm(max(1, round(tokens)), extra_n, b.d_model), dtype) if extra_n else 0.0
    return grouped - dense, router, extra


def ep_degrees(model: MoEModel, lay: Layout) -> list[int]:
    """ep values a layout can fold: powers of two dividing the experts and dp_shard·cp·tp (etp 1),
    ep·etp within the fold with etp = tp."""
    fold = lay.expert_fold
    out, e = [], 1
    while e <= min(fold, model.moe.experts):
        if model.moe.experts % e == 0 and fold % e == 0:
            out.append(e)
        e *= 2
    return out
