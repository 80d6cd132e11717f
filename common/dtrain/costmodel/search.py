"""Choose DP×TP×PP, ZeRO stage, recompute, micro-batch and SP for a model on a cluster.

Enumerates every layout with dp·tp·pp = GPUs:
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

from dataclasses import dataclass, field
from functools import lru_cache

from .hardware import GiB, Cluster
from .software import SOFTWARE, Software
from .stack import Stack
from .shapes import RECOMPUTE, Layout, ModelShape, parallel_refusal
from .memory import MemoryBreakdown, memory_for, model_state_bytes
from .calibration import Calibration
from .timemodel import StepTime, step_model, step_time

__all__ = ["Cluster", "Calibration", "Plan", "SearchResult", "search"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
# Memory does not depend on the links: a grid over bandwidths (the guide) reuses it.
_memory = lru_cache(maxsize=1 << 17)(memory_for)
VIRTUAL_STAGES = (1, 2, 4, 8)
# A pruned search skips a layout whose compute alone is this many times the best step: it can be neither the
# best nor one of the runners-up ``explain`` names.
PRUNE_BOUND = 1.5
LAYOUT_FIELDS = ("dp", "tp", "pp", "virtual_stages", "zero_stage", "recompute", "micro_batch", "sequence_parallel",
                 "pp_schedule", "cp", "cp_impl", "dp_replicate", "pp_split")
# The shortest sequence chunk a context-parallel rank computes on (half its share: the load-balanced split gives
# it two): fused attention reaches about half its long-sequence rate at ~1K tokens (kernels.yaml's s_half) and
# ~60% at 2K, so the search does not split sequences finer (at 4K tokens: no CP)
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
    stack: Stack = field(default_factory=Stack)   # the software the layouts run on (costmodel/stack.py)


def describe_layout(lay: Layout) -> str:
    cp = f" cp={lay.cp}{'' if lay.cp_impl == 'ring' else ' ' + lay.cp_impl}" if lay.cp > 1 else ""
    v = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    sched = f" {lay.pp_schedule}" if lay.pp > 1 and lay.pp_schedule != "1f1b" else ""
    sp = " sp" if lay.sequence_parallel else ""
    hsdp = f" hsdp={lay.dp_replicate}" if lay.dp_replicate > 1 else ""
    split = f" split={lay.pp_split}" if lay.pp_split != "layers" else ""
    return (f"dp={lay.dp}{cp} tp={lay.tp} pp={lay.pp}{v}{sched}{split} zero={lay.zero_stage}{hsdp} "
            f"recompute={lay.recompute} mb={lay.micro_batch} ga={lay.grad_accum}{sp}")


def _pow2_up_to(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return out


def context_parallel_degrees(model: ModelShape, limit: int) -> list[int]:
    """cp degrees a sequence can be split over: powers of two with 2·cp chunks of at least MIN_CP_CHUNK tokens
    (the ring's load-balanced causal split gives each rank chunks r and 2cp−1−r)."""
    return [1] + [c for c in _pow2_up_to(limit)[1:]
                  if not parallel_refusal(model, 1, c) and model.seq_len // (2 * c) >= MIN_CP_CHUNK]


def _layouts(model: ModelShape, cluster: Cluster, global_batch: int, micro_batches, recompute, prune=False,
             fixed: dict | None = None, context_parallel: bool = True, runs: Software = SOFTWARE["any"]) -> tuple:
    """``_enumerate``'s layouts, kept per what they depend on (the GPU count and node size, not the links: the
    decision matrix searches each (model, GPUs) for eight link settings)."""
    return _enumerated(model, cluster.gpus, cluster.node_size, global_batch, tuple(micro_batches), tuple(recompute),
                       prune, tuple(sorted((fixed or {}).items())), context_parallel, runs)


@lru_cache(maxsize=64)
def _enumerated(model, gpus, node_size, global_batch, micro_batches, recompute, prune, fixed, context_parallel, runs):
    return tuple(_enumerate(model, gpus, node_size, global_batch, micro_batches, recompute, prune, dict(fixed),
                            context_parallel, runs))


def _enumerate(model: ModelShape, n: int, node_size: int, global_batch: int, micro_batches, recompute, prune=False,
               fixed: dict | None = None, context_parallel: bool = True, runs: Software = SOFTWARE["any"]):
    """Yield (layout, None) for candidates and (layout, reason) for batch-shape rejections;
    ``prune`` leaves out ZeRO-0 when dp > 1 and SP off when tp > 1 where ``runs`` has ZeRO >= 1 / SP on (see
    ``search``); ``fixed`` (field -> value, names of ``LAYOUT_FIELDS``) keeps only the layouts with those values;
    ``runs``: only the ZeRO stages, CP implementations, SP settings and interleaving that software runs."""
    fixed = fixed or {}
    context_parallel = context_parallel and bool(runs.cp_impls)
    replicas = fixed.get("dp_replicate", 1)  # HSDP is scored when asked for, never searched
    for tp in _pow2_up_to(min(2 * node_size, model.n_head)) if "tp" not in fixed else [fixed["tp"]]:
        if n % tp or (runs.kv_shards and model.n_kv_head % tp) or parallel_refusal(model, tp):
            continue
        if "cp" in fixed:  # a pinned cp still needs 2·cp equal chunks of the sequence
            cps = [fixed["cp"]] if not parallel_refusal(model, 1, fixed["cp"]) else []
        else:
            cps = context_parallel_degrees(model, n // tp) if context_parallel else [1]
        for cp, pp in ((c, p) for c in cps if (n // tp) % c == 0
                       for p in range(1, min(model.n_layer, n // (tp * c)) + 1) if (n // (tp * c)) % p == 0
                       if (runs.cp_with_pp or c == 1 or p == 1) and runs.splits(model.n_layer, p)):
            dp = n // (tp * cp * pp)
            if ("pp" in fixed and pp != fixed["pp"]) or ("dp" in fixed and dp != fixed["dp"]) or (dp * cp) % replicas:
                continue
            # all-to-all swaps sequence shards for head shards: tp's heads must split over cp
            ulysses = cp > 1 and not parallel_refusal(model, tp, cp, "ulysses")
            impls = [i for i in runs.cp_impls if i != "ulysses" or ulysses] if cp > 1 else ["ring"]
            split = fixed.get("pp_split", "layers") if pp > 1 else "layers"  # scored when asked for, not searched
            if "cp_impl" in fixed:  # and the ones scored only when asked for (any: PyTorch's context_parallel)
                impls = [i for i in impls + list(runs.cp_pinned) * (cp > 1) if i == fixed["cp_impl"]]
            for mb in micro_batches:
                if global_batch % (dp * mb):
                    yield Layout(dp, tp, pp, micro_batch=mb), (
                        f"global batch {global_batch} is not a multiple of dp·micro_batch = {dp * mb}")
                    continue
                ga = global_batch // (dp * mb)
                vs = [v for v in ([fixed["virtual_stages"]] if "virtual_stages" in fixed else
                                  VIRTUAL_STAGES if runs.interleaved else (1,))
                      if v == 1 or (pp > 1 and v <= -(-model.n_layer // pp) and ga >= pp
                                    and runs.splits(model.n_layer, pp, v)
                                    and (ga % pp == 0 or not runs.interleaved_groups))]
                for v, sched, impl in ((v, sc, i) for v in vs for sc in _schedules(pp, v, fixed) for i in impls):
                    zeros = runs.zeros(pp) if dp * cp > 1 else (0,)
                    zeros = tuple(z for z in zeros if z >= 1) or zeros if prune else zeros
                    # sequence parallelism also splits the sequence (a cp rank's share) over tp
                    sps = tuple(sp for sp in runs.sp
                                if not sp or not parallel_refusal(model, tp, cp, impl, True))
                    sps = ((True,) if prune and True in sps else sps) if tp > 1 else (False,)
                    for zero in [z for z in zeros if z == fixed.get("zero_stage", z) and (replicas == 1 or z >= 2)]:
                        for rc in recompute:
                            for sp in sps:
                                lay = Layout(dp, tp, pp, zero, rc, mb, ga, sp, v, sched, cp, impl, replicas, split)
                                if not fixed or all(getattr(lay, k) == val for k, val in fixed.items()):
                                    yield lay, None


def _design(lay: Layout) -> tuple:
    """A layout but for its ZeRO stage."""
    return (lay.dp, lay.cp, lay.cp_impl, lay.tp, lay.pp, lay.micro_batch, lay.virtual_stages, lay.pp_schedule,
            lay.recompute, lay.sequence_parallel, lay.dp_replicate, lay.pp_split)


def _schedules(pp: int, v: int, fixed: dict) -> tuple[str, ...]:
    """Pipeline schedules for pp stages of v chunks: 1F1B (interleaved when v > 1), the schedule Megatron,
    DeepSpeed and torchtitan run by default. Zero-bubble V (v = 2) and GPipe (never faster than 1F1B, and it
    holds every micro-batch) are scored when asked for (``fixed["pp_schedule"]``, ``dtrain plan --layout
    schedule=zbv``): ZB-V needs a runtime that splits weight-gradient work (torch.distributed.pipelining's
    ScheduleZBVZeroBubble, dtrain's train.pp_schedule=zbv), so the search does not assume one."""
    if "pp_schedule" in fixed:
        want = fixed["pp_schedule"]
        return (want,) if pp > 1 and (want != "zbv" or v == 2) and (want != "gpipe" or v == 1) or pp == 1 else ()
    return ("1f1b",)


def search(model: ModelShape, cluster: Cluster, global_batch: int, calib: Calibration | None = None, *,
           precision: str = "bf16", headroom: float = 0.1, stack: Stack = Stack(),
           micro_batches: tuple[int, ...] = MICRO_BATCHES, prune: bool = False,
           fixed: dict | None = None, keep_within: float = PRUNE_BOUND) -> SearchResult:
    """Rank every fitting layout by predicted tokens/s; ``global_batch`` is in sequences.

    ``prune`` skips layouts that cannot be the best (same ``best``, ~10x faster; the decision
    matrix uses it): sequence parallelism costs the same predicted time as its absence with less
    memory, ZeRO-1 (reduce-scatter of fp32 grads + all-gather of bf16 weights) moves less than
    ZeRO-0's fp32 all-reduce with less memory, and from ZeRO-1 up a higher stage is never faster,
    so per (dp, tp, pp, micro-batch, v, recompute) only the lowest fitting stage ≥ 1 is timed.
    It also skips a layout whose lower bound (``StepModel.lower_bound``) is ``keep_within`` x the best step:
    1.0 keeps exactly the best (the decision matrix), the default keeps the runners-up ``explain`` names.
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
    levels = tuple(r for r in RECOMPUTE if r in runs.recompute and not (flash_attention and r == "selective"))
    if fixed and "recompute" in fixed:
        levels = (fixed["recompute"],)
    if fixed and "micro_batch" in fixed:
        micro_batches = (fixed["micro_batch"],)
    timed: set[tuple] = set()
    step_time(model, Layout(1, 1, 1), cluster, calib, precision, stack=stack)  # checks precision vs the GPU
    # The least model-state bytes any layout keeps: ZeRO-3 (FSDP) sharding every state over every GPU (16/N per
    # parameter with fp32 states); a layout's busiest GPU holds at least that share.
    floor = sum(model_state_bytes(model.num_params(), 3, cluster.gpus, stack.grad_bytes, stack.optimizer_states))
    if prune and floor > usable:  # no layout can fit: skip timing thousands (the matrix's small-cluster cells)
        reason = (f"does not fit: even sharded over all {cluster.gpus} GPUs (ZeRO-3) the weights, gradients and "
                  f"Adam states need {floor / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB usable on "
                  f"{cluster.gpus}x {cluster.gpu.name}")
        return SearchResult(None, [], [], reason, model, cluster, global_batch, calib, precision, headroom, stack)
    steps = step_model(model, cluster, calib, precision, 2, stack)
    candidates = []
    bounds: dict[tuple, float] = {}  # the bound does not depend on the ZeRO stage: once per design
    for lay, why in _layouts(model, cluster, global_batch, micro_batches, levels, prune, fixed, flash_attention,
                             runs):
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
    # Every candidate moves the same tokens (the global batch), so step time ranks them, and a step is never
    # shorter than its lower bound: in that order (stable: ZeRO stages stay in increasing order within a group),
    # once the bound is ``keep_within`` x the best step found, no later layout can be the best or a runner-up
    # worth naming.
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
        reason = (f"does not fit: even the smallest plan ({describe_layout(smallest[1])}) needs "
                  f"{smallest[0] / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB usable on "
                  f"{cluster.gpus}x {cluster.gpu.name}")
    elif fixed:
        reason = (f"no layout of {cluster.gpus} GPUs matches {fixed}: dp·cp·tp·pp must equal the GPUs (a cp left "
                  f"out is searched over powers of two that leave 2·cp chunks of >= {MIN_CP_CHUNK} tokens), tp "
                  f"divide the {model.n_head} heads, v ≤ ceil(layers/pp) with at least pp micro-batches"
                  f"{f' (a multiple of pp under {runs.name})' if runs.interleaved_groups else ''}, and dp·mb "
                  f"divide the global batch {global_batch}")
    else:
        reason = (f"no layout of {cluster.gpus} GPUs divides global batch {global_batch} "
                  f"(micro-batches {micro_batches})")
    return SearchResult(ranked[0] if ranked else None, ranked, rejected, reason, model, cluster,
                        global_batch, calib, precision, headroom, stack)


@dataclass(frozen=True)
class NoFit:
    """Why a layout was rejected for memory, written out only when read (a search rejects thousands)."""

    need: float
    usable: float
    hbm_gib: float
    headroom: float

    def __str__(self) -> str:
        return (f"does not fit: needs {self.need / GiB:.1f} GiB > {self.usable / GiB:.1f} GiB usable "
                f"({self.hbm_gib:g} GiB HBM, {self.headroom:.0%} headroom)")

    def startswith(self, prefix: str) -> bool:
        return str(self).startswith(prefix)

    def __contains__(self, text: str) -> bool:
        return text in str(self)
