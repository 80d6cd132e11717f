"""The communication pieces of one step for one model on one cluster (``StepComm``, the base of
``timemodel.StepModel``): TP traffic, exposed or split by TE's overlaps; context-parallel traffic;
pipeline sends (and DeepSpeed's engine extras); DP traffic and the cost of overlapping it. Each is
kept per the few layout fields it depends on. Formulas and sources: ``timemodel``'s docstring."""

from __future__ import annotations

from dataclasses import replace

from dtrain.parallel import traffic as volume

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
from .comm_time import dp_comm_time, dp_link, tp_comm_time
from .hardware import Cluster
from .kernel_rates import published
from .shapes import Layout, ModelShape, stage_layers
from .stack import Stack
from .tp_overlap import TPOverlap, gpu_sms, step_overlap


def micro_layout(lay: Layout, context_parallel: bool = True) -> Layout:
    """The fields of ``lay`` that price one micro-batch on one rank (its compute, its TP
    traffic): the layout the per-micro-batch terms are computed at and cached by."""
    return Layout(
        tp=lay.tp,
        pp=lay.pp,
        recompute=lay.recompute,
        micro_batch=lay.micro_batch,
        sequence_parallel=lay.sequence_parallel,
        pp_split=lay.pp_split,
        **({"cp": lay.cp, "cp_impl": lay.cp_impl} if context_parallel else {}),
    )


class StepComm:
    """The traffic of ``step_time`` for one model on one cluster; each piece is kept per the layout
    fields it depends on."""

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
        self.gpu_table = (
            published(cluster.gpu.name) is not None
        )  # a GPU priced term by term (kernels.yaml)
        self.fp8_tp_gather, self.fp8_fsdp_gather = stack.fp8_gathers(precision)
        self._tp: dict = {}
        self._dp: dict = {}
        self._p2p: dict = {}

    def _tp_parts(self, lay: Layout) -> tuple[float, float, float, float]:
        """(TP traffic of one micro-batch, one all-gather, one reduce-scatter of a layer's
        activation, the copy engines' HBM share of a hidden transfer)."""
        one = micro_layout(lay, context_parallel=False)  # CP enters as the local sequence
        key = (one, lay.cp)
        cached = self._tp.get(key)
        if cached is None:
            link = group_link(self.cluster, lay.tp, 1, multi_rail=False)
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
                self.stack.runs.fsdp2,
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
