"""Choose DP×CP×TP×PP, ZeRO stage, recompute, micro-batch and SP for a model on a cluster.

Ranks the layouts of the layout space (``layout_space``: named axes kept by named rules, walked by
``layout_enumeration``): keeps the layouts whose memory fits HBM with headroom and ranks them by
predicted tokens/s (ties: less memory first). Nothing is raised when nothing fits: ``best`` is None
and ``reason`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .hardware import GiB, Cluster
from .stack import Stack
from .shapes import RECOMPUTE, Layout, ModelShape
from .memory import MemoryBreakdown
from .model_states import model_state_bytes
from .stack_memory import memory_for
from .calibration import Calibration
from .step_breakdown import StepTime
from .timemodel import step_model, step_time
from .layout_space import MIN_CP_CHUNK
from .layout_enumeration import _layouts

__all__ = ["Cluster", "Calibration", "Plan", "SearchResult", "search"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
# Memory does not depend on the links: a grid over bandwidths (the guide) reuses it.
_memory = lru_cache(maxsize=1 << 17)(memory_for)
# A pruned search skips a layout whose compute alone is this many times the best step: it can be
# neither the best nor one of the runners-up ``explain`` names.
PRUNE_BOUND = 1.5


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
        mem = _memory(model, lay, stack, act_factor, precision)
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
