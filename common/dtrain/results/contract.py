"""The calibration contract: what an experiment publishes for the cost model and the guide.

Each experiment's ``finalize`` returns ``"guide_inputs": [records]`` (dataclasses below);
``dtrain.results.metrics.write_summary`` encodes them into ``summary.json`` as

    "guide_inputs": {"schema_version": 2, "records": [{"kind": "<record kind>", ...fields}, ...]}

and ``read(summary)`` turns them back into dataclasses, refusing unknown kinds, unknown or missing
fields and a newer schema with ``ContractError``. Schema 2 stores a training run's layout as the
one layout type, ``dtrain.core.layout.Layout``; a schema-1 record (the trainer's names: dp,
strategy, activation checkpointing) is upgraded on reading by ``_training_v1``, the one place that
knows
them. Calibration (``dtrain.costmodel.calibrate``), the local checks (``dtrain.guide.local_check``)
and the GEMM probe read runs only through these records, never an experiment's name or its
config.yaml, so a new experiment that publishes them is calibrated like the four here.

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

Runs made from other runs (a study report, an FP8 comparison, the GEMM probe) are written by
``dtrain.results.derived.write_derived_run``, which records the run directories they came from in
``summary["derived_from"]``; they publish only what they derived, never copies of their sources'
records, so every measurement reaches calibration exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from dataclasses import dataclass
from typing import ClassVar

from dtrain.core.layout import STRATEGIES, Layout, recompute_of, schedule_of

SCHEMA_VERSION = 2
KEY = "guide_inputs"
DERIVED_FROM = "derived_from"


class ContractError(ValueError):
    """A summary's guide_inputs do not follow this contract (the message says where)."""


@dataclass(frozen=True)
class Where:
    """Where a measurement ran: every record has it (the calibration's provenance)."""

    device: str  # "cpu" | "cuda" (no index)
    backend: str  # gloo | nccl | none (no collective)
    gpu_name: str | None = None


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
class _TrainLayoutV1:
    """Schema 1's layout of a training record, in the trainer's names: read only, to upgrade it
    (``_training_v1``); schema 2 records a ``dtrain.core.layout.Layout``."""

    world_size: int
    dp: int
    tp: int
    pp: int
    strategy: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    recompute: str = "none"  # train.activation_checkpointing: none | op | block
    sequence_parallel: bool = False
    pp_schedule: str | None = None  # train.pp_schedule (None without a pipeline)
    pp_virtual: int = 1
    cp: int = 1  # 1 in records written before context parallelism


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


MODEL_SHAPE = (
    "vocab_size",
    "seq_len",
    "n_layer",
    "n_head",
    "n_kv_head",
    "d_model",
    "mlp_ratio",
)  # GPTConfig's


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


# ---------------------------------------------------------------- encoding


def encode(records) -> dict:
    """The summary.json value for ``records`` (what ``write_summary`` stores under ``KEY``)."""
    out = []
    for r in records:
        if type(r) not in RECORDS.values():
            raise ContractError(
                f"{type(r).__name__} is not a guide-input record ({', '.join(RECORDS)})"
            )
        out.append({"kind": r.kind, **dataclasses.asdict(r)})
    return {"schema_version": SCHEMA_VERSION, "records": out}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_scalar(value, hint, where: str):
    if value is None:
        if type(None) not in typing.get_args(hint):
            raise ContractError(f"{where} is null but must be {getattr(hint, '__name__', hint)}")
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = (
        args[0]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
        else hint
    )
    if dataclasses.is_dataclass(base):
        return _build(base, value, where)
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base)
        if not isinstance(value, list):
            raise ContractError(f"{where} must be a list")
        return [_check_scalar(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if base is float:
        if not _is_number(value) or not math.isfinite(value):
            raise ContractError(f"{where}={value!r} must be a finite number")
        return float(value)
    if base is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ContractError(f"{where}={value!r} must be an integer")
        return value
    if base in (str, bool, dict) and not isinstance(value, base):
        raise ContractError(f"{where}={value!r} must be a {base.__name__}")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ContractError(f"{where} must be a JSON object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - {"kind"})
    if unknown:
        raise ContractError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ContractError(f"{where}: missing field {f.name}")
            continue
        kwargs[f.name] = _check_scalar(data[f.name], hints[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except ContractError:
        raise
    except ValueError as e:  # a record's own rules (a Layout's degrees, its vocabularies)
        raise ContractError(f"{where}: {e}") from None


def _training_v1(rec: dict, where: str) -> dict:
    """A schema-1 training record as schema 2 writes it: its layout in the trainer's names
    (``_TrainLayoutV1``) becomes a ``dtrain.core.layout.Layout``, its strategy a field of the
    record. Schema 1 kept no ``hsdp_replicate``: an hsdp run becomes ZeRO-3 over all its data shards
    (as
    it was priced then); activation checkpointing ``block`` becomes recompute ``full``."""
    old = _build(_TrainLayoutV1, rec.get("layout"), f"{where}.layout")
    if old.strategy not in STRATEGIES:
        raise ContractError(
            f"{where}.layout.strategy={old.strategy!r} must be one of {', '.join(STRATEGIES)}"
        )
    if old.dp * old.cp * old.tp * old.pp != old.world_size:
        raise ContractError(
            f"{where}.layout: world_size={old.world_size} is not dp x cp x tp x pp "
            f"= {old.dp} x {old.cp} x {old.tp} x {old.pp}"
        )
    model = rec.get("model")
    if isinstance(model, dict) and model.get("seq_len") != old.seq_len:
        raise ContractError(
            f"{where}.layout.seq_len={old.seq_len} is not the model's "
            f"seq_len={model.get('seq_len')!r}"
        )
    piped = old.pp > 1
    schedule = old.pp_schedule if piped and old.pp_schedule else "1f1b"
    try:
        layout = Layout.from_strategy(
            old.strategy,
            dp=old.dp,
            cp=old.cp,
            tp=old.tp,
            pp=old.pp,
            recompute=recompute_of(old.recompute, default="none"),
            micro_batch=old.micro_batch,
            grad_accum=old.grad_accum,
            sequence_parallel=old.sequence_parallel and old.tp > 1,
            pp_schedule=schedule_of(schedule),
            pp_virtual=old.pp_virtual if piped else 1,
        )
    except KeyError:
        raise ContractError(
            f"{where}.layout.pp_schedule={old.pp_schedule!r} is not a schedule of the trainer"
        ) from None
    except ValueError as e:
        raise ContractError(f"{where}.layout: {e}") from None
    return {**rec, "layout": dataclasses.asdict(layout), "strategy": old.strategy}


def decode(value) -> list:
    """Records from a summary's ``KEY`` value; ContractError says what is wrong."""
    if not isinstance(value, dict) or not isinstance(value.get("records"), list):
        raise ContractError(f"{KEY} must be {{'schema_version': int, 'records': [...]}}")
    version = value.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ContractError(
            f"{KEY}.schema_version={version!r}: this dtrain reads schema 1..{SCHEMA_VERSION}"
        )
    out = []
    for i, rec in enumerate(value["records"]):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind not in RECORDS:
            raise ContractError(
                f"{KEY}.records[{i}]: unknown kind {kind!r} (known: {', '.join(RECORDS)})"
            )
        where = f"{KEY}.records[{i}] ({kind})"
        if version == 1 and kind == TrainingMeasurement.kind:
            rec = _training_v1(rec, where)
        out.append(_build(RECORDS[kind], rec, where))
    return out


def read(summary: dict) -> list:
    """The records of one run's summary ([] when it publishes none)."""
    return decode(summary[KEY]) if KEY in summary else []


def derived_from(summary: dict, run_dir) -> list[Path]:
    """The run directories a derived run was made from (stored relative to it), resolved."""
    return [(Path(run_dir) / p).resolve() for p in summary.get(DERIVED_FROM) or []]


def where_of(device, backend, gpu_name=None) -> Where:
    """A Where from a torch device (or its string) and a backend: ``cuda:0`` is recorded as
    ``cuda``."""
    return Where(str(device).split(":")[0], str(backend), gpu_name)


def training_inputs(
    result: dict,
    model: dict,
    layout: Layout,
    where: Where,
    precision: str | None = None,
    recipe: str | None = None,
    overlap: dict | None = None,
    breakdown: dict | None = None,
    step_callbacks=(),
) -> list[TrainingMeasurement]:
    """The record of one ``dtrain.train.Trainer`` run from its ``run()`` result (every trainer user
    publishes through this): ``model`` is the GPTConfig as a dict, ``layout`` the run's
    (``TrainConfig.layout`` of the config it ran), ``overlap``/``breakdown`` a profile window's
    results when one ran, ``step_callbacks`` the per-step tools the run had on beyond training.
    [] when the run timed no step (all steps were warmup): there is no measurement to publish."""
    if not all(
        isinstance(result.get(k), (int, float)) and math.isfinite(result[k])
        for k in ("step_time_s", "tokens_per_s")
    ):
        return []
    ov = overlap or {}
    return [
        TrainingMeasurement(
            model=dict(model),
            layout=layout,
            strategy=str(result["strategy"]),
            precision=str(precision or result["mixed_precision"]),
            step_time_s=float(result["step_time_s"]),
            tokens_per_s=float(result["tokens_per_s"]),
            peak_mem_bytes=int(result["peak_mem_bytes"]),
            where=where,
            recipe=recipe,
            mfu=result.get("mfu"),
            peak_flops=result.get("peak_flops"),
            peak_flops_source=result.get("peak_flops_source"),
            model_params=result.get("model_params"),
            flops_per_token=result.get("flops_per_token"),
            comm_s=ov.get("comm_s"),
            exposed_comm_s=ov.get("exposed_comm_s"),
            overlap_fraction=ov.get("overlap_fraction"),
            breakdown=_breakdown(breakdown),
            step_callbacks=list(step_callbacks),
        )
    ]


def moe_inputs(
    result: dict, model: dict, layout: Layout, where: Where, breakdown: dict | None
) -> list[MoeMeasurement]:
    """The ``moe_run`` record of a trainer run of an MoE model ([] for a dense model, or without a
    profiled breakdown to take the all-to-all time from)."""
    b = breakdown or {}
    if not model.get("moe") or not b.get("step_s") or result.get("moe_overload_mean") is None:
        return []
    return [
        MoeMeasurement(
            model=dict(model),
            layout=layout,
            precision=str(result["mixed_precision"]),
            tokens_per_step=int(result["tokens_per_step"]),
            step_time_s=float(result["step_time_s"]),
            profiled_step_s=float(b["step_s"]),
            a2a_s=float(b.get("ep_comm_s", 0.0)),
            a2a_share=float(b.get("ep_comm_s", 0.0)) / float(b["step_s"]),
            overload=float(result["moe_overload_mean"]),
            expert_overload=float(result["moe_expert_overload_mean"]),
            dropped_frac=float(result["moe_dropped_frac_mean"]),
            where=where,
        )
    ]


def _breakdown(values: dict | None) -> StepBreakdown | None:
    """A profile window's step breakdown as the record's (absent parts at their defaults)."""
    if not values:
        return None
    return StepBreakdown(
        **{
            f.name: float(values[f.name] if f.name in values else f.default)
            for f in dataclasses.fields(StepBreakdown)
        }
    )
