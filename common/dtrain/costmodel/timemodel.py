"""Time of one training step: GEMM compute on a calibrated roofline plus α–β costed collectives.

Sources
-------
* FLOPs: ``dtrain.flops.transformer_flops_per_token`` (the project's one formula: 6·N_matmul +
  12·L·h·s, lm_head kept when tied, full non-causal attention as in PaLM App. B, Megatron-LM and
  torchtitan). MFU and TFLOP/s use these *model* FLOPs; recompute adds *hardware* FLOPs (time)
  but never model FLOPs.
* Compute time: ``efficiency`` (a roofline per GEMM × an achieved-fraction curve fitted from a
  matmul probe) plus a fixed per-step overhead.
* Collectives: ring algorithms as in NCCL, costed with Hockney's α–β model; β is the nccl-tests
  *bus* bandwidth (nccl-tests doc/PERFORMANCE.md), so all-reduce moves 2(n−1)/n·B over β.
* Data parallel / ZeRO volumes: Rajbhandari et al. 2020 (ZeRO) §7: ZeRO-1/2 move the same volume
  as DP's all-reduce, ZeRO-3 1.5× (all-gather in forward, again in backward, reduce-scatter).
* Tensor parallel: Shoeybi et al. 2019 (Megatron-LM) §3: 2 all-reduces in forward and 2 in
  backward per layer; with sequence parallelism (Korthikanti et al. 2022 §4.2.2) all-gather +
  reduce-scatter pairs of the same volume.
* Pipeline: Narayanan et al. 2021 (Megatron-LM at scale, SC'21) §2.2: bubble fraction
  (p−1)/(v·m) with v interleaved stages and m micro-batches; §4.1 scatter/gather of p2p tensors.
  Uneven stages (Megatron ``--decoder-first/last-pipeline-num-layers``): the bubble is p−1 slots
  of the busiest virtual chunk, ceil(L/(p·v)) layers, see ``bubble_fraction``.
* ZeRO-3 / FSDP issues its collectives per FSDP unit, one per transformer block plus the root
  (embeddings, head), as torchtitan and dtrain wrap the model (``fully_shard`` per block): the
  bytes are the same as one collective over the stage's parameters, the α latency is paid per unit.
* Pipeline bubble: ``Calibration.pp_overhead`` scales the formula (1 = taken as is; fsdp-scaling's
  PP layout runs measure the ratio of the real idle + p2p share to the formula's).
* DP gradients are reduced in fp32 (Megatron ``--accumulate-allreduce-grads-in-fp32``, torchtitan
  FSDP ``reduce_dtype=float32``): 4 bytes per parameter; gathered weights move in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import Cluster, LinkModel
from dtrain.flops import transformer_flops_per_token

from .efficiency import GemmCurve, gemm_time, head_gemm, layer_gemms, op_recompute_gemms
from .memory import Layout, ModelShape, params_per_gpu, stage_layers

__all__ = ["LinkModel", "Param", "Calibration", "StepTime", "allreduce_time", "all_gather_time",
           "reduce_scatter_time", "p2p_time", "bubble_fraction", "group_link", "tp_comm_time",
           "model_flops_per_token", "compute_time", "step_time"]

PROVENANCES = ("datasheet/published:", "measured here:")
GPU_E_MAX = 0.58
GPU_W_HALF = 2.1e9
GPU_DP_OVERLAP = 0.8


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


def p2p_time(nbytes: float, link: LinkModel) -> float:
    """One point-to-point send: B/β + α (the link's sendrecv α–β when measured apart)."""
    link = link.of("sendrecv")
    return nbytes / link.beta_Bps + link.alpha_s


def bubble_fraction(p: int, m: int, v: int = 1, n_layer: int | None = None) -> float:
    """Pipeline bubble / ideal compute time, (p−1)/(v·m) (Narayanan et al. 2021, §2.2.1–2.2.2).

    With ``n_layer`` the stages may be uneven (pp·v need not divide L): the pipeline fills and
    drains in p−1 slots of the busiest virtual chunk, ceil(L/(p·v)) layers, against m micro-
    batches of the busiest device's ceil(L/p) layers:
        (p−1)·ceil(L/(p·v)) / (m·ceil(L/p)),  = (p−1)/(v·m) when p·v divides L.
    """
    if n_layer is None:
        return (p - 1) / (v * m)
    return (p - 1) * -(-n_layer // (p * v)) / (m * -(-n_layer // p))


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


@dataclass(frozen=True)
class Param:
    """A calibrated number and where it came from: 'datasheet/published: …' or 'measured here: …'."""

    value: float
    provenance: str

    def __post_init__(self) -> None:
        if not self.provenance.startswith(PROVENANCES):
            raise ValueError(f"provenance must start with one of {PROVENANCES}: {self.provenance!r}")

    @property
    def measured(self) -> bool:
        return self.provenance.startswith("measured here:")


def _published(value: float, source: str) -> Param:
    return Param(value, "datasheet/published: " + source)


@dataclass(frozen=True)
class Calibration:
    """The empirical inputs of the model; calibration from measured runs replaces each Param."""

    mfu: Param = field(default_factory=lambda: _published(
        GPU_E_MAX, "e_max of the GEMM achieved-fraction curve (share of the roofline bound a large GEMM "
        "reaches, non-GEMM kernels folded in): median over the published runs of dtrain backtest "
        "(costmodel/backtest_runs.yaml) of the e_max reproducing each; the backtest predicts each row with "
        "the median of the OTHER rows (leave-one-out)"))
    gemm_half_flops: Param = field(default_factory=lambda: _published(
        GPU_W_HALF, "W_half of the GEMM achieved-fraction curve: FLOPs of a GEMM reaching half of e_max; "
        "assumption: a 1024^3 bf16 GEMM (2.1 GFLOP) reaches about half of a large one on A100/H100 "
        "until a CUDA gemm-probe run measures it"))
    step_overhead_s: Param = field(default_factory=lambda: _published(
        0.0, "fixed per-step overhead (optimizer step, launch, data loading) not modelled on GPUs "
        "until a gemm-probe run measures it"))
    dp_overlap: Param = field(default_factory=lambda: _published(
        GPU_DP_OVERLAP, "DDP bucketing (Li et al. 2020, VLDB) and FSDP prefetching (Zhao et al. 2023, VLDB) "
        "run DP traffic behind compute, but NCCL runs a collective as a kernel of one CTA (SM) per channel "
        "(NCCL user guide: ncclConfig_t minCTAs/maxCTAs, CTA policy flags), 16-32 of A100's 108 / H100's "
        "132 SMs, slowing the compute it overlaps: ~70-88% of the overlapped time is hidden, 80% taken; "
        "dtrain backtest prints how its goals move with this value; fsdp-scaling measures it"))
    pp_overhead: Param = field(default_factory=lambda: _published(
        1.0, "bubble formula (p-1)*ceil(L/(p*v))/(m*ceil(L/p)) taken as is (Narayanan et al. 2021); "
        "fsdp-scaling's PP layout runs measure the real/formula ratio"))
    tp_overhead: Param = field(default_factory=lambda: _published(
        1.0, "alpha-beta prediction taken as is; Megatron TP collectives are not overlapped "
        "(Shoeybi et al. 2019), tp-attention measures the real/modelled ratio"))
    fp8_speedup: Param = field(default_factory=lambda: _published(
        1.3, "compute speed-up over BF16; about 1.3-1.5x tokens/s reported for Llama 3 8B-405B on "
        "H100 with float8 + FSDP2 vs FSDP1 bf16 (PyTorch blog 'Supercharging training using float8 "
        "and FSDP2', IBM and Meta, 2024); 1.3x taken as the conservative end"))
    fp8_memory_factor: Param = field(default_factory=lambda: _published(
        0.8, "activation bytes factor: FP8 recipes cache the inputs of the linear layers in 1 byte; "
        "those are 14 of the 34 s*b*h bytes per layer of Korthikanti et al. 2022 (QKV, proj, fc1 "
        "2+2+2, fc2 8), so (34-7)/34 ~ 0.8"))


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on every GPU; ``total`` = the sum of the exposed parts."""

    compute: float
    dp_comm: float
    dp_comm_exposed: float
    tp_comm: float
    pp_comm: float
    bubble: float
    total: float
    tokens: float
    model_flops: float
    gpus: int
    peak_flops: float
    overhead: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU (model FLOPs: recompute not counted)."""
        return self.model_flops / (self.total * self.gpus) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs (``model_flops_per_token``, no recompute) / (time · GPUs · BF16 dense peak)."""
        return self.model_flops / (self.total * self.gpus * self.peak_flops)


def tp_comm_time(shape: ModelShape, layout: Layout, link: LinkModel, value_bytes: int = 2) -> float:
    """α–β TP communication of one step on the busiest stage, before ``Calibration.tp_overhead``:
    ceil(L/pp) layers · m micro-batches · (4, or 6 with full recompute) ring all-reduces of b·s·h
    values (Shoeybi et al. 2019 §3; SP's all-gather + reduce-scatter pairs move the same volume).
    Selective op AC re-runs wo and so the all-reduce after it (5), except with SP, whose
    reduce-scatter output torchtitan's policy saves (4)."""
    if layout.tp <= 1:
        return 0.0
    n_coll = {"full": 6, "op": 4 if layout.sequence_parallel else 5}.get(layout.recompute, 4)
    act_bytes = layout.micro_batch * shape.seq_len * shape.d_model * value_bytes
    return stage_layers(shape, layout.pp) * layout.grad_accum * n_coll * allreduce_time(act_bytes, layout.tp, link)


def model_flops_per_token(shape: ModelShape) -> float:
    """``dtrain.flops.transformer_flops_per_token`` of ``shape`` (lm_head kept when tied)."""
    return transformer_flops_per_token(shape.n_layer, shape.d_model, shape.n_head, shape.n_kv_head,
                                       shape.ffn_hidden, shape.vocab, shape.seq_len, shape.gated_mlp)


def compute_time(shape: ModelShape, layout: Layout, peak_flops: float, hbm_Bps: float, curve: GemmCurve,
                 value_bytes: int = 2) -> float:
    """Seconds of GEMM work per step on the busiest GPU (``efficiency``).

    Per layer and micro-batch: forward GEMMs ×3 (forward, dgrad, wgrad: the same FLOPs), plus one
    more forward with full recompute, the attention core (QKᵀ, AV) with selective recompute
    (Korthikanti et al. 2022 §5), or wk, wo and w3 (w2 without a gated MLP) with torchtitan's
    selective op AC (``efficiency.op_recompute_gemms``). The busiest stage holds ceil(L/pp) layers; the
    output projection is given to the last stage, whose layer count Megatron's uneven split lowers to
    balance it, so a stage costs max(ceil(L/pp)·t_layer, (L·t_layer + t_head)/pp).
    """
    gemms = layer_gemms(shape, layout)
    times = [gemm_time(g, peak_flops, hbm_Bps, curve, value_bytes) for g in gemms]
    fwd = sum(times)
    t_layer = 3 * fwd
    if layout.recompute == "full":
        t_layer += fwd
    elif layout.recompute == "selective":
        t_layer += sum(t for g, t in zip(gemms, times) if g.name in ("scores", "av"))
    elif layout.recompute == "op":
        t_layer += sum(gemm_time(g, peak_flops, hbm_Bps, curve, value_bytes) for g in op_recompute_gemms(shape, layout))
    t_head = 3 * gemm_time(head_gemm(shape, layout), peak_flops, hbm_Bps, curve, value_bytes)
    layers = stage_layers(shape, layout.pp)
    per_micro = max(layers * t_layer, (shape.n_layer * t_layer + t_head) / layout.pp)
    return layout.grad_accum * per_micro


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, calib: Calibration | None = None,
              precision: str = "bf16", value_bytes: int = 2) -> StepTime:
    """Predicted time of one step for ``layout`` (see module docstring for every term).

    compute   ``compute_time``: GEMM roofline × achieved-fraction curve (e_max = calib.mfu,
              W_half = calib.gemm_half_flops) over the busiest stage's GEMMs [/ fp8_speedup]
    overhead  calib.step_overhead_s, fixed per step [/ fp8_speedup: the factor is measured and
              published as a whole-step tokens/s ratio, so it scales all per-rank work alike]
    tp_comm   L' · m · (4, or 6 with full recompute) all-reduces of b·s·h·2 bytes over TP
    pp_comm   2·v·m sends of b·s·h·2/tp bytes (scatter/gather), fully exposed
    bubble    bubble_fraction(p, m, v, L) · (compute + tp_comm) · calib.pp_overhead
    dp_comm   over the DP group (group_link, Ψ = params_per_gpu, fp32 grads = 4Ψ bytes, weights
              value_bytes·Ψ): ZeRO-0 one all-reduce per step; ZeRO-1 a reduce-scatter of grads +
              an all-gather of weights (Megatron distributed optimizer); ZeRO-2 m reduce-
              scatters + one all-gather of params; ZeRO-3 m · (2 all-gathers + 1 reduce-scatter),
              sharded grads being reduced every micro-batch (no no_sync); with m = 1 that is the
              ZeRO paper's 1.5× of DP; ZeRO-3 pays α once per FSDP unit (ceil(L/pp) blocks + the
              root) per collective. exposed = dp_comm − min(overlap · dp_comm, compute), plus the
              all-reduce of the step's loss over DP (4 bytes: its latency; dtrain's trainer and
              Megatron average the logged loss every step).
    Ranks: TP innermost, then DP, then PP; PP sends use NVLink only when the whole job is one node.
    ``value_bytes``: bytes of one communicated activation or gradient value (2 for bf16 runs,
    4 for the fp32 runs on CPU whose step times the guide predicts).
    """
    calib = calib or Calibration()
    lay, s, h = layout, shape.seq_len, shape.d_model
    gpu = cluster.gpu
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if precision == "fp8" and gpu.fp8_tflops is None:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores; use precision='bf16'")
    m = lay.grad_accum
    tokens_per_rank = lay.micro_batch * m * s
    layers = stage_layers(shape, lay.pp)
    curve = GemmCurve(calib.mfu.value, calib.gemm_half_flops.value)
    compute = compute_time(shape, lay, gpu.peak_bf16_flops, gpu.hbm_tbps * 1e12, curve, value_bytes)
    overhead = calib.step_overhead_s.value
    if precision == "fp8":  # a whole-step tokens/s ratio (see Calibration.fp8_speedup): compute and overhead
        compute /= calib.fp8_speedup.value
        overhead /= calib.fp8_speedup.value

    act_bytes = lay.micro_batch * s * h * value_bytes
    tp_comm = 0.0
    if lay.tp > 1:
        link = group_link(cluster, lay.tp, 1, multi_rail=False)
        tp_comm = tp_comm_time(shape, lay, link, value_bytes) * calib.tp_overhead.value

    pp_comm = bubble = 0.0
    if lay.pp > 1:
        link = cluster.nvlink if lay.tp * lay.dp * lay.pp <= cluster.node_size else cluster.ib
        pp_comm = 2 * lay.virtual_stages * m * p2p_time(act_bytes / lay.tp, link)
        bubble = (bubble_fraction(lay.pp, m, lay.virtual_stages, shape.n_layer) * (compute + tp_comm)
                  * calib.pp_overhead.value)

    dp_comm = 0.0
    if lay.dp > 1:
        psi = params_per_gpu(shape, lay.tp, lay.pp)
        grads, weights = 4 * psi, value_bytes * psi  # fp32 gradient reduction, bf16 weights
        link = group_link(cluster, lay.dp, lay.tp, multi_rail=True)
        ag = all_gather_time(weights, lay.dp, link)
        rs = reduce_scatter_time(grads, lay.dp, link)
        if lay.zero_stage == 0:
            dp_comm = allreduce_time(grads, lay.dp, link)
        elif lay.zero_stage == 1:
            dp_comm = rs + ag
        elif lay.zero_stage == 2:
            dp_comm = m * rs + ag
        else:
            units = layers + 1  # FSDP: one unit per block + the root; α per unit, bytes unchanged
            lat_ag, lat_rs = ((units - 1) * (lay.dp - 1) * link.of(c).alpha_s for c in ("all_gather", "reduce_scatter"))
            dp_comm = m * (2 * (ag + lat_ag) + rs + lat_rs)
    hidden = min(calib.dp_overlap.value * dp_comm, compute)
    exposed = dp_comm - hidden
    if lay.dp > 1:  # the step's loss, averaged over the DP ranks for the log (a 4-byte all-reduce, latency only)
        exposed += allreduce_time(4, lay.dp, group_link(cluster, lay.dp, lay.tp, multi_rail=True))

    total = compute + tp_comm + pp_comm + bubble + exposed + overhead
    tokens = lay.dp * tokens_per_rank
    return StepTime(compute=compute, dp_comm=dp_comm, dp_comm_exposed=exposed, tp_comm=tp_comm,
                    pp_comm=pp_comm, bubble=bubble, total=total, tokens=tokens,
                    model_flops=tokens * model_flops_per_token(shape),
                    gpus=lay.dp * lay.tp * lay.pp, peak_flops=gpu.peak_bf16_flops, overhead=overhead)
