"""TP (``tp_comm_time``) and DP / ZeRO (``dp_comm_time``) traffic of one step as α–β times, for
``timemodel.StepModel`` to place on the critical path or behind compute. The bytes come from
``dtrain.parallel.traffic``, the formulas the trainer's counted-bytes checks use too. Sources are
in ``timemodel``'s docstring (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2; Rajbhandari
et al. 2020 §7)."""

from __future__ import annotations

from functools import lru_cache

from dtrain.parallel import traffic as volume

from .collectives import all_gather_time, allreduce_time, group_link, reduce_scatter_time
from .hardware import Cluster, LinkModel
from .model_states import embedding_params_per_gpu, params_per_gpu
from .shapes import Layout, ModelShape, stage_layers


def tp_comm_time(
    shape: ModelShape,
    layout: Layout,
    link: LinkModel,
    value_bytes: int = 2,
    gather_bytes: int | None = None,
) -> float:
    """α–β TP communication of one step on the busiest stage, before ``Calibration.tp_overhead``:
    ceil(L/pp) layers · m micro-batches · (4, or 6 with full recompute) ring all-reduces of b·s·h
    values (Shoeybi et al. 2019 §3; SP's all-gather + reduce-scatter pairs move the same volume).
    Selective op AC re-runs wo and so the all-reduce after it (5), except with SP, whose
    reduce-scatter output torchtitan's policy saves (4). ``gather_bytes``: bytes per value of SP's
    all-gathers when they move FP8 (``Stack.fp8_all_gather``; the reduce-scatters keep
    ``value_bytes``)."""
    if layout.tp <= 1:
        return 0.0
    n_coll = volume.tp_collectives_per_layer(layout.recompute, layout.sequence_parallel)
    b, s, h, tp = layout.micro_batch, shape.seq_len, shape.d_model, layout.tp
    values = volume.tp_activation_bytes(b, s, h, value_bytes)
    if gather_bytes is not None and layout.sequence_parallel:
        gathered = volume.tp_activation_bytes(b, s, h, gather_bytes)
        pair = all_gather_time(gathered, tp, link) + reduce_scatter_time(values, tp, link)
    else:
        pair = allreduce_time(values, tp, link)
    return stage_layers(shape, layout.pp, layout.pp_split) * layout.grad_accum * n_coll * pair


@lru_cache(maxsize=1 << 14)
def dp_link(cluster: Cluster, lay: Layout) -> LinkModel:
    """The link the DP (shard) group's gathers and reduce-scatters run over: ``lay.shard_group``
    ranks ``lay.tp`` apart, one ring per NIC across nodes."""
    return group_link(cluster, lay.shard_group, lay.tp, multi_rail=True)


@lru_cache(maxsize=1 << 14)
def dp_comm_time(
    shape: ModelShape,
    lay: Layout,
    cluster: Cluster,
    value_bytes: int,
    fp8_weights: bool = False,
    grad_bytes: int = 4,
    zero2_regathers: bool = False,
    root_once: bool = False,
) -> tuple[float, float]:
    """(gradient-side, parameter-side) DP traffic seconds per step over the DP group (see
    ``step_time``); ``fp8_weights``: the block linears' weights are gathered in FP8, 1 byte each
    (``Stack.fp8_all_gather``); ``grad_bytes``: 4 for an fp32 gradient reduction, 2 for a bf16
    one (``Stack.grad_reduce``); ``zero2_regathers``: ZeRO-2 as FSDP2 runs it, the weights
    gathered for every micro-batch (``Software.zero2_regathers``), not once a step;
    ``root_once``: FSDP2's root unit gathered once a micro-batch under ZeRO-3
    (``root_gathers_saved``)."""
    if lay.dp <= 1:
        return 0.0, 0.0
    psi = params_per_gpu(shape, lay.tp, lay.pp, lay.pp_split)
    grads = volume.dp_grad_bytes(psi, grad_bytes)
    kept = embedding_params_per_gpu(shape, lay.tp, lay.pp) if fp8_weights else None
    weights = volume.zero_gather_bytes(psi, value_bytes, kept)
    n, r = (
        lay.shard_group,
        lay.dp_replicate,
    )  # HSDP: shard inside a group, all-reduce the shards across groups
    link = dp_link(cluster, lay)
    ag = all_gather_time(weights, n, link)
    rs = reduce_scatter_time(grads, n, link)
    if r > 1:
        across = group_link(cluster, r, lay.tp * n, multi_rail=True)
        rs += allreduce_time(volume.hsdp_replica_bytes(grads, n), r, across)
    m = lay.grad_accum
    gathers = weight_gathers_per_step(lay, zero2_regathers)
    if lay.zero_stage == 0:
        return allreduce_time(grads, lay.dp, link), 0.0
    if lay.zero_stage == 1 or (lay.zero_stage == 3 and lay.pp > 1):
        return rs, gathers * ag
    if lay.zero_stage == 2:
        return m * rs, gathers * ag
    units = (
        stage_layers(shape, lay.pp, lay.pp_split) + 1
    )  # FSDP: a unit per block + the root; α per unit
    lat_ag, lat_rs = (
        (units - 1) * (n - 1) * link.of(c).alpha_s for c in ("all_gather", "reduce_scatter")
    )
    saved = root_gathers_saved(lay, root_once)
    root_share = 0.0  # the root's part of one gather: what each saved gather does not move
    if saved:
        root_share = ag - all_gather_time(
            weights - root_gather_bytes(shape, lay, value_bytes), n, link
        )
    return m * (rs + lat_rs), gathers * (ag + lat_ag) - saved * root_share


def weight_gathers_per_step(lay: Layout, zero2_regathers: bool = False) -> int:
    """How often one step gathers each weight over the shard group: ZeRO-1 once (after the
    optimizer), and ZeRO-3 under PP (a stage keeps its weights gathered across micro-batches);
    ZeRO-2 once, or for every micro-batch where FSDP2 runs it (``zero2_regathers``); ZeRO-3 twice a
    micro-batch (forward, and again for backward); ZeRO-0 never."""
    if lay.zero_stage == 0:
        return 0
    if lay.zero_stage == 1 or (lay.zero_stage == 3 and lay.pp > 1):
        return 1
    if lay.zero_stage == 2:
        return lay.grad_accum if zero2_regathers else 1
    return 2 * lay.grad_accum


def root_gathers_saved(lay: Layout, root_once: bool) -> int:
    """Gathers of the root unit's weights (the embeddings and output projection: what no block
    holds) that ``weight_gathers_per_step`` counts but FSDP2 does not make (``root_once``:
    ``Software.fsdp2``). Its lazy init keeps the root gathered from forward to backward
    (``post_forward_mesh_info = None``), so under ZeRO-3 without PP the root is gathered once a
    micro-batch, the blocks twice: counted on two CPU ranks by ``dtrain.gpucheck.fsdp_copy_out``
    (blocks 2 copy-outs a forward and backward, the root 1)."""
    return lay.grad_accum if root_once and lay.zero_stage == 3 and lay.pp == 1 else 0


def root_gather_bytes(shape: ModelShape, lay: Layout, value_bytes: int) -> float:
    """Bytes of one gather of the root unit (the embedding matrices, never in FP8)."""
    return volume.zero_gather_bytes(embedding_params_per_gpu(shape, lay.tp, lay.pp), value_bytes)
