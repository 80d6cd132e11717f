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
from .compute import Stack
from .memory import RECOMPUTE, Layout, MemoryBreakdown, ModelShape, memory_per_gpu
from .timemodel import Calibration, StepTime, group_link, step_model, step_time

__all__ = ["Cluster", "Calibration", "Plan", "SearchResult", "search", "explain"]

MICRO_BATCHES = (1, 2, 4, 8, 16)
# Memory does not depend on the links: a grid over bandwidths (the guide) reuses it.
_memory = lru_cache(maxsize=1 << 17)(memory_per_gpu)
VIRTUAL_STAGES = (1, 2, 4, 8)
# A pruned search skips a layout whose compute alone is this many times the best step: it can be neither the
# best nor one of the runners-up ``explain`` names.
PRUNE_BOUND = 1.5
# The least model-state bytes per parameter any layout keeps, summed over its GPUs: ZeRO-3 (FSDP) sharding
# every state over every GPU (memory.py's 16/N at stage 3); a layout's busiest GPU holds at least 1/N of them.
STATE_BYTES_FLOOR = 16.0
LAYOUT_FIELDS = ("dp", "tp", "pp", "virtual_stages", "zero_stage", "recompute", "micro_batch", "sequence_parallel",
                 "pp_schedule", "cp", "cp_impl")
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
    stack: Stack = field(default_factory=Stack)   # attention kernel, fused or eager kernels and loss

    @property
    def flash_attention(self) -> bool:
        return self.stack.flash


def describe_layout(lay: Layout) -> str:
    cp = f" cp={lay.cp}{' ulysses' if lay.cp_impl == 'ulysses' else ''}" if lay.cp > 1 else ""
    v = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    sched = f" {lay.pp_schedule}" if lay.pp > 1 and lay.pp_schedule != "1f1b" else ""
    sp = " sp" if lay.sequence_parallel else ""
    return (f"dp={lay.dp}{cp} tp={lay.tp} pp={lay.pp}{v}{sched} zero={lay.zero_stage} "
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
                  if model.seq_len % (2 * c) == 0 and model.seq_len // (2 * c) >= MIN_CP_CHUNK]


def _layouts(model: ModelShape, cluster: Cluster, global_batch: int, micro_batches, recompute, prune=False,
             fixed: dict | None = None, context_parallel: bool = True) -> tuple:
    """``_enumerate``'s layouts, kept per what they depend on (the GPU count and node size, not the links: the
    decision matrix searches each (model, GPUs) for eight link settings)."""
    return _enumerated(model, cluster.gpus, cluster.node_size, global_batch, tuple(micro_batches), tuple(recompute),
                       prune, tuple(sorted((fixed or {}).items())), context_parallel)


@lru_cache(maxsize=64)
def _enumerated(model, gpus, node_size, global_batch, micro_batches, recompute, prune, fixed, context_parallel):
    return tuple(_enumerate(model, gpus, node_size, global_batch, micro_batches, recompute, prune, dict(fixed),
                            context_parallel))


def _enumerate(model: ModelShape, n: int, node_size: int, global_batch: int, micro_batches, recompute, prune=False,
               fixed: dict | None = None, context_parallel: bool = True):
    """Yield (layout, None) for candidates and (layout, reason) for batch-shape rejections;
    ``prune`` leaves out ZeRO-0 when dp > 1 and SP off when tp > 1 (see ``search``); ``fixed``
    (field -> value, names of ``LAYOUT_FIELDS``) keeps only the layouts with those values."""
    fixed = fixed or {}
    for tp in _pow2_up_to(min(2 * node_size, model.n_head)) if "tp" not in fixed else [fixed["tp"]]:
        if model.n_head % tp or n % tp:
            continue
        cps = ([fixed["cp"]] if model.seq_len % (2 * fixed["cp"]) == 0 else []) if "cp" in fixed else (context_parallel_degrees(model, n // tp) if context_parallel
                                                    else [1])
        for cp, pp in ((c, p) for c in cps if (n // tp) % c == 0
                       for p in range(1, min(model.n_layer, n // (tp * c)) + 1) if (n // (tp * c)) % p == 0):
            dp = n // (tp * cp * pp)
            if ("pp" in fixed and pp != fixed["pp"]) or ("dp" in fixed and dp != fixed["dp"]):
                continue
            ulysses = cp > 1 and (model.n_head // tp) % cp == 0  # all-to-all swaps sequence shards for head shards
            impls = ["ring"] + (["ulysses"] if ulysses else [])
            if "cp_impl" in fixed:
                impls = [i for i in impls if i == fixed["cp_impl"]]
            for mb in micro_batches:
                if global_batch % (dp * mb):
                    yield Layout(dp, tp, pp, micro_batch=mb), (
                        f"global batch {global_batch} is not a multiple of dp·micro_batch = {dp * mb}")
                    continue
                ga = global_batch // (dp * mb)
                vs = [v for v in ([fixed["virtual_stages"]] if "virtual_stages" in fixed else VIRTUAL_STAGES)
                      if v == 1 or (pp > 1 and v <= -(-model.n_layer // pp) and ga >= pp)]
                for v, sched, impl in ((v, sc, i) for v in vs for sc in _schedules(pp, v, fixed) for i in impls):
                    zeros = ((1, 2, 3) if prune else (0, 1, 2, 3)) if dp * cp > 1 else (0,)
                    for zero in [z for z in zeros if z == fixed.get("zero_stage", z)]:
                        for rc in recompute:
                            for sp in ((True,) if prune else (False, True)) if tp > 1 else (False,):
                                lay = Layout(dp, tp, pp, zero, rc, mb, ga, sp, v, sched, cp, impl)
                                if not fixed or all(getattr(lay, k) == val for k, val in fixed.items()):
                                    yield lay, None


def _design(lay: Layout) -> tuple:
    """A layout but for its ZeRO stage."""
    return (lay.dp, lay.cp, lay.cp_impl, lay.tp, lay.pp, lay.micro_batch, lay.virtual_stages, lay.pp_schedule,
            lay.recompute, lay.sequence_parallel)


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
    levels = tuple(r for r in RECOMPUTE if not (flash_attention and r == "selective"))
    if fixed and "recompute" in fixed:
        levels = (fixed["recompute"],)
    if fixed and "micro_batch" in fixed:
        micro_batches = (fixed["micro_batch"],)
    timed: set[tuple] = set()
    step_time(model, Layout(1, 1, 1), cluster, calib, precision, stack=stack)  # checks precision vs the GPU
    floor = STATE_BYTES_FLOOR * model.num_params() / cluster.gpus
    if prune and floor > usable:  # no layout can fit: skip timing thousands (the matrix's small-cluster cells)
        reason = (f"does not fit: even sharded over all {cluster.gpus} GPUs (ZeRO-3) the weights, gradients and "
                  f"Adam states need {floor / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB usable on "
                  f"{cluster.gpus}x {cluster.gpu.name}")
        return SearchResult(None, [], [], reason, model, cluster, global_batch, calib, precision, headroom, stack)
    steps = step_model(model, cluster, calib, precision, 2, stack)
    candidates = []
    bounds: dict[tuple, float] = {}  # the bound does not depend on the ZeRO stage: once per design
    for lay, why in _layouts(model, cluster, global_batch, micro_batches, levels, prune, fixed, flash_attention):
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
        mem = _memory(model, lay, act_factor, flash_attention, stack.fused_loss)
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
        reason = (f"does not fit: even the smallest plan ({_short(smallest[1])}) needs "
                  f"{smallest[0] / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB usable on "
                  f"{cluster.gpus}x {cluster.gpu.name}")
    elif fixed:
        reason = (f"no layout of {cluster.gpus} GPUs matches {fixed}: dp·cp·tp·pp must equal the GPUs (a cp left "
                  f"out is searched over powers of two that leave 2·cp chunks of >= {MIN_CP_CHUNK} tokens), tp "
                  f"divide the {model.n_head} heads, v ≤ ceil(layers/pp) with at least pp micro-batches, and dp·mb "
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


def _short(lay: Layout) -> str:
    return describe_layout(lay)


def _ms(seconds: float) -> str:
    if seconds == 0:
        return "0 ms/step"
    return f"{seconds * 1e3:.0f} ms/step" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms/step"


def _why_slower(p: Plan, best: Plan, cluster: Cluster) -> str:
    """One clause naming the step-time component that grew most against ``best``."""
    a, b = p.time, best.time
    deltas = {k: getattr(a, k) - getattr(b, k)
              for k in ("compute", "dp_comm_exposed", "tp_comm", "cp_comm", "pp_comm", "bubble")}
    part = max(deltas, key=deltas.get)
    if part == "cp_comm":
        how = "all-to-alls" if p.cp_impl == "ulysses" else "ring sends not hidden by attention"
        return f"cp={p.cp}: context-parallel {how} cost {_ms(a.cp_comm)} vs {_ms(b.cp_comm)}"
    if part == "tp_comm":
        if p.tp > cluster.node_size:
            return (f"tp={p.tp} crosses nodes: TP all-reduce over IB costs {_ms(a.tp_comm)} "
                    f"vs {_ms(b.tp_comm)}")
        return f"tp={p.tp}: TP all-reduces cost {_ms(a.tp_comm)} vs {_ms(b.tp_comm)}"
    if part == "bubble":
        frac = (p.pp - 1) / (p.virtual_stages * p.grad_accum)
        return (f"pp={p.pp}: pipeline bubble (p-1)/(v*m) = {frac:.1%} costs {_ms(a.bubble)} "
                f"vs {_ms(b.bubble)}")
    if part == "pp_comm":
        return f"pp={p.pp}: stage-to-stage sends cost {_ms(a.pp_comm)} vs {_ms(b.pp_comm)}"
    if part == "dp_comm_exposed":
        link = group_link(cluster, p.dp, p.tp).name or "link"
        return (f"ZeRO-{p.zero_stage} over dp={p.dp} ({link}) exposes {_ms(a.dp_comm_exposed)} of DP "
                f"traffic vs {_ms(b.dp_comm_exposed)}")
    if p.recompute != best.recompute:
        return f"recompute={p.recompute} adds {_ms(deltas['compute'])} of re-run forward"
    return f"compute costs {_ms(deltas['compute'])} more"


def explain(result: SearchResult, k: int = 5) -> list[str]:
    """Sentences: the best plan; why each of the next ``k`` distinct designs (tp, pp, ZeRO stage,
    recompute) lost; and which designs would have been faster but do not fit in memory."""
    if result.best is None:
        return [result.reason]
    best = result.best
    out = [f"best: {best.describe()}: {best.time.tokens_per_s:,.0f} tokens/s, MFU {best.time.mfu:.1%}, "
           f"{best.memory.total / GiB:.1f} GiB/GPU"]
    for p in _runners_up(result, k):
        loss = 1 - p.time.tokens_per_s / best.time.tokens_per_s
        out.append(f"{p.describe()}: {loss:.1%} slower; {_why_slower(p, best, result.cluster)}")
    return out + _without_cp(result) + _faster_but_too_big(result, k)


def _without_cp(result: SearchResult) -> list[str]:
    """Why context parallelism, when the best plan uses it: the best plan without it, or why none fits."""
    best = result.best
    if best.cp <= 1:
        return []
    s = result.model.seq_len
    plain = next((p for p in result.ranked if p.cp == 1), None)
    if plain is not None:
        loss = 1 - plain.time.tokens_per_s / best.time.tokens_per_s
        return [f"cp={best.cp} splits each {s:,}-token sequence over {best.cp} GPUs ({s // best.cp:,} tokens each): "
                f"without context parallelism the best plan, {plain.describe()}, is {loss:.1%} slower "
                f"({_why_slower(plain, best, result.cluster)})"]
    need = [(str(w), lay) for lay, w in result.rejected_with_reasons if lay.cp == 1 and str(w).startswith("does not")]
    smallest = min(need, key=lambda x: float(x[0].split("needs ")[1].split(" GiB")[0]), default=None)
    why = f": the smallest ({describe_layout(smallest[1])}) {smallest[0][len('does not fit: '):]}" if smallest else ""
    return [f"cp={best.cp} splits each {s:,}-token sequence over {best.cp} GPUs ({s // best.cp:,} tokens each, "
            f"activations / {best.cp}): without context parallelism no layout fits in memory{why}"]


def _runners_up(result: SearchResult, k: int) -> list[Plan]:
    """The fastest plan of each next design; a design that only trades memory at equal speed
    (ZeRO-0 vs ZeRO-1, same tp/pp/recompute) is not listed twice."""
    best = result.ranked[0]
    seen = {(best.tp, best.pp, best.zero_stage, best.recompute)}
    speeds = {(best.tp, best.pp, best.recompute, best.time.tokens_per_s)}
    out = []
    for p in result.ranked[1:]:
        design = (p.tp, p.pp, p.zero_stage, p.recompute)
        speed = (p.tp, p.pp, p.recompute, p.time.tokens_per_s)
        if design not in seen and speed not in speeds:
            out.append(p)
            if len(out) == k:
                break
        seen.add(design)
        speeds.add(speed)
    return out


def _faster_but_too_big(result: SearchResult, k: int) -> list[str]:
    """Designs (tp, pp, recompute) whose memory-rejected variants would beat the best, with the
    smallest memory among those faster variants."""
    target = result.best.time.tokens_per_s
    act = result.calib.fp8_memory_factor.value if result.precision == "fp8" else 1.0
    groups: dict[tuple, list] = {}  # design -> [max tokens/s, min bytes, smallest layout]
    for lay, why in result.rejected_with_reasons:
        if not why.startswith("does not fit"):
            continue
        tps = step_time(result.model, lay, result.cluster, result.calib, result.precision,
                        stack=result.stack).tokens_per_s
        if tps <= target:
            continue
        need = memory_per_gpu(result.model, lay, act, result.flash_attention, result.stack.fused_loss).total
        g = groups.setdefault((lay.cp, lay.tp, lay.pp, lay.recompute), [0.0, float("inf"), lay])
        g[0] = max(g[0], tps)
        if need < g[1]:
            g[1:] = [need, lay]
    usable = result.cluster.gpu.hbm_bytes * (1 - result.headroom) / GiB
    return [f"dp={lay.dp}{f' cp={lay.cp}' if lay.cp > 1 else ''} tp={lay.tp} pp={lay.pp} recompute={lay.recompute} would be up to "
            f"{tps / target - 1:.1%} faster but does not fit: the smallest faster variant "
            f"({_short(lay)}) needs {need / GiB:.1f} GiB > {usable:.1f} GiB usable"
            for tps, need, lay in sorted(groups.values(), key=lambda g: -g[0])[:k]]
