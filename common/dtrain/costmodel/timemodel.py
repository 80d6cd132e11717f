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

from dataclasses import replace
from functools import lru_cache

from dtrain.parallel import traffic as volume

from . import eager
from .calibration import Calibration
from .comm_time import root_gather_bytes, root_gathers_saved, weight_gathers_per_step
from .compute import (
    ComputeTerms,
    _micro_terms,
    fp8_shard_cast_s,
    fp8_weight_casts,
    optimizer_s,
)
from .device_rates import device_of
from .hardware import Cluster
from .model_states import embedding_params_per_gpu, params_per_gpu
from .pipeline_engine import engine_comm, hp_grad_update_s
from .shapes import Layout, ModelShape, pipeline_slots, stage_layers
from .stack import Stack
from .step_breakdown import StepTime
from .step_comm import StepComm, micro_layout
from .token_flops import model_flops_per_token

__all__ = [
    "StepModel",
    "bubble_fraction",
    "step_time",
    "step_model",
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
              (ceil(L/pp) blocks + the root), FSDP2's root (embeddings, output) gathered once a
              micro-batch (``comm_time.root_gathers_saved``). HSDP (``Layout.dp_replicate``
              R > 1): the gathers and reduce-scatters run inside a replica group of dp·cp/R
              ranks, each reduce-scatter
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


class StepModel(StepComm):
    """``step_time`` for one model on one cluster; each piece is kept per the layout fields it
    depends on (the traffic's: ``StepComm``)."""

    def __init__(
        self,
        shape: ModelShape,
        cluster: Cluster,
        calib: Calibration,
        precision: str,
        value_bytes: int,
        stack: Stack,
    ):
        super().__init__(shape, cluster, calib, precision, value_bytes, stack)
        self.dev = device_of(cluster, calib, stack)
        self.fp8_gemms = precision == "fp8" and "fp8" in self.dev.kernels.gemm
        self.fp8_factor = (
            calib.fp8_speedup.value if precision == "fp8" and not self.fp8_gemms else 1.0
        )
        self.overhead = calib.step_overhead_s.value / (1.0 if self.gpu_table else self.fp8_factor)
        self.flops_per_token = model_flops_per_token(shape)
        self._micro: dict = {}
        self._loss: dict = {}
        self.eager = stack.software == eager.SOFTWARE  # eager.py's launch and FSDP terms
        self.host_s = eager.host_op_s(cluster.gpu.name)[0] if self.eager else 0.0
        # torchao's casts run op by op: their launches are the host's too
        self.fp8_eager = self.fp8_gemms and self.dev.fp8_scaling == "eager"

    def micro_terms(self, lay: Layout) -> ComputeTerms:
        """One micro-batch's compute on the busiest stage (no optimizer)."""
        one = micro_layout(lay)
        if lay.zero_stage >= 2:  # FSDP's bf16 parameters and FP8 weight gather: layer_terms
            one = replace(one, zero_stage=2)
        t = self._micro.get(one)
        if t is None:
            t = _micro_terms(
                self.shape, one, self.dev, self.precision if self.fp8_gemms else "bf16", self.vb
            )
            if (
                self.fp8_factor != 1.0
            ):  # no FP8 kernel table (local check): the measured whole-step factor
                t = t.scaled(1 / self.fp8_factor)
            self._micro[one] = t
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
        precision = "fp8" if self.fp8_gemms else "bf16"
        if fp8_weight_casts(self.dev, precision, lay.zero_stage) == "gathered":
            gathers = weight_gathers_per_step(lay, self.stack.runs.zero2_regathers)
            cast = fp8_shard_cast_s(self.shape, lay, self.dev, gathers)
            terms = replace(terms, memory=terms.memory + cast)
        return terms

    def grad_accum_s(self, lay: Layout) -> float:
        """The passes that accumulate a step's gradients outside the GEMMs: PyTorch's
        AccumulateGrad on the PyTorch stacks (``eager.grad_accum_s``), FSDP2's unsharded
        accumulation under PP (``eager.unsharded_grad_accum_s``); under DeepSpeed's engine
        (ZeRO-0/1) its BF16_Optimizer's fp32 copy every micro-batch when the gradients accumulate
        in fp32 (``pipeline_engine.hp_grad_update_s``), else AccumulateGrad in the 16-bit
        gradients. Megatron fuses them into the weight-gradient GEMM."""
        m, grad_bytes = lay.grad_accum, self.stack.grad_bytes
        psi = params_per_gpu(self.shape, lay.tp, lay.pp, lay.pp_split)
        if self.stack.software in eager.ACCUMULATING_SOFTWARE:  # fp32 weights: an fp32 .grad
            if lay.pp > 1 and lay.zero_stage >= 2:  # synced on the last micro-batch only
                return eager.unsharded_grad_accum_s(psi, m, self.dev, grad_bytes)
            local = psi / lay.shard_group if lay.zero_stage >= 2 else psi
            return eager.grad_accum_s(local, m, self.dev)
        if self.stack.runs.pipeline_engine != "deepspeed" or lay.zero_stage > 1:
            return 0.0
        if grad_bytes == 4:
            return hp_grad_update_s(psi, m, self.dev)
        return eager.grad_accum_s(psi, m, self.dev, grad_bytes)

    def fsdp2_copy_out_s(self, lay: Layout) -> float:
        """FSDP2's copy-outs of the step's weight all-gathers (``eager.fsdp2_copy_out_s``): as
        often as the weights are gathered (``weight_gathers_per_step``, the root once a
        micro-batch under ZeRO-3), the bytes gathered (the linears' in FP8 with the FP8 weight
        gather)."""
        if not self.stack.runs.fsdp2 or lay.zero_stage < 2 or lay.shard_group <= 1:
            return 0.0
        psi = params_per_gpu(self.shape, lay.tp, lay.pp, lay.pp_split)
        kept = (
            embedding_params_per_gpu(self.shape, lay.tp, lay.pp) if self.fp8_fsdp_gather else None
        )
        gathered = volume.zero_gather_bytes(psi, self.vb, kept)
        gathers = weight_gathers_per_step(lay, self.stack.runs.zero2_regathers)
        root = root_gather_bytes(self.shape, lay, self.vb)
        return eager.fsdp2_copy_out_s(gathered, gathers, self.dev) - eager.fsdp2_copy_out_s(
            root, root_gathers_saved(lay, True), self.dev
        )  # the root's copy-out once a micro-batch under ZeRO-3 (root_gathers_saved)

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
        # memory-bound passes, named apart in StepTime
        accum, copy_out = self.grad_accum_s(lay), self.fsdp2_copy_out_s(lay)
        if accum or copy_out:
            terms = replace(terms, memory=terms.memory + accum + copy_out)
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
        work = total
        if self.eager:  # the host issues the kernels one by one: the step is never shorter
            counts = eager.kernel_counts(
                self.shape, lay, optimizer=self.stack.optimizer or "foreach", fp8=self.fp8_eager
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
            gpu_work=work if self.eager else 0.0,
            grad_accum=accum,
            fsdp_copy_out=copy_out,
        )
