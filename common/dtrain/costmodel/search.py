"""Choose DP×CP×TP×PP, ZeRO stage, recompute, micro-batch and SP for a model on a cluster.

Enumerates the layouts with dp·cp·tp·pp = GPUs as a product of named axes (``AXES``: an axis'
values may depend on the ones chosen before it) kept by named rules (``FILTERS``: the trainer's,
the software's, the batch's), each checked as soon as the axes it reads are chosen:
  * tp a power of two dividing the heads, at most two nodes wide;
  * pp ≤ layers, the busiest stage holding ceil(L/pp) (uneven stages, as Megatron's
    ``--decoder-first/last-pipeline-num-layers`` allow); interleaving v ∈ {1, 2, 4, 8} when
    v ≤ ceil(L/pp) (Llama 3 405B: 126 layers on 16×8 chunks, two of them without a layer) and
    there are at least pp micro-batches;
  * ZeRO 0–3, also with PP (torchtitan's FSDP + PP allows it, DeepSpeed refuses ZeRO-2/3 with
    PP); the model charges their per-micro-batch traffic;
  * recompute none / op (torchtitan's selective op AC) / selective / full; selective is left out
    under fused (flash) attention, which already drops the stored attention scores at no extra cost
    (``attention="eager"``: the scores are stored and selective recompute pays);
  * micro-batch sizes dividing global_batch / dp; sequence parallelism on/off when tp > 1.
Keeps the layouts whose memory fits HBM with headroom and ranks them by predicted tokens/s
(ties: less memory first). Nothing is raised when nothing fits: ``best`` is None and ``reason``
says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from .hardware import GiB, Cluster
from .software import SOFTWARE, Software
from .stack import Stack
from .shapes import RECOMPUTE, Layout, ModelShape, parallel_refusal, pipeline_refusal, run_schedule
from .memory import MemoryBreakdown, model_state_bytes
from .stack_memory import memory_for
from .calibration import Calibration
from .timemodel import StepTime, step_model, step_time

__all__ = ["Cluster", "Calibration", "Plan", "SearchResult", "search"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
# Memory does not depend on the links: a grid over bandwidths (the guide) reuses it.
_memory = lru_cache(maxsize=1 << 17)(memory_for)
VIRTUAL_STAGES = (1, 2, 4, 8)
# A pruned search skips a layout whose compute alone is this many times the best step: it can be
# neither the best nor one of the runners-up ``explain`` names.
PRUNE_BOUND = 1.5
LAYOUT_FIELDS = (
    "dp",
    "tp",
    "pp",
    "virtual_stages",
    "zero_stage",
    "recompute",
    "micro_batch",
    "sequence_parallel",
    "pp_schedule",
    "cp",
    "cp_impl",
    "dp_replicate",
    "pp_split",
)
# The shortest sequence chunk a context-parallel rank computes on (half its share: the load-balanced
# split gives it two): fused attention reaches about half its long-sequence rate at ~1K tokens
# (kernels.yaml's s_half) and ~60% at 2K, so the search does not split sequences finer (at 4K
# tokens: no CP)
MIN_CP_CHUNK = 2048


@dataclass(frozen=True, kw_only=True)
class Plan(Layout):
    """A layout with its predicted memory per GPU and step time."""

    memory: MemoryBreakdown
    time: StepTime

    def describe(self) -> str:
        return describe_layout(self)


@dataclass
class SearchResult:
    """``best`` is None when nothing fits; ``reason`` then says why (the CLI prints it)."""

    best: Plan | None
    ranked: list[Plan]
    rejected_with_reasons: list[tuple[Layout, str]]
    reason: str
    model: ModelShape
    cluster: Cluster
    global_batch: int
    calib: Calibration = field(default_factory=Calibration)
    precision: str = "bf16"
    headroom: float = 0.1
    stack: Stack = field(default_factory=Stack)  # the software the layouts run on (stack.py)


def describe_layout(lay: Layout) -> str:
    cp = f" cp={lay.cp}{'' if lay.cp_impl == 'ring' else ' ' + lay.cp_impl}" if lay.cp > 1 else ""
    v = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    sched = f" {lay.pp_schedule}" if lay.pp > 1 and lay.pp_schedule != "1f1b" else ""
    sp = " sp" if lay.sequence_parallel else ""
    hsdp = f" hsdp={lay.hsdp_replicate}" if lay.hsdp_replicate > 1 else ""
    split = f" split={lay.pp_split}" if lay.pp_split != "layers" else ""
    return (
        f"dp={lay.dp}{cp} tp={lay.tp} pp={lay.pp}{v}{sched}{split} zero={lay.zero_stage}{hsdp} "
        f"recompute={lay.recompute} mb={lay.micro_batch} ga={lay.grad_accum}{sp}"
    )


def _pow2_up_to(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return out


def context_parallel_degrees(model: ModelShape, limit: int) -> list[int]:
    """cp degrees a sequence can be split over: powers of two with 2·cp chunks of at least
    MIN_CP_CHUNK tokens (the ring's load-balanced causal split gives each rank chunks r and
    2cp−1−r)."""
    return [1] + [
        c
        for c in _pow2_up_to(limit)[1:]
        if not parallel_refusal(model, 1, c) and model.seq_len // (2 * c) >= MIN_CP_CHUNK
    ]


def _layouts(
    model: ModelShape,
    cluster: Cluster,
    global_batch: int,
    micro_batches,
    recompute,
    prune=False,
    fixed: dict | None = None,
    context_parallel: bool = True,
    runs: Software = SOFTWARE["any"],
) -> tuple:
    """``_enumerate``'s layouts, kept per what they depend on (the GPU count and node size, not the
    links: the decision matrix searches each (model, GPUs) for eight link settings)."""
    return _enumerated(
        model,
        cluster.gpus,
        cluster.node_size,
        global_batch,
        tuple(micro_batches),
        tuple(recompute),
        prune,
        tuple(sorted((fixed or {}).items())),
        context_parallel,
        runs,
    )


@lru_cache(maxsize=64)
def _enumerated(
    model,
    gpus,
    node_size,
    global_batch,
    micro_batches,
    recompute,
    prune,
    fixed,
    context_parallel,
    runs,
):
    return tuple(
        _enumerate(
            model,
            gpus,
            node_size,
            global_batch,
            micro_batches,
            recompute,
            prune,
            dict(fixed),
            context_parallel,
            runs,
        )
    )


@dataclass(frozen=True, eq=False)
class Space:
    """What one enumeration searches: the model, ``n`` GPUs of ``node_size`` per node, the batch,
    the micro-batches and recompute levels to try, ``fixed`` (the fields ``dtrain plan --layout``
    pins) and ``runs`` (what the software runs). ``memo`` keeps what an enumeration asks again and
    again (the trainer's ``refusal``, the SP settings) once per the degrees it depends on."""

    model: ModelShape
    n: int
    node_size: int
    global_batch: int
    micro_batches: tuple
    recompute: tuple
    prune: bool
    fixed: dict
    context_parallel: bool
    runs: Software
    replicas: int
    memo: dict = field(default_factory=dict)

    def refusal(
        self, tp: int = 1, cp: int = 1, cp_impl: str = "ring", sp: bool = False
    ) -> str | None:
        key = (tp, cp, cp_impl, sp)
        if key not in self.memo:  # the module's parallel_refusal, looked up now (tests patch it)
            self.memo[key] = parallel_refusal(self.model, tp, cp, cp_impl, sp)
        return self.memo[key]


@dataclass(frozen=True)
class Axis:
    """One field of the layouts searched; ``values(space, chosen)`` lists its values given the
    fields chosen before it (``chosen``: axis name -> value), in the order the search tries them."""

    name: str
    values: Callable[[Space, dict], Iterable]


@dataclass(frozen=True)
class Filter:
    """A rule every layout passes, checked as soon as the axis ``after`` has a value, so a rule on
    the degrees prunes before the micro-batches, schedules and ZeRO stages under them are expanded.
    ``ok(space, chosen)`` is the rule; a choice that fails it is dropped, or, with ``rejects``,
    kept as a rejection with the reason ``rejects(space, chosen)`` (the CLI explains those)."""

    name: str
    after: str
    ok: Callable[[Space, dict], bool]
    rejects: Callable[[Space, dict], tuple[Layout, str]] | None = None


def _tp_degrees(s: Space, c: dict):
    """Powers of two up to the heads, at most two nodes wide."""
    if "tp" in s.fixed:
        return (s.fixed["tp"],)
    return _pow2_up_to(min(2 * s.node_size, s.model.n_head))


def _cp_degrees(s: Space, c: dict):
    """Powers of two leaving 2·cp chunks of at least MIN_CP_CHUNK tokens (a pinned cp as given)."""
    if "cp" in s.fixed:
        return (s.fixed["cp"],)
    return context_parallel_degrees(s.model, s.n // c["tp"]) if s.context_parallel else (1,)


def _pp_degrees(s: Space, c: dict):
    """Divisors of the GPUs tp·cp leave, at most the layers (uneven stages allowed)."""
    rest = s.n // (c["tp"] * c["cp"])
    return [p for p in range(1, min(s.model.n_layer, rest) + 1) if rest % p == 0]


def _virtual_stages(s: Space, c: dict):
    if "virtual_stages" in s.fixed:
        return (s.fixed["virtual_stages"],)
    return VIRTUAL_STAGES if s.runs.interleaved else (1,)


def _cp_impls(s: Space, c: dict):
    """The software's CP implementations; those it runs only when asked for, when one is pinned."""
    if c["cp"] == 1:
        return ("ring",)
    return s.runs.cp_impls + (s.runs.cp_pinned if "cp_impl" in s.fixed else ())


def _zero_stages(s: Space, c: dict):
    """The software's ZeRO stages (0 alone without data shards); pruned: from 1 up if it has any."""
    zeros = s.runs.zeros(c["pp"]) if c["dp"] * c["cp"] > 1 else (0,)
    return tuple(z for z in zeros if z >= 1) or zeros if s.prune else zeros


def _sp_settings(s: Space, c: dict):
    """SP off / on where the software runs it and tp > 1; on needs the trainer to split a cp rank's
    tokens over tp; pruned: on only (same time, less memory), where it is possible."""
    tp, cp, impl = c["tp"], c["cp"], c["cp_impl"]
    if tp == 1:
        return (False,)
    key = ("sp", tp, cp, impl)  # asked per (zero stage, recompute), then once per layout
    if key not in s.memo:
        sps = tuple(sp for sp in s.runs.sp if not sp or not s.refusal(tp, cp, impl, True))
        s.memo[key] = (True,) if s.prune and True in sps else sps
    return s.memo[key]


def _pp_split(s: Space, c: dict):
    """A pinned split when pp > 1 (scored when asked for, never searched), else "layers"."""
    return (s.fixed.get("pp_split", "layers") if c["pp"] > 1 else "layers",)


def _batch_rejection(s: Space, c: dict) -> tuple[Layout, str]:
    dp, mb = c["dp"], c["micro_batch"]
    return Layout(dp_shard=dp, tp=c["tp"], pp=c["pp"], micro_batch=mb), (
        f"global batch {s.global_batch} is not a multiple of dp·micro_batch = {dp * mb}"
    )


def _interleaving_fits(s: Space, c: dict) -> bool:
    """v chunks per stage: pp > 1, at most ceil(L/pp) chunks, at least pp micro-batches."""
    v, pp = c["virtual_stages"], c["pp"]
    return v == 1 or (pp > 1 and v <= -(-s.model.n_layer // pp) and c["grad_accum"] >= pp)


def _interleaving_runs(s: Space, c: dict) -> bool:
    """The software splits the layers into pp·v chunks (and micro-batches in groups of pp)."""
    v, pp = c["virtual_stages"], c["pp"]
    return v == 1 or (
        s.runs.splits(s.model.n_layer, pp, v)
        and (c["grad_accum"] % pp == 0 or not s.runs.interleaved_groups)
    )


def _pipeline_runs(s: Space, c: dict) -> bool:
    """A software with the trainer's rules (dtrain) pipelines these stages as its
    ``dtrain.parallel.feasibility.check_pipeline`` allows, with the schedule the overrides run."""
    pp, v, accum = c["pp"], c["virtual_stages"], c["grad_accum"]
    if not s.runs.trainer_rules or pp == 1:
        return True
    lay = Layout(pp=pp, pp_virtual=v, pp_schedule=c["pp_schedule"], grad_accum=accum)
    return not pipeline_refusal(s.model.n_layer, pp, run_schedule(lay), v, accum)


# The layouts searched, outermost first: their order is the order the layouts are tried in (ties in
# the ranking keep it). A value may depend on those chosen before it. Names are LAYOUT_FIELDS'
# (``fixed`` pins them) and grad_accum. A field with one value (dp, grad_accum, dp_replicate,
# pp_split) costs one step per layout above it, so it comes as early as what it reads allows;
# dp_replicate and pp_split (scored when asked for, never searched) after micro_batch, so that a
# pinned value a layout lacks drops layouts, not the batch-shape rejections of the degrees.
# A new dimension (ep) is one Axis here, its rules in FILTERS and its field in _layout.
AXES = (
    Axis("tp", _tp_degrees),
    Axis("cp", _cp_degrees),
    Axis("pp", _pp_degrees),
    Axis("dp", lambda s, c: (s.n // (c["tp"] * c["cp"] * c["pp"]),)),  # the rest
    Axis("micro_batch", lambda s, c: s.micro_batches),
    Axis("grad_accum", lambda s, c: (s.global_batch // (c["dp"] * c["micro_batch"]),)),
    Axis("dp_replicate", lambda s, c: (s.replicas,)),
    Axis("pp_split", _pp_split),
    Axis("virtual_stages", _virtual_stages),
    Axis("pp_schedule", lambda s, c: _schedules(c["pp"], c["virtual_stages"], s.fixed)),
    Axis("cp_impl", _cp_impls),
    Axis("zero_stage", _zero_stages),
    Axis("recompute", lambda s, c: s.recompute),
    Axis("sequence_parallel", _sp_settings),
)

# The rules, each checked right after the last axis it reads (before a value pinned by ``fixed`` is
# compared, which every axis does): the trainer's (``shapes.parallel_refusal``), the software's
# (``software.py``) and the batch's.
FILTERS = (
    Filter("tp divides the GPUs", "tp", lambda s, c: s.n % c["tp"] == 0),
    Filter("the software runs tp", "tp", lambda s, c: s.runs.model_parallel or c["tp"] == 1),
    Filter("the software runs pp", "pp", lambda s, c: s.runs.model_parallel or c["pp"] == 1),
    Filter(
        "the software shards whole KV heads over tp",
        "tp",
        lambda s, c: not (s.runs.kv_shards and s.model.n_kv_head % c["tp"]),
    ),
    Filter(
        "the trainer splits the heads and the MLP over tp",
        "tp",
        lambda s, c: not s.refusal(c["tp"]),
    ),
    Filter("cp divides the GPUs tp leaves", "cp", lambda s, c: (s.n // c["tp"]) % c["cp"] == 0),
    Filter(
        "the trainer splits the sequence into 2·cp chunks",
        "cp",
        lambda s, c: not s.refusal(1, c["cp"]),
    ),
    Filter(
        "the software runs cp with pp",
        "pp",
        lambda s, c: s.runs.cp_with_pp or c["cp"] == 1 or c["pp"] == 1,
    ),
    Filter(
        "the software splits the layers over pp",
        "pp",
        lambda s, c: s.runs.splits(s.model.n_layer, c["pp"]),
    ),
    Filter("HSDP's replica groups divide dp", "dp", lambda s, c: c["dp"] % s.replicas == 0),
    Filter(
        "dp·micro_batch divides the global batch",
        "micro_batch",
        lambda s, c: s.global_batch % (c["dp"] * c["micro_batch"]) == 0,
        _batch_rejection,
    ),
    Filter("interleaving fits the layers and micro-batches", "virtual_stages", _interleaving_fits),
    Filter("the software interleaves these stages", "virtual_stages", _interleaving_runs),
    Filter("the trainer pipelines these stages", "pp_schedule", _pipeline_runs),
    # all-to-all swaps sequence shards for head shards: tp's heads must split over cp
    Filter(
        "Ulysses splits tp's heads over cp",
        "cp_impl",
        lambda s, c: c["cp_impl"] != "ulysses" or not s.refusal(c["tp"], c["cp"], "ulysses"),
    ),
    Filter(
        "HSDP shards the states (ZeRO >= 2)",
        "zero_stage",
        lambda s, c: s.replicas == 1 or c["zero_stage"] >= 2,
    ),
)


def _checks_per_axis(axes: tuple[Axis, ...], filters: tuple[Filter, ...]) -> tuple:
    """Per axis, the (rule, rejection) of the filters checked right after it, in FILTERS' order."""
    names = [a.name for a in axes]
    lost = [f.name for f in filters if f.after not in names]
    if lost:
        raise ValueError(f"filters {lost} name no axis of {names}")
    return tuple(tuple((f.ok, f.rejects) for f in filters if f.after == name) for name in names)


_FREE = object()  # an axis no field pins (and the end of an axis' values)
_AXIS_NAMES = tuple(a.name for a in AXES)
_CHECKS = _checks_per_axis(AXES, FILTERS)


def _verdict(space: Space, chosen: dict, depth: int, value, pinned):
    """Set axis ``depth`` to ``value`` in ``chosen``: True when the filters checked after it pass
    and it is the value ``fixed`` pins (if any); else the rejection of the filter it fails, or
    None / False (dropped)."""
    chosen[_AXIS_NAMES[depth]] = value
    for ok, rejects in _CHECKS[depth]:
        if not ok(space, chosen):
            return rejects(space, chosen) if rejects is not None else None
    return pinned is _FREE or value == pinned


def _layout(c: dict) -> Layout:
    """The layout of one full choice of every axis."""
    return Layout(
        dp_replicate=c["dp_replicate"],
        dp_shard=c["dp"] // c["dp_replicate"],
        cp=c["cp"],
        tp=c["tp"],
        pp=c["pp"],
        zero_stage=c["zero_stage"],
        recompute=c["recompute"],
        micro_batch=c["micro_batch"],
        grad_accum=c["grad_accum"],
        sequence_parallel=c["sequence_parallel"],
        pp_schedule=c["pp_schedule"],
        pp_virtual=c["virtual_stages"],
        cp_impl=c["cp_impl"],
        pp_split=c["pp_split"],
    )


def _enumerate(
    model: ModelShape,
    n: int,
    node_size: int,
    global_batch: int,
    micro_batches,
    recompute,
    prune=False,
    fixed: dict | None = None,
    context_parallel: bool = True,
    runs: Software = SOFTWARE["any"],
):
    """Yield (layout, None) for candidates and (layout, reason) for batch-shape rejections: the
    product of ``AXES`` that passes ``FILTERS``, depth first (each filter right after its axis).
    ``prune`` leaves out ZeRO-0 when dp > 1 and SP off when tp > 1 where ``runs`` has ZeRO >= 1 / SP
    on (see ``search``); ``fixed`` (field -> value, names of ``LAYOUT_FIELDS``) keeps only the
    layouts with those values; ``runs``: only the ZeRO stages, CP implementations, SP settings and
    interleaving that software runs."""
    fixed = fixed or {}
    space = Space(
        model,
        n,
        node_size,
        global_batch,
        tuple(micro_batches),
        tuple(recompute),
        prune,
        fixed,
        context_parallel and bool(runs.cp_impls),
        runs,
        fixed.get("dp_replicate", 1),
    )  # HSDP is scored when asked for, never searched
    pinned = tuple(fixed.get(name, _FREE) for name in _AXIS_NAMES)
    others = {k: v for k, v in fixed.items() if k not in _AXIS_NAMES}  # pinned but not an axis
    inner, chosen = len(AXES) - 1, {}
    # depth first: one iterator per axis above the innermost, whose values give the layouts
    stack = [iter(AXES[0].values(space, chosen))]
    while stack:
        depth = len(stack) - 1
        value = next(stack[-1], _FREE)
        if value is _FREE:  # this axis is done: back to the one above
            stack.pop()
            continue
        verdict = _verdict(space, chosen, depth, value, pinned[depth])
        if verdict is not True:
            if verdict:  # a rejection the CLI explains
                yield verdict
            continue
        if depth + 1 < inner:
            stack.append(iter(AXES[depth + 1].values(space, chosen)))
            continue
        # the innermost axis in a plain loop: a search builds ~10^4-10^5 layouts, one step each
        for value in AXES[inner].values(space, chosen):
            verdict = _verdict(space, chosen, inner, value, pinned[inner])
            if verdict is True:
                lay = _layout(chosen)
                if not others or all(_field(lay, k) == v for k, v in others.items()):
                    yield lay, None
            elif verdict:
                yield verdict


def _field(lay: Layout, name: str):
    """A ``LAYOUT_FIELDS`` value of a layout: the plan's dp_replicate (``--layout hsdp=``) is HSDP's
    replica groups, 1 for a layout whose states are not sharded (its replicas are DDP's)."""
    return lay.hsdp_replicate if name == "dp_replicate" else getattr(lay, name)


def layout_fields(lay: Layout) -> dict:
    """A layout in the plan's ``LAYOUT_FIELDS`` (what ``fixed`` and ``software.unsupported``
    read)."""
    return {name: _field(lay, name) for name in LAYOUT_FIELDS}


def _design(lay: Layout) -> tuple:
    """A layout but for its ZeRO stage."""
    return (
        lay.dp,
        lay.cp,
        lay.cp_impl,
        lay.tp,
        lay.pp,
        lay.micro_batch,
        lay.virtual_stages,
        lay.pp_schedule,
        lay.recompute,
        lay.sequence_parallel,
        lay.dp_replicate,
        lay.pp_split,
    )


def _schedules(pp: int, v: int, fixed: dict) -> tuple[str, ...]:
    """Pipeline schedules for pp stages of v chunks: 1F1B (interleaved when v > 1), the schedule
    Megatron, DeepSpeed and torchtitan run by default. Zero-bubble V (v = 2) and GPipe (never faster
    than 1F1B, and it holds every micro-batch) are scored when asked for (``fixed["pp_schedule"]``,
    ``dtrain plan --layout schedule=zbv``): ZB-V needs a runtime that splits weight-gradient work
    (torch.distributed.pipelining's ScheduleZBVZeroBubble, dtrain's train.pp_schedule=zbv), so the
    search does not assume one."""
    if "pp_schedule" in fixed:
        want = fixed["pp_schedule"]
        runs = pp > 1 and (want != "zbv" or v == 2) and (want != "gpipe" or v == 1) or pp == 1
        return (want,) if runs else ()
    return ("1f1b",)


def search(
    model: ModelShape,
    cluster: Cluster,
    global_batch: int,
    calib: Calibration | None = None,
    *,
    precision: str = "bf16",
    headroom: float = 0.1,
    stack: Stack = Stack(),
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    prune: bool = False,
    fixed: dict | None = None,
    keep_within: float = PRUNE_BOUND,
) -> SearchResult:
    """Rank every fitting layout by predicted tokens/s; ``global_batch`` is in sequences.

    ``prune`` skips layouts that cannot be the best (same ``best``, ~10x faster; the decision
    matrix uses it): sequence parallelism costs the same predicted time as its absence with less
    memory, ZeRO-1 (reduce-scatter of fp32 grads + all-gather of bf16 weights) moves less than
    ZeRO-0's fp32 all-reduce with less memory, and from ZeRO-1 up a higher stage is never faster,
    so per (dp, tp, pp, micro-batch, v, recompute) only the lowest fitting stage ≥ 1 is timed.
    It also skips a layout whose lower bound (``StepModel.lower_bound``) is ``keep_within`` x the
    best step: 1.0 keeps exactly the best (the decision matrix), the default keeps the runners-up
    ``explain`` names.
    ``fixed`` pins layout fields (``LAYOUT_FIELDS``), as ``dtrain plan --layout`` does."""
    calib = calib or Calibration()
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if precision == "fp8" and cluster.gpu.fp8_tflops is None:
        raise ValueError(f"{cluster.gpu.name} has no FP8 tensor cores; use precision='bf16'")
    act_factor = calib.fp8_memory_factor.value if precision == "fp8" else 1.0
    usable = cluster.gpu.hbm_bytes * (1 - headroom)
    ranked: list[Plan] = []
    rejected: list[tuple[Layout, str]] = []
    smallest: tuple[float, Layout] | None = None
    flash_attention = stack.flash
    runs = stack.runs
    levels = tuple(
        r for r in RECOMPUTE if r in runs.recompute and not (flash_attention and r == "selective")
    )
    if fixed and "recompute" in fixed:
        levels = (fixed["recompute"],)
    if fixed and "micro_batch" in fixed:
        micro_batches = (fixed["micro_batch"],)
    timed: set[tuple] = set()
    step_time(model, Layout(), cluster, calib, precision, stack=stack)  # precision vs the GPU
    # The least model-state bytes any layout keeps: ZeRO-3 (FSDP) sharding every state over every
    # GPU (16/N per parameter with fp32 states); a layout's busiest GPU holds at least that share.
    floor = sum(
        model_state_bytes(
            model.num_params(), 3, cluster.gpus, stack.grad_bytes, stack.optimizer_states
        )
    )
    if prune and floor > usable:  # nothing fits: skip timing thousands (the matrix's small cells)
        reason = (
            f"does not fit: even sharded over all {cluster.gpus} GPUs (ZeRO-3) the weights, "
            f"gradients and Adam states need {floor / GiB:.1f} GiB per GPU > "
            f"{usable / GiB:.1f} GiB usable on {cluster.gpus}x {cluster.gpu.name}"
        )
        return SearchResult(
            None, [], [], reason, model, cluster, global_batch, calib, precision, headroom, stack
        )
    steps = step_model(model, cluster, calib, precision, 2, stack)
    candidates = []
    bounds: dict[tuple, float] = {}  # the bound does not depend on the ZeRO stage: once per design
    for lay, why in _layouts(
        model, cluster, global_batch, micro_batches, levels, prune, fixed, flash_attention, runs
    ):
        if why:
            rejected.append((lay, why))
        elif prune:  # ordered by a lower bound of their step below
            key = _design(lay)
            bound = bounds.get(key)
            if bound is None:
                bound = bounds[key] = steps.lower_bound(lay)
            candidates.append((bound, lay))
        else:
            candidates.append((0.0, lay))
    # Every candidate moves the same tokens (the global batch), so step time ranks them, and a step
    # is never shorter than its lower bound: in that order (stable: ZeRO stages stay in increasing
    # order within a group), once the bound is ``keep_within`` x the best step found, no later
    # layout can be the best or a runner-up worth naming.
    best_s = float("inf")
    for bound, lay in sorted(candidates, key=lambda x: x[0]) if prune else candidates:
        if bound > keep_within * best_s:
            break
        group = _design(lay)
        if prune and group in timed and lay.zero_stage < 3:
            continue
        mem = _memory(model, lay, stack, act_factor)
        if mem.total > usable:
            rejected.append((lay, NoFit(mem.total, usable, cluster.gpu.hbm_gib, headroom)))
            if smallest is None or mem.total < smallest[0]:
                smallest = (mem.total, lay)
            continue
        timed.add(group)
        t = steps.time(lay)
        best_s = min(best_s, t.total)
        ranked.append(Plan(**vars(lay), memory=mem, time=t))
    ranked.sort(key=lambda p: (-p.time.tokens_per_s, p.memory.total))
    if ranked:
        reason = f"best of {len(ranked)} fitting plans ({len(rejected)} rejected)"
    elif smallest is not None:
        reason = (
            f"does not fit: even the smallest plan ({describe_layout(smallest[1])}) needs "
            f"{smallest[0] / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB usable on "
            f"{cluster.gpus}x {cluster.gpu.name}"
        )
    elif fixed:
        groups = f" (a multiple of pp under {runs.name})" if runs.interleaved_groups else ""
        reason = (
            f"no layout of {cluster.gpus} GPUs matches {fixed}: dp·cp·tp·pp must equal the "
            f"GPUs (a cp left out is searched over powers of two that leave 2·cp chunks of "
            f">= {MIN_CP_CHUNK} tokens), tp divide the {model.n_head} heads, v ≤ "
            f"ceil(layers/pp) with at least pp micro-batches{groups}, and dp·mb divide the "
            f"global batch {global_batch}"
        )
    else:
        reason = (
            f"no layout of {cluster.gpus} GPUs divides global batch {global_batch} "
            f"(micro-batches {micro_batches})"
        )
    return SearchResult(
        ranked[0] if ranked else None,
        ranked,
        rejected,
        reason,
        model,
        cluster,
        global_batch,
        calib,
        precision,
        headroom,
        stack,
    )


@dataclass(frozen=True)
class NoFit:
    """Why a layout was rejected for memory, written out only when read (a search rejects
    thousands)."""

    need: float
    usable: float
    hbm_gib: float
    headroom: float

    def __str__(self) -> str:
        return (
            f"does not fit: needs {self.need / GiB:.1f} GiB > {self.usable / GiB:.1f} GiB "
            f"usable ({self.hbm_gib:g} GiB HBM, {self.headroom:.0%} headroom)"
        )

    def startswith(self, prefix: str) -> bool:
        return str(self).startswith(prefix)

    def __contains__(self, text: str) -> bool:
        return text in str(self)
