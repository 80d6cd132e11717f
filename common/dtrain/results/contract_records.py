"""The records of the calibration contract (``dtrain.results.contract``): the typed numbers an
experiment publishes for the cost model and the guide, one dataclass per ``kind``.

    record               published by                         feeds
    CollectiveFit        allreduce-bench                      α, β per link class
    TrainingMeasurement  fsdp-scaling runs, fp8-train runs    compute efficiency, DP overlap, local
                                                              checks
    TpMeasurement        tp-attention                         TP overhead, local checks
    CpMeasurement        tp-attention's CP study              CP (ring / all-to-all) overhead and
                                                              overlap
    Fp8Comparison        fp8-train compare (a derived run)    FP8 speed / memory factor, layers kept
                                                              high
    GemmProbe            dtrain.costmodel.gemm_probe (derived) GEMM efficiency curve, fixed step
                                                              overhead
    MoeMeasurement       fsdp-scaling runs of an MoE model    all-to-all share, overload (local
                                                              check of expert parallelism)

``RECORDS`` maps each kind to its dataclass; ``ContractError`` is what a record that breaks the
contract raises (here, and when ``contract.read`` decodes one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from dtrain.core.layout import Layout
from dtrain.model.args import MODEL_SHAPE


class ContractError(ValueError):
    """A summary's guide_inputs do not follow this contract (the message says where)."""


@dataclass(frozen=True)
class Where:
    """Where a measurement ran: every record has it (the calibration's provenance)."""

    device: str  # "cpu" | "cuda" (no index)
    backend: str  # gloo | nccl | none (no collective)
    gpu_name: str | None = None


def where_of(device, backend, gpu_name=None) -> Where:
    """A Where from a torch device (or its string) and a backend: ``cuda:0`` is recorded as
    ``cuda``."""
    return Where(str(device).split(":")[0], str(backend), gpu_name)


@dataclass(frozen=True)
class CollectiveFit:
    """t(S) = α + S·c/β of one collective over one link class (β is a bus bandwidth)."""

    kind: ClassVar[str] = "collective_fit"
    collective: str  # all_reduce | all_gather | reduce_scatter | ...
    link_class: str  # intra_node | inter_node
    dtype: str
    world_size: int  # ranks per group of the fit
    alpha_us: float  # latency of the whole collective
    beta_GBps: float
    r2: float
    n_points: int
    algo_factor: float  # c: bus bytes per message byte
    theoretical_GBps: float | None
    beta_pct_of_theoretical: float | None
    where: Where


@dataclass(frozen=True)
class StepBreakdown:
    """One profiled step on rank 0, seconds (dtrain.train profile window)."""

    step_s: float
    compute_s: float
    tp_comm_s: float
    pp_p2p_s: float
    dp_comm_s: float
    dp_comm_exposed_s: float
    idle_s: float
    cp_comm_s: float = (
        0.0  # context parallelism's ring sends / all-to-alls, exposed (0 in records before it)
    )
    ep_comm_s: float = 0.0  # expert parallelism's dispatch / combine all-to-alls (0 before it)


@dataclass(frozen=True)
class TrainingMeasurement:
    """One training run of the shared trainer: model, layout, step time and where it went.

    ``recipe`` is None for a plain run, which measures its own compute efficiency (``mfu`` against
    ``peak_flops``); a run of a numerics-recipe study (fp8-train: ``fp32``, ``emulated_delayed``,
    ...) names its recipe and is only predicted, not used to calibrate compute efficiency."""

    kind: ClassVar[str] = "training"
    model: dict  # dtrain.model.args.GPTConfig fields as trained (seq_len included)
    layout: Layout  # as the run laid it out (world_size = layout.gpus)
    strategy: str  # train.strategy as the run named it (the layout has its ZeRO stage)
    precision: str  # fp32 | bf16 | fp16: what is not an FP8 GEMM runs in
    step_time_s: float
    tokens_per_s: float
    peak_mem_bytes: int  # per rank (CPU: process RSS)
    where: Where
    recipe: str | None = None
    mfu: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str | None = None
    model_params: int | None = None
    flops_per_token: float | None = None
    comm_s: float | None = None  # DP communication per step (profile)
    exposed_comm_s: float | None = None  # of it, not hidden behind compute
    overlap_fraction: float | None = None
    breakdown: StepBreakdown | None = None
    # per-step tooling the run had on beyond training (fp8-train: guard, health, fp8_debug), which
    # the cost model does not model; [] in records written before it was published
    step_callbacks: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        bad = [
            k for k in MODEL_SHAPE if not isinstance(self.model.get(k), int) or self.model[k] < 1
        ]
        # checked here without importing torch (dtrain.model.gpt); GPTConfig(**model) checks the
        # rest
        if bad:
            raise ContractError(
                f"training: model is not a GPTConfig: {bad[0]}={self.model.get(bad[0])!r} "
                "must be an integer >= 1"
            )


@dataclass(frozen=True)
class TpMeasurement:
    """One tensor-parallel layer (attention or block), forward + backward, at one TP degree."""

    kind: ClassVar[str] = "tp_layer"
    module: str  # block | attention
    tp: int
    sequence_parallel: bool
    micro_batch: int
    seq_len: int
    d_model: int
    n_head: int
    n_kv_head: int
    mlp_ratio: int
    precision: str
    step_time_s: float  # one layer at this tp
    single_rank_step_time_s: float
    comm_share: float  # of step_time_s, TP communication (profile)
    comm_bytes_per_layer: int  # bus bytes, forward + backward
    overhead_factor: float  # step_time_s * tp / single_rank_step_time_s
    where: Where
    dtensor_step_time_s: float | None = None


@dataclass(frozen=True)
class CpMeasurement:
    """One context-parallel attention layer, forward + backward, at one cp degree and sequence
    length. Times are per layer on one rank; ``comm_bytes_per_layer`` is what one rank sends
    (counted =
    analytic, ``dtrain.parallel.cp.exchange``)."""

    kind: ClassVar[str] = "cp_layer"
    impl: str  # ring | ulysses
    cp: int
    seq_len: int  # the whole sequence; each rank holds seq_len / cp tokens
    micro_batch: int
    d_model: int
    n_head: int
    n_kv_head: int
    precision: str
    step_time_s: float  # one layer at this cp (the ring with its sends overlapped)
    single_device_step_time_s: float  # the whole sequence on one rank
    comm_bytes_per_layer: int
    saved_bytes: int  # activations autograd keeps for backward, per rank
    where: Where
    serial_step_time_s: float | None = (
        None  # ring: each send waited before the compute it could hide behind
    )
    overlap_fraction: float | None = (
        None  # ring: (serial - overlapped) / send time alone, in [0, 1]
    )
    tp_sp_step_time_s: float | None = (
        None  # TP with sequence parallelism at tp = cp (the alternative)
    )


@dataclass(frozen=True)
class Fp8Comparison:
    """One FP8 recipe against a high-precision baseline over several seeds."""

    kind: ClassVar[str] = "fp8_comparison"
    recipe: str
    baseline: str
    speedup: float  # tokens/s recipe / baseline
    memory_factor: float  # peak memory recipe / baseline
    within_noise: bool  # final loss inside the baseline's seed band
    emulated: bool  # no FP8 hardware: the speed-up is emulation overhead
    final_loss_mean: float
    final_loss_std: float
    seeds: int
    keep_high_precision: list[str]
    where: Where


@dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    count: int
    flops: float
    seconds: float  # flops / (fraction x peak_flops): the GEMM on the idle host
    fraction: float  # of the peak (CPU: median ratio to the reference matmul timed around it)


@dataclass(frozen=True)
class StepOverhead:
    """The fixed per-step cost of one model, seconds: one training step at the model's real size
    minus the time the fitted GEMM curve gives its GEMMs (``dtrain.costmodel.gemm_probe``)."""

    model_kind: str  # gpt | block | attention
    config: dict
    micro_batch: int
    tp: int
    overhead_s: float  # max(step_s - gemm_s, 0)
    step_s: float | None = None  # the measured step (None in records written before it was kept)
    gemm_s: float | None = None  # the curve's time for its GEMMs


@dataclass(frozen=True)
class GemmProbe:
    """f(W) = e_max·W/(W + W_half) fitted over the runs' GEMM shapes, plus fixed step overheads."""

    kind: ClassVar[str] = "gemm_probe"
    dtype: str
    peak_flops: float
    peak_flops_source: str
    points: list[GemmPoint]
    overheads: list[StepOverhead]
    e_max: float | None
    w_half: float | None
    where: Where
    rejected: list[GemmPoint] = dataclasses.field(
        default_factory=list
    )  # above the roofline: measurement errors
    probe_load: float | None = (
        None  # load factor while the probe ran (dtrain.run.hostload); CPU only
    )
    loads: list[RunLoad] = dataclasses.field(
        default_factory=list
    )  # each probed run's, from the capstone


@dataclass(frozen=True)
class RunLoad:
    """How much foreign load slowed one run's timed steps (``dtrain.run.hostload.load_factor``)."""

    run: str  # relative to the results folder the probe read
    busy_threads: int  # ranks x threads per rank
    load_factor: float  # median over the window; 1 = as on an idle host
    low: float  # 10th percentile
    high: float  # 90th percentile
    samples: int


@dataclass(frozen=True)
class MoeMeasurement:
    """A training run of an MoE model, its expert-parallel figures: what the guide's local check
    compares with the cost model's all-to-all share and imbalance. An MoE run publishes only this
    record (no ``training`` one), so calibrating dense compute efficiency never reads it.
    ``a2a_s`` and ``profiled_step_s`` are rank 0's, per optimizer step, from the profile window;
    ``a2a_share`` = a2a_s / profiled_step_s."""

    kind: ClassVar[str] = "moe_run"
    model: dict  # dtrain.model.args.GPTConfig fields, ``moe`` included (experts, top_k, ...)
    layout: Layout  # ep, and the data ranks it folds from
    precision: str
    tokens_per_step: int  # global batch x seq_len
    step_time_s: float  # median over the timed steps
    profiled_step_s: float
    a2a_s: float  # ep_comm: the token-count exchanges, dispatches and combines, fwd + bwd
    a2a_share: float
    overload: float  # Megatron's: busiest ep rank's (expert's at ep 1) rows / balanced, mean
    expert_overload: float  # busiest expert's assignments / balanced, mean over timed steps
    dropped_frac: float  # assignments dropped over capacity (0: dropless)
    where: Where


RECORDS = {
    c.kind: c
    for c in (
        CollectiveFit,
        TrainingMeasurement,
        MoeMeasurement,
        TpMeasurement,
        CpMeasurement,
        Fp8Comparison,
        GemmProbe,
    )
}
