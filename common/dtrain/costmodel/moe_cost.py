"""Mixture-of-experts in the cost model: the seconds a routed-expert layer adds to a dense step
(``moe_terms``, issue 41). The shape, its parameters and FLOPs: ``moe_model``; how a layout splits
it: ``moe_layout``; the all-to-all and the expert DP traffic: ``moe_comm``; the memory:
``moe_memory``.

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
             backward) after the token counts' exchange (one even all-to-all of E int64), the
             busiest rank receiving ρ x the even share
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

from dataclasses import dataclass
from functools import lru_cache

from .collectives import allreduce_time, group_link
from .compute import optimizer_s
from .device_rates import Device
from .efficiency import Gemm
from .hardware import Cluster
from .moe_comm import _dp_time, ep_comm
from .moe_layout import rank_tokens, stage_moe_layers, tokens_per_expert
from .moe_memory import _proxy_routed_per_gpu, expert_params_per_gpu, expert_shard_group
from .moe_model import MoEModel
from .shapes import Layout, stage_layers

# DeepSeek-V3 technical report §3.2.2: "only 20 SMs" of the H800's 132 run its all-to-all kernels
A2A_SM_SHARE = 20 / 132
# rows a grouped GEMM pads each expert's slice to (DeepGEMM README, contiguous layout: the M axis
# of each expert aligned to the GEMM M block, 128)
GROUP_ALIGN = 128


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
    """Forward GEMMs of ``count`` experts' slices of ``width`` columns for ``rows`` each: SwiGLU's
    w1 and w3 as one GEMM, GELU's w1, then w2."""
    d, rows = model.base.d_model, max(1, round(rows))
    up = (model.mlp_matrices - 1) * width
    return [Gemm(rows, up, d, count, "w13"), Gemm(rows, d, width, count, "w2")]


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
