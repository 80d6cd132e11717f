"""Time of one training step: compute at a calibrated efficiency plus α–β costed collectives.

Sources
-------
* FLOPs: Chowdhery et al. 2022 (PaLM), App. B: model FLOPs per token = 6N + 12·L·h·s (forward
  2N + 4·L·h·s, backward twice that; causal masking not subtracted). N excludes the input
  embedding (a lookup, not a matmul).
* Collectives: ring algorithms as in NCCL, costed with Hockney's α–β model; β is the nccl-tests
  *bus* bandwidth (nccl-tests doc/PERFORMANCE.md), so all-reduce moves 2(n−1)/n·B over β.
* Data parallel / ZeRO volumes: Rajbhandari et al. 2020 (ZeRO) §7: ZeRO-1/2 move the same volume
  as DP's all-reduce, ZeRO-3 1.5× (all-gather in forward, again in backward, reduce-scatter).
* Tensor parallel: Shoeybi et al. 2019 (Megatron-LM) §3: 2 all-reduces in forward and 2 in
  backward per layer; with sequence parallelism (Korthikanti et al. 2022 §4.2.2) all-gather +
  reduce-scatter pairs of the same volume.
* Pipeline: Narayanan et al. 2021 (Megatron-LM at scale, SC'21) §2.2: bubble fraction
  (p−1)/(v·m) with v interleaved stages and m micro-batches; §4.1 scatter/gather of p2p tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import Cluster, LinkModel
from .memory import Layout, ModelShape, params_per_gpu, stage_layers

__all__ = ["LinkModel", "Param", "Calibration", "StepTime", "allreduce_time", "all_gather_time",
           "reduce_scatter_time", "p2p_time", "bubble_fraction", "group_link",
           "model_flops_per_token", "step_time"]

PROVENANCES = ("datasheet/published:", "measured here:")


def allreduce_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring all-reduce: 2(n−1)/n · B/β + 2(n−1)·α (β = bus bandwidth, nccl-tests convention)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.beta_Bps + 2 * (n - 1) * link.alpha_s


def all_gather_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring all-gather of a B-byte result: (n−1)/n · B/β + (n−1)·α."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.beta_Bps + (n - 1) * link.alpha_s


def reduce_scatter_time(nbytes: float, n: int, link: LinkModel) -> float:
    """Ring reduce-scatter of a B-byte input: (n−1)/n · B/β + (n−1)·α (mirror of all-gather)."""
    return all_gather_time(nbytes, n, link)


def p2p_time(nbytes: float, link: LinkModel) -> float:
    """One point-to-point send: B/β + α."""
    return nbytes / link.beta_Bps + link.alpha_s


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble / ideal compute time, (p−1)/(v·m) (Narayanan et al. 2021, §2.2.1–2.2.2)."""
    return (p - 1) / (v * m)


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
        0.5, "compute-only efficiency; end-to-end MFU of 44-52% of A100 peak (Narayanan et al. "
        "2021, SC'21, Table 1) and 38-43% BF16 MFU on H100 (Llama 3 Herd of Models, 2024, Table 4) "
        "include communication and bubbles, which this model costs separately"))
    dp_overlap: Param = field(default_factory=lambda: _published(
        0.5, "assumption: DDP bucketing (Li et al. 2020, VLDB) and FSDP prefetching (Zhao et al. "
        "2023, VLDB) overlap DP traffic with backward; half taken as hidden until fsdp-scaling measures it"))
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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def mfu(self) -> float:
        """Model FLOPs (6N + 12·L·h·s per token, no recompute) / (time · GPUs · BF16 dense peak)."""
        return self.model_flops / (self.total * self.gpus * self.peak_flops)


def model_flops_per_token(shape: ModelShape) -> float:
    """6N + 12·L·h·s (PaLM App. B), N = parameters without the input embedding."""
    n = shape.num_params() - shape.vocab * shape.d_model
    return 6 * n + 12 * shape.n_layer * shape.d_model * shape.seq_len


def _recompute_flops_per_token(shape: ModelShape, recompute: str) -> float:
    """Extra forward work: full = one more forward, 2N + 4·L·h·s (×8/6 of 6N); selective = the
    attention core (QKᵀ and AV), 4·L·h·s (Korthikanti et al. 2022 §5)."""
    attn = 4 * shape.n_layer * shape.d_model * shape.seq_len
    if recompute == "full":
        return model_flops_per_token(shape) / 3
    return attn if recompute == "selective" else 0.0


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, calib: Calibration | None = None,
              precision: str = "bf16", value_bytes: int = 2) -> StepTime:
    """Predicted time of one step for ``layout`` (see module docstring for every term).

    compute   tokens per rank · FLOPs/token (+ recompute) · (L'/L) / tp / (peak_bf16 · mfu
              [· fp8_speedup]), L' = ceil(L/pp) layers on the busiest stage
    tp_comm   L' · m · (4, or 6 with full recompute) all-reduces of b·s·h·2 bytes over TP
    pp_comm   2·v·m sends of b·s·h·2/tp bytes (scatter/gather), fully exposed
    bubble    (p−1)/(v·m) · (compute + tp_comm)
    dp_comm   over the DP group (group_link, Ψ = params_per_gpu, bf16 grads = 2Ψ bytes; an fp32
              reduction would double it): ZeRO-0/1 one all-reduce per step; ZeRO-2 m reduce-
              scatters + one all-gather of params; ZeRO-3 m · (2 all-gathers + 1 reduce-scatter),
              sharded grads being reduced every micro-batch (no no_sync); with m = 1 that is the
              ZeRO paper's 1.5× of DP. exposed = dp_comm − min(overlap · dp_comm, compute).
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
    hw_flops = model_flops_per_token(shape) + _recompute_flops_per_token(shape, lay.recompute)
    layers = stage_layers(shape, lay.pp)
    share = layers / shape.n_layer / lay.tp
    compute = tokens_per_rank * hw_flops * share / (gpu.peak_bf16_flops * calib.mfu.value)
    if precision == "fp8":
        compute /= calib.fp8_speedup.value

    act_bytes = lay.micro_batch * s * h * value_bytes
    tp_comm = 0.0
    if lay.tp > 1:
        n_coll = 6 if lay.recompute == "full" else 4
        link = group_link(cluster, lay.tp, 1, multi_rail=False)
        per_layer = n_coll * allreduce_time(act_bytes, lay.tp, link)
        tp_comm = layers * m * per_layer * calib.tp_overhead.value

    pp_comm = bubble = 0.0
    if lay.pp > 1:
        link = cluster.nvlink if lay.tp * lay.dp * lay.pp <= cluster.node_size else cluster.ib
        pp_comm = 2 * lay.virtual_stages * m * p2p_time(act_bytes / lay.tp, link)
        bubble = bubble_fraction(lay.pp, m, lay.virtual_stages) * (compute + tp_comm)

    dp_comm = 0.0
    if lay.dp > 1:
        grads = value_bytes * params_per_gpu(shape, lay.tp, lay.pp)  # bf16: 2 bytes, = param bytes
        link = group_link(cluster, lay.dp, lay.tp, multi_rail=True)
        ag = all_gather_time(grads, lay.dp, link)
        rs = reduce_scatter_time(grads, lay.dp, link)
        if lay.zero_stage <= 1:
            dp_comm = allreduce_time(grads, lay.dp, link)
        elif lay.zero_stage == 2:
            dp_comm = m * rs + ag
        else:
            dp_comm = m * (2 * ag + rs)
    hidden = min(calib.dp_overlap.value * dp_comm, compute)
    exposed = dp_comm - hidden

    total = compute + tp_comm + pp_comm + bubble + exposed
    tokens = lay.dp * tokens_per_rank
    return StepTime(compute=compute, dp_comm=dp_comm, dp_comm_exposed=exposed, tp_comm=tp_comm,
                    pp_comm=pp_comm, bubble=bubble, total=total, tokens=tokens,
                    model_flops=tokens * model_flops_per_token(shape),
                    gpus=lay.dp * lay.tp * lay.pp, peak_flops=gpu.peak_bf16_flops)
