"""Time of one training step: compute term by term plus α–β costed communication, bubble and
overlap.

Sources
-------
* FLOPs: ``dtrain.model.flops.transformer_flops_per_token`` (the project's one formula: 6·N_matmul +
  12·L·h·s, lm_head kept when tied, full non-causal attention as in PaLM App. B, Megatron-LM and
  torchtitan). MFU and TFLOP/s use these *model* FLOPs; recompute adds *hardware* FLOPs (time)
  but never model FLOPs.
* Compute time: ``compute`` (GEMMs, attention, memory-bound kernels, output layer and loss,
  recompute, optimizer, each work over a kernel benchmark's rate, ``kernels.yaml``); on a device
  without a kernel table (the local CPU check) the gemm-probe's GEMM curve plus its measured fixed
  per-step overhead.
* Collectives: ``collectives`` (ring algorithms as in NCCL, Hockney's α–β model, β the nccl-tests
  bus bandwidth).
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
  FSDP ``reduce_dtype=float32``): 4 bytes per parameter, 2 with ``Stack.grad_reduce`` "bf16";
  gathered weights move in bf16. The TP and DP volumes per step: ``traffic``; every byte count per
  collective: ``dtrain.parallel.traffic`` (the trainer's counted-bytes checks use the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from .hardware import Cluster, GPUProfile
from dtrain.model.flops import transformer_flops_per_token

from .calibration import Calibration, Param
from .collectives import (
    COPY_ENGINE_HBM_PASSES,
    RING_HBM_PASSES,
    all_gather_time,
    all_to_all_time,
    allreduce_time,
    group_link,
    overlap_cost,
    p2p_time,
    reduce_scatter_time,
)
from .compute import ComputeTerms, Device, KernelModel, _micro_terms, optimizer_s, published
from .stack import Stack
from .efficiency import GemmCurve
from .shapes import Layout, ModelShape, pipeline_slots, stage_layers
from .memory import params_per_gpu
from .comm_time import dp_comm_time, dp_link, tp_comm_time
from . import eager
from .tp_overlap import TPOverlap, gpu_sms, step_overlap
from .pipeline_engine import engine_comm
from dtrain.parallel import traffic as volume

__all__ = [
    "StepTime",
    "StepModel",
    "bubble_fraction",
    "model_flops_per_token",
    "step_time",
    "step_model",
    "device_of",
]


def bubble_fraction(p: int, m: int, v: int = 1, n_layer: int | None = None) -> float:
    """Pipeline bubble / ideal compute time, (p−1)/(v·m) (Narayanan et al. 2021, §2.2.1–2.2.2).

    With ``n_layer`` (the layer slots the split shares, ``shapes.pipeline_slots``: L, or L + 2 when
    the split is "balanced") the stages may be uneven (pp·v need not divide L): the pipeline fills
    and drains in p−1 slots of the busiest virtual chunk, ceil(L/(p·v)) layers, against m micro-
    batches of the busiest device's ceil(L/p) layers:
        (p−1)·ceil(L/(p·v)) / (m·ceil(L/p)),  = (p−1)/(v·m) when p·v divides L.
    """
    if n_layer is None:
        return (p - 1) / (v * m)
    return (p - 1) * -(-n_layer // (p * v)) / (m * -(-n_layer // p))


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
    terms: ComputeTerms = field(default_factory=ComputeTerms)
    cp_comm: float = (
        0.0  # context-parallel attention traffic left exposed (ring: behind the attention)
    )
    dp_contention: float = (
        0.0  # of dp_comm_exposed: what the overlapped DP traffic takes from compute (SMs, HBM)
    )
    kernels: int = 0  # kernel launches per step (the eager stack's count, eager.kernel_counts)
    dispatch_floor: float = 0.0  # the host's issue time (eager.host_launches): at least this

    @property
    def launch_bound(self) -> bool:
        """The host issuing kernels, not the GPU, sets the step (eager stacks)."""
        return self.dispatch_floor > 0 and self.dispatch_floor >= self.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU (model FLOPs: recompute not counted)."""
        return self.model_flops / (self.total * self.gpus) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs (``model_flops_per_token``, no recompute) / (time · GPUs · BF16 dense
        peak)."""
        return self.model_flops / (self.total * self.gpus * self.peak_flops)


@lru_cache(maxsize=1 << 10)
def model_flops_per_token(shape: ModelShape) -> float:
    """``dtrain.model.flops.transformer_flops_per_token`` of ``shape`` (lm_head kept when tied)."""
    return transformer_flops_per_token(
        shape.n_layer,
        shape.d_model,
        shape.n_head,
        shape.n_kv_head,
        shape.ffn_hidden,
        shape.vocab,
        shape.seq_len,
        shape.gated_mlp,
    )


FLOP_CONVENTION = (
    "6N + 12·L·h·s per token, attention non-causal, recompute not counted: the MFU convention "
    "of PaLM, Megatron-LM and torchtitan"
)
EXECUTED_CONVENTION = "causal attention counted half, the recompute's re-run forward counted"


def _shape_flops(shape: ModelShape, vocab: int, seq_len: int) -> float:
    return transformer_flops_per_token(
        shape.n_layer,
        shape.d_model,
        shape.n_head,
        shape.n_kv_head,
        shape.ffn_hidden,
        vocab,
        seq_len,
        shape.gated_mlp,
    )


@lru_cache(maxsize=1 << 10)
def executed_flops_per_token(shape: ModelShape, recompute: str = "none") -> float:
    """FLOPs per token the kernels execute (the hardware FLOPs), from the same formula as
    ``model_flops_per_token``: its attention term (12·L·h·s, non-causal) halved by the causal
    mask, plus what activation checkpointing runs again: the layers' forward (full: a third of
    their matmuls plus the causal attention forward), the attention core's forward (selective),
    or torchtitan's op policy's wk, wo and w3 (or fc2) forward GEMMs (op)."""
    model = model_flops_per_token(shape)
    attention = model - _shape_flops(shape, shape.vocab, 0)
    layers_fwd = _shape_flops(shape, 0, 0) / 3  # forward of the layers' matmuls (no lm_head)
    attention_fwd = attention / 2 / 3  # causal forward
    hd = shape.d_model // shape.n_head
    op_fwd = (
        2
        * shape.n_layer
        * (
            shape.d_model * shape.n_kv_head * hd
            + shape.n_head * hd * shape.d_model
            + shape.d_model * shape.ffn_hidden
        )
    )
    extra = {
        "full": layers_fwd + attention_fwd,
        "selective": attention_fwd,
        "op": op_fwd,
    }.get(recompute, 0.0)
    return model - attention / 2 + extra


def device_of(cluster: Cluster, calib: Calibration, stack: Stack = Stack()) -> Device:
    """The rates a step runs at on ``cluster``'s GPU: its published kernel table
    (``kernels.yaml``), the GEMM curve replaced by a measured one (``calib.mfu`` measured: the
    gemm-probe), or, for a device without a table (the local CPU check), a GEMM-only model on the
    calibrated curve."""
    return _device(cluster.gpu, calib.mfu, calib.gemm_half_flops, stack)


@lru_cache(maxsize=256)
def _device(gpu: GPUProfile, mfu: Param, gemm_half_flops: Param, stack: Stack) -> Device:
    calib = Calibration(mfu=mfu, gemm_half_flops=gemm_half_flops)
    curve = GemmCurve(calib.mfu.value, calib.gemm_half_flops.value)
    kernels = published(gpu.name, stack.attention)
    if kernels is None:
        kernels = KernelModel(gpu.name, {"bf16": curve})
    elif calib.mfu.measured:
        kernels = kernels.with_gemm("bf16", curve, calib.mfu.provenance)
    scale = kernels.power_scale(gpu.power_w) / kernels.sustained
    return Device(
        gpu.peak_bf16_flops,
        gpu.peak_fp8_flops,
        gpu.hbm_tbps * 1e12,
        kernels,
        scale,
        stack.fused,
        stack.fused_loss,
        stack.fp8_casts,
        stack.fp8_gathers("fp8")[1],
        stack.optimizer,
    )


def step_time(
    shape: ModelShape,
    layout: Layout,
    cluster: Cluster,
    calib: Calibration | None = None,
    precision: str = "bf16",
    value_bytes: int = 2,
    stack: Stack = Stack(),
) -> StepTime:
    """Predicted time of one step for ``layout`` (see module docstring for every term).

    compute   ``StepModel.compute`` (``compute._micro_terms`` x m + ``compute.optimizer_s``): GEMMs,
              attention, memory-bound kernels, output projection + cross-entropy, recompute,
              optimizer; on a device without a kernel table the GEMM curve (e_max = calib.mfu,
              W_half = calib.gemm_half_flops) and the measured whole-step FP8 factor
    overhead  calib.step_overhead_s, fixed per step (measured by the gemm-probe on the local CPU; 0
              on GPUs, whose memory-bound work is modelled term by term) [/ fp8_speedup there too]
    tp_comm   L' · m · (4, or 6 with full recompute) all-reduces of b·s·h·2 bytes over TP; with
              ``stack.tp_overlap`` and SP, TE's overlaps per GEMM (``tp_overlap.step_overlap``:
              exposed share, SM margin, the copies' HBM), with ``stack.async_tp`` (torchtitan's
              AsyncTP) ``calib.async_tp_hidden`` of it hidden; an FP8 run's SP all-gathers at
              1 byte per value with ``stack.fp8_all_gather`` "tp" or "tp+fsdp"
    pp_comm   2·v·m sends of b·s·h·2/tp bytes (scatter/gather), fully exposed; on DeepSpeed's
              engine (``Software.pipeline_engine``) ``pipeline_engine.engine_comm``
    bubble    bubble_fraction(p, m, v, L) · (compute − optimizer + tp_comm) · calib.pp_overhead; the
              zero-bubble V schedule (``Layout.pp_schedule == "zbv"``) a third of it
    dp_comm   over the DP group (group_link, Ψ = params_per_gpu, fp32 grads = 4Ψ bytes (2Ψ with
              ``stack.grad_reduce`` "bf16"), weights
              value_bytes·Ψ, the block linears' 1 byte each with ``stack.fp8_all_gather``
              "tp+fsdp"):
              ZeRO-0 one all-reduce per step; ZeRO-1 a reduce-scatter of grads + an
              all-gather of weights (Megatron distributed optimizer; also ZeRO-3 under PP, whose
              stage keeps its weights gathered across micro-batches as torchtitan's does); ZeRO-2 m
              reduce- scatters + one all-gather (m all-gathers where ``Software.zero2_regathers``:
              FSDP2's); ZeRO-3 m · (2 all-gathers + 1 reduce-scatter), α once per FSDP unit
              (ceil(L/pp) blocks + the root). HSDP (``Layout.dp_replicate`` R > 1): the gathers and
              reduce-scatters run inside a replica group of dp·cp/R ranks, each reduce-scatter
              followed by an all-reduce of the fp32 gradient shard over the R groups.
    exposed   what overlap cannot hide: traffic runs behind the compute it can overlap, and the part
              that
              overlaps still costs ``overlap_cost`` of its time: the SMs NCCL's kernel holds (1 −
              calib.dp_overlap) plus the HBM its ring's copies take, 3·β/HBM (on an H100: 0.28 over
              NVLink, 0.03 over one NIC). ZeRO-3 (no PP) and ZeRO-2's per-micro-batch
              reduce-scatters behind the whole step's compute; a once-per-step gradient reduction
              (ZeRO-0/1) only behind the last micro-batch's backward (2/3 of its compute) and the
              pipeline's cooldown, and under ZeRO-3 with PP behind nothing
              (torch.distributed.pipelining runs FSDP's post-backward reduce-scatters after the
              stage's last backward); the weight all-gather behind the first micro-batch's forward
              (1/3); with ``stack.dp_sync`` "flush" (DeepSpeed's pipeline engine) neither is hidden;
              plus the all-reduce of the step's loss over DP (4 bytes: its latency).
    Ranks: TP innermost, then DP, then PP; PP sends use NVLink only when the whole job is one node.
    ``value_bytes``: bytes of one communicated activation or gradient value (2 for bf16 runs,
    4 for the fp32 runs on CPU whose step times the guide predicts).
    """
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if precision == "fp8" and cluster.gpu.fp8_tflops is None:
        raise ValueError(f"{cluster.gpu.name} has no FP8 tensor cores; use precision='bf16'")
    return step_model(shape, cluster, calib or Calibration(), precision, value_bytes, stack).time(
        layout
    )


# The cost model's one cache of step times: a StepModel per (model, cluster, calibration,
# precision, stack), which keeps each piece of a step per the few layout fields it depends on. A
# layout's whole StepTime is not cached: a search times each layout once, and the backtest asks
# 9,006 times for 8,957 distinct ones.
@lru_cache(maxsize=64)
def step_model(
    shape: ModelShape,
    cluster: Cluster,
    calib: Calibration,
    precision: str = "bf16",
    value_bytes: int = 2,
    stack: Stack = Stack(),
) -> StepModel:
    """``StepModel`` for one (model, cluster, calibration, precision, stack): a search times
    thousands of layouts on it, sharing the pieces that depend on a few of their fields."""
    return StepModel(shape, cluster, calib, precision, value_bytes, stack)


class StepModel:
    """``step_time`` for one model on one cluster; each piece is kept per the layout fields it
    depends on."""

    def __init__(
        self,
        shape: ModelShape,
        cluster: Cluster,
        calib: Calibration,
        precision: str,
        value_bytes: int,
        stack: Stack,
    ):
        self.shape, self.cluster, self.calib, self.precision, self.vb, self.stack = (
            shape,
            cluster,
            calib,
            precision,
            value_bytes,
            stack,
        )
        self.dev = device_of(cluster, calib, stack)
        self.fp8_gemms = precision == "fp8" and "fp8" in self.dev.kernels.gemm
        self.fp8_factor = (
            calib.fp8_speedup.value if precision == "fp8" and not self.fp8_gemms else 1.0
        )
        self.gpu_table = (
            published(cluster.gpu.name) is not None
        )  # a GPU priced term by term (kernels.yaml)
        self.overhead = calib.step_overhead_s.value / (1.0 if self.gpu_table else self.fp8_factor)
        self.flops_per_token = model_flops_per_token(shape)
        self.fp8_tp_gather, self.fp8_fsdp_gather = stack.fp8_gathers(precision)
        self._micro: dict = {}
        self._tp: dict = {}
        self._dp: dict = {}
        self._p2p: dict = {}
        self._loss: dict = {}
        self.eager = stack.software == eager.SOFTWARE  # eager.py's launch and FSDP terms
        self.host_s = eager.host_op_s(cluster.gpu.name)[0] if self.eager else 0.0

    def micro_terms(self, lay: Layout) -> ComputeTerms:
        """One micro-batch's compute on the busiest stage (no optimizer)."""
        key = (
            lay.tp,
            lay.pp,
            lay.micro_batch,
            lay.recompute,
            lay.sequence_parallel,
            lay.cp,
            lay.cp_impl,
            lay.pp_split,
        )
        t = self._micro.get(key)
        if t is None:
            one = Layout(
                tp=lay.tp,
                pp=lay.pp,
                recompute=lay.recompute,
                micro_batch=lay.micro_batch,
                sequence_parallel=lay.sequence_parallel,
                cp=lay.cp,
                cp_impl=lay.cp_impl,
                pp_split=lay.pp_split,
            )
            t = _micro_terms(
                self.shape, one, self.dev, self.precision if self.fp8_gemms else "bf16", self.vb
            )
            if (
                self.fp8_factor != 1.0
            ):  # no FP8 kernel table (local check): the measured whole-step factor
                t = t.scaled(1 / self.fp8_factor)
            self._micro[key] = t
        return t

    def compute(self, lay: Layout) -> ComputeTerms:
        psi = params_per_gpu(self.shape, lay.tp, lay.pp, lay.pp_split)
        with_states = psi / lay.shard_group if lay.zero_stage >= 1 else psi
        local = psi / lay.shard_group if lay.zero_stage >= 2 else psi
        opt = optimizer_s(with_states, local, self.dev) / self.fp8_factor
        terms = self.micro_terms(lay).times(lay.grad_accum, optimizer=opt)
        if self.eager:  # mixed precision's weight and weight-gradient casts (eager.weight_cast_s)
            terms = replace(
                terms, memory=terms.memory + eager.weight_cast_s(self.shape, lay, self.dev)
            )
        if lay.grad_accum > 1 and self.stack.software in eager.ACCUMULATING_SOFTWARE:
            add = eager.grad_accum_s(local, lay.grad_accum, self.dev)
            terms = replace(terms, memory=terms.memory + add)
        return terms

    def _tp_parts(self, lay: Layout) -> tuple[float, float, float, float]:
        """(TP traffic of one micro-batch, one all-gather, one reduce-scatter of a layer's
        activation, the copy engines' HBM share of a hidden transfer)."""
        key = (
            lay.tp,
            lay.pp,
            lay.micro_batch,
            lay.recompute,
            lay.sequence_parallel,
            lay.cp,
            lay.pp_split,
        )
        cached = self._tp.get(key)
        if cached is None:
            link = group_link(self.cluster, lay.tp, 1, multi_rail=False)
            one = Layout(
                tp=lay.tp,
                pp=lay.pp,
                recompute=lay.recompute,
                micro_batch=lay.micro_batch,
                sequence_parallel=lay.sequence_parallel,
                pp_split=lay.pp_split,
            )
            local = (
                self.shape
                if lay.cp == 1
                else replace(self.shape, seq_len=self.shape.seq_len // lay.cp)
            )
            gather = 1 if self.fp8_tp_gather else None
            k = self.calib.tp_overhead.value
            values = volume.tp_activation_bytes(lay.micro_batch, local.seq_len, local.d_model, 1)
            cached = self._tp[key] = (
                tp_comm_time(local, one, link, self.vb, gather) * k,
                # TE's overlaps (tp_overlap.py): one gather and one reduce-scatter, the HBM the
                # copy engines' copies take
                all_gather_time(values * (gather or self.vb), lay.tp, link) * k,
                reduce_scatter_time(values * self.vb, lay.tp, link) * k,
                self.overlap_cost(link, None, COPY_ENGINE_HBM_PASSES),
            )
        return cached

    def tp_overlap(self, lay: Layout, gemm_s: float) -> TPOverlap:
        """The step's TP traffic split into exposed, hidden, SM and copy costs: TE's overlaps by
        their mechanism (``tp_overlap.step_overlap``) with ``stack.tp_overlap`` and sequence
        parallelism (Megatron asserts it for --tp-comm-overlap), else all exposed."""
        if lay.tp <= 1:
            return TPOverlap()
        per_micro, gather, scatter, copy_share = self._tp_parts(lay)
        if not (self.stack.tp_overlap and lay.sequence_parallel):
            return TPOverlap(exposed=per_micro * lay.grad_accum)
        layers = stage_layers(self.shape, lay.pp, lay.pp_split)
        sms = gpu_sms(self.cluster.gpu.name) if self.gpu_table else None
        return step_overlap(self.shape, lay, layers, gemm_s, gather, scatter, sms, copy_share)

    def tp_comm(self, lay: Layout, gemm_s: float) -> float:
        if lay.tp <= 1:
            return 0.0
        if self.stack.tp_overlap:
            return self.tp_overlap(lay, gemm_s).total
        t = self._tp_parts(lay)[0] * lay.grad_accum
        if self.stack.async_tp:  # torchtitan's AsyncTP: its own measured share
            t -= min(self.calib.async_tp_hidden.value * t, gemm_s)
        return t

    def cp_comm(self, lay: Layout, attention_s: float) -> float:
        """Exposed context-parallel traffic of a step on the busiest stage: per layer and
          micro-batch ring  cp−1 sends of the rank's K and V chunk forward, twice that backward (K,
          V again and their
                gradients), a third pass with full recompute; behind the attention at
                ``overlap_cost`` (cp_overlap as the share of the NCCL kernel's time not lost to its
                SMs)
          ulysses   all-to-alls of q, k, v and the output forward, of their gradients backward, not
                    hidden; k/v heads repeated to ``ulysses_kv_heads`` as the trainer does, a
                    pass priced by ``all_to_all_time``
          torch     PyTorch's context_parallel (its default rotate method, torchtitan's and
                    dtrain's): per pass
                    (forward, backward, the recompute's forward) one all-gather of K and V, as the
                    SDPA gets them: repeated to the query heads (torchtitan's and dtrain's models
                    repeat before SDPA); hidden behind the first of the pass's cp kernel calls.
                    Backward also sends the fp32 dK, dV chunk around the ring cp times, each behind
                    one call, the last exposed
        over the cp group's link (cp ranks tp apart, one NIC each across nodes)."""
        if lay.cp <= 1:
            return 0.0
        b, s, cp, t = lay.micro_batch, self.shape.seq_len, lay.cp, lay.tp
        hd = self.shape.d_model // self.shape.n_head
        kv = volume.tp_kv_heads(self.shape.n_kv_head, t)  # heads on a TP rank
        q = max(self.shape.n_head // t, 1)
        link = group_link(self.cluster, cp, t, multi_rail=False)
        recompute = (
            1 if lay.recompute == "full" else 0
        )  # full recompute runs the forward's traffic again
        layers = stage_layers(self.shape, lay.pp, lay.pp_split)
        if (
            lay.cp_impl == "torch"
        ):  # exposure per kernel call: fwd 1/3.5 of the attention, bwd 2.5/3.5 (its count)
            call = attention_s / (layers * lay.grad_accum * cp * 3.5)
            kv_all = volume.cp_all_gather_kv_bytes(b, s, cp, q, hd, self.vb)  # repeated to q heads
            gather = all_gather_time(kv_all, cp, link)
            dkv = p2p_time(volume.ring_kv_block_bytes(b, s, cp, q, hd, 4), link)  # fp32 dK, dV
            per_layer = (
                (1 + recompute) * max(gather - call, 0.0)
                + max(gather - 2.5 * call, 0.0)
                + (cp - 1) * max(dkv - 2.5 * call, 0.0)
                + dkv
            )
            return per_layer * layers * lay.grad_accum
        if lay.cp_impl == "ulysses":
            # a pass's four all-to-alls priced as one of their bytes: α once per pass, as the plan's
            # figures always were (the trainer issues four; fusing q, k, v is the common kernel)
            pieces = volume.ulysses_all_to_all_payloads(b, s, cp, q, kv, hd, self.vb)
            per_pass = all_to_all_time(sum(pieces), cp, link)
            return volume.ulysses_passes(lay.recompute) * per_pass * layers * lay.grad_accum
        chunk = volume.ring_kv_block_bytes(b, s, cp, kv, hd, self.vb)  # the ring: the rank's K, V
        sends = volume.ring_sends_per_layer(cp, lay.recompute)
        total = sends * p2p_time(chunk, link) * layers * lay.grad_accum
        return total - (1 - self.overlap_cost(link, self.calib.cp_overlap)) * min(
            total, attention_s
        )

    def overlap_cost(self, link, overlap: Param | None, passes: int = RING_HBM_PASSES) -> float:
        """Share of a transfer's time over ``link`` still paid while it runs behind compute
        (``collectives.overlap_cost``): the SM share of its NCCL kernel, 1 − ``overlap``
        (dp_overlap, cp_overlap; None: copy engines, no SMs), plus the HBM its copies take on a
        GPU with a kernel table, unless ``overlap`` was measured (a measured share holds both)."""
        hbm = self.gpu_table and not (overlap is not None and overlap.measured)
        sm = 0.0 if overlap is None else 1 - overlap.value
        return overlap_cost(link, self.cluster.gpu.hbm_tbps * 1e12 if hbm else None, sm, passes)

    def p2p(self, lay: Layout) -> float:
        intra = lay.gpus <= self.cluster.node_size
        key = (lay.micro_batch, lay.tp, intra, lay.cp)
        t = self._p2p.get(key)
        if t is None:
            shape = self.shape
            act = volume.pp_activation_bytes(
                lay.micro_batch, shape.seq_len, shape.d_model, self.vb, lay.cp, lay.tp
            )
            t = self._p2p[key] = p2p_time(act, self.cluster.nvlink if intra else self.cluster.ib)
        return t

    def _engine_extras(self, lay: Layout) -> tuple[float, float]:
        """DeepSpeed's pipeline engine: (one all-gather over TP of a partitioned activation,
        ReduceTiedGrads' all-reduce of a tied embedding's gradient between the end stages)."""
        key = ("engine", lay.tp, lay.micro_batch, lay.cp, lay.gpus <= self.cluster.node_size)
        if key not in self._p2p:
            self._p2p[key] = self._engine_parts(lay)
        return self._p2p[key]

    def _engine_parts(self, lay: Layout) -> tuple[float, float]:
        shape = self.shape
        full = volume.pp_activation_bytes(lay.micro_batch, shape.seq_len, shape.d_model, self.vb)
        tp_link = group_link(self.cluster, lay.tp, 1, multi_rail=False)
        gather = all_gather_time(full / lay.cp, lay.tp, tp_link) if lay.tp > 1 else 0.0
        tied = 0.0
        if shape.tied_embeddings:
            grads = shape.vocab * shape.d_model / lay.tp * self.stack.grad_bytes
            ends = self.cluster.nvlink if lay.gpus <= self.cluster.node_size else self.cluster.ib
            tied = allreduce_time(grads, 2, ends)
        return gather, tied

    def dp(self, lay: Layout) -> tuple[float, float, float, float]:
        """(gradient traffic, weight traffic, the loss all-reduce) per step over DP, and the
        overlap cost of that traffic on its link (``overlap_cost``)."""
        n = (
            lay.data_shards
        )  # gradients reduce over dp x cp, ZeRO shards over it (the cp ranks sit inside, tp apart)
        key = (n, lay.tp, lay.pp, lay.zero_stage, lay.grad_accum, lay.dp_replicate, lay.pp_split)
        t = self._dp.get(key)
        if t is None:
            r = lay.hsdp_replicate  # the group: n data shards, cp folded in
            group = Layout(
                dp_replicate=r,
                dp_shard=n // r,
                tp=lay.tp,
                pp=lay.pp,
                zero_stage=lay.zero_stage,
                grad_accum=lay.grad_accum,
                pp_split=lay.pp_split,
            )
            g, w = dp_comm_time(
                self.shape,
                group,
                self.cluster,
                self.vb,
                self.fp8_fsdp_gather,
                max(self.vb, self.stack.grad_bytes),
                self.stack.runs.zero2_regathers,
            )
            loss_link = group_link(self.cluster, n, lay.tp, multi_rail=True)
            loss = allreduce_time(volume.LOSS_BYTES, n, loss_link) if n > 1 else 0.0
            t = self._dp[key] = (
                g,
                w,
                loss,
                self.overlap_cost(dp_link(self.cluster, group), self.calib.dp_overlap),
            )
        return t

    def lower_bound(self, lay: Layout) -> float:
        """A step is never shorter than its micro-batches' compute, TP and PP traffic and bubble
        (what DP overlap cannot shorten): ``search`` orders and prunes by it."""
        micro = self.micro_terms(lay)
        m = lay.grad_accum
        work = micro.total * m
        comm = self.tp_comm(lay, micro.gemm * m) + self.cp_comm(lay, micro.attention * m)
        return work + comm + self._pipeline(lay, work, comm)[1]

    def _pipeline(self, lay: Layout, work: float, tp_comm: float) -> tuple[float, float]:
        """(pp_comm, pp_comm + bubble)."""
        if lay.pp <= 1:
            return 0.0, 0.0
        m = lay.grad_accum
        if self.stack.runs.pipeline_engine == "deepspeed":  # its blocking transfers: see the module
            pp_comm = engine_comm(lay.pp, m, self.p2p(lay), *self._engine_extras(lay))
        else:
            pp_comm = volume.pp_sends_per_step(lay.virtual_stages, m) * self.p2p(lay)
        frac = bubble_fraction(lay.pp, m, lay.virtual_stages, pipeline_slots(self.shape, lay))
        if lay.pp_schedule == "zbv":
            frac /= 3
        return pp_comm, pp_comm + frac * (work + tp_comm) * self.calib.pp_overhead.value

    def time(self, lay: Layout) -> StepTime:
        m = lay.grad_accum
        terms = self.compute(lay)
        compute = terms.total
        work = compute - terms.optimizer
        tp_comm = self.tp_comm(lay, terms.gemm)
        cp_comm = self.cp_comm(lay, terms.attention)
        pp_comm, pipe = self._pipeline(lay, work, tp_comm + cp_comm)
        bubble = pipe - pp_comm
        grad_comm, param_comm, loss, cost = self.dp(lay)
        dp_comm = grad_comm + param_comm
        if self.eager and lay.zero_stage == 3:  # FSDP2 block by block (eager.fsdp_hidden)
            units = stage_layers(self.shape, lay.pp, lay.pp_split) + 1
            hidden = eager.fsdp_hidden(param_comm, grad_comm, work, units, m)
        elif lay.zero_stage == 3 and lay.pp == 1 or lay.zero_stage == 2:
            hidden = min(dp_comm, work)
        # once per step: behind the last backward (+ the pipeline cooldown) and the first forward
        else:
            micro = work / m
            # FSDP under torch.distributed.pipelining (torchtitan, the trainer) reduces a stage's
            # gradients only after its last backward (PipelineStage's post_backward / REDUCE_GRAD
            # action): nothing left to hide behind on the first stage, which finishes last
            window = 0.0 if lay.zero_stage == 3 else 2 / 3 * micro + bubble / 2
            # DeepSpeed's pipeline engine (dp_sync "flush") runs both after the pipeline's flush:
            # behind nothing
            hidden = (
                0.0
                if self.stack.dp_sync == "flush"
                else min(grad_comm, window) + min(param_comm, micro / 3)
            )
        contention = hidden * cost  # what the overlapped traffic still takes from compute
        exposed = (
            dp_comm - hidden + contention + loss
        )  # + the step's loss averaged over DP for the log (latency)
        total = compute + tp_comm + cp_comm + pp_comm + bubble + exposed + self.overhead
        kernels = floor = 0
        if self.eager:  # the host issues the kernels one by one: the step is never shorter
            counts = eager.kernel_counts(
                self.shape, lay, optimizer=self.stack.optimizer or "foreach"
            )
            kernels = sum(counts.values())
            floor = eager.dispatch_floor_s(
                eager.host_launches(self.shape, lay, counts), self.host_s
            )
            total = max(total, floor)
        tokens = lay.dp * lay.micro_batch * m * self.shape.seq_len
        return StepTime(
            compute=compute,
            dp_comm=dp_comm,
            dp_comm_exposed=exposed,
            tp_comm=tp_comm,
            pp_comm=pp_comm,
            bubble=bubble,
            total=total,
            tokens=tokens,
            model_flops=tokens * self.flops_per_token,
            gpus=lay.gpus,
            peak_flops=self.cluster.gpu.peak_bf16_flops,
            overhead=self.overhead,
            terms=terms,
            cp_comm=cp_comm,
            dp_contention=contention,
            kernels=kernels,
            dispatch_floor=floor,
        )
