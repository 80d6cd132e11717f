"""The layout search for an MoE model: every layout ``search`` enumerates for the dense proxy,
times each ep (and etp) it can fold (``moe_layout.ep_degrees``), priced as the proxy's step plus the
routed experts' terms (``moe_cost.moe_terms``) and its memory with the experts
(``moe_memory.moe_memory``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .calibration import Calibration
from .hardware import Cluster
from .memory import MemoryBreakdown
from .layout_enumeration import _layouts
from .moe_cost import MoETerms, moe_terms
from .moe_layout import ep_degrees
from .moe_memory import moe_memory
from .moe_model import MoEModel
from .search import MICRO_BATCHES, _memory, describe_layout
from .shapes import RECOMPUTE, Layout
from .stack import Stack
from .step_breakdown import StepTime
from .timemodel import step_model

# bytes per value of the dispatch by precision (FP8 dispatch: DeepEP, Megatron's
# --moe-router-... fp8 dispatch); the combine stays bf16
DISPATCH_BYTES = {"bf16": 2, "fp8": 1, "mxfp8": 1}


@dataclass(frozen=True)
class MoEPlan:
    """A layout (with ep, etp) and its memory, the proxy's step time with the total and the model
    FLOPs of the MoE model, and the routed experts' terms."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    moe: MoETerms
    memory_terms: dict

    def describe(self) -> str:
        return describe(self.layout)


def describe(lay: Layout) -> str:
    """``search.describe_layout`` with ep (and etp) before tp."""
    etp = f" etp={lay.etp}" if lay.etp > 1 else ""
    return describe_layout(lay).replace(" tp=", f" ep={lay.ep}{etp} tp=", 1)


@dataclass
class MoESearchResult:
    best: MoEPlan | None
    ranked: list[MoEPlan]
    rejected: int
    reason: str
    model: MoEModel
    cluster: Cluster
    global_batch: int
    precision: str = "bf16"
    headroom: float = 0.1
    stack: Stack = field(default_factory=Stack)
    calib: Calibration = field(default_factory=Calibration)
    smallest_bytes: float = 0.0  # when nothing fits: the least memory a layout needs

    def best_at(self, **fields) -> MoEPlan | None:
        """The best plan whose layout has these field values (e.g. ep=1)."""
        for p in self.ranked:
            if all(getattr(p.layout, k) == v for k, v in fields.items()):
                return p
        return None


# The routed experts' terms a dense proxy's lower bound does not hold can be negative (their DP
# traffic and optimizer replace the proxy's routed weights'; grouped GEMMs at large rows): a pruned
# search bounds a layout's step by this share of the proxy's lower bound.
BOUND_MARGIN = 0.8


def _gemm_precision(precision: str) -> str:
    """MXFP8 runs its GEMMs at the FP8 rate."""
    return "fp8" if precision in ("fp8", "mxfp8") else "bf16"


def memory_of(
    model: MoEModel, lay: Layout, stack: Stack = Stack(), act_factor: float = 1.0
) -> tuple[MemoryBreakdown, dict]:
    """A layout's memory per GPU with the experts (``moe_memory.moe_memory`` over the proxy's)."""
    proxy_mem = _memory(model.proxy, lay, stack, act_factor)
    return moe_memory(model, lay, proxy_mem, stack.grad_bytes, stack.optimizer_states, act_factor)


def price(
    model: MoEModel,
    lay: Layout,
    cluster: Cluster,
    calib: Calibration,
    precision: str = "bf16",
    stack: Stack = Stack(),
    act_factor: float = 1.0,
    memory: tuple[MemoryBreakdown, dict] | None = None,
    value_bytes: int = 2,
) -> MoEPlan:
    """One layout's MoE plan (its memory is not checked against HBM here). ``value_bytes``: 4 for
    an fp32 run (the guide's local check), its weights, activations and dispatched rows."""
    steps = step_model(model.proxy, cluster, calib, _gemm_precision(precision), value_bytes, stack)
    st = steps.time(lay)
    dp_share = st.dp_comm_exposed / st.dp_comm if st.dp_comm > 0 else 1.0
    dtype = "fp8" if steps.fp8_gemms else "bf16"
    terms = moe_terms(
        model,
        lay,
        cluster,
        steps.dev,
        proxy_gemm_s=st.terms.gemm,
        proxy_attention_s=st.terms.attention,
        proxy_work_s=st.compute - st.terms.optimizer,
        dp_exposed_share=min(dp_share, 1.0),
        dtype=dtype,
        dispatch_bytes=DISPATCH_BYTES[precision] if value_bytes == 2 else value_bytes,
        combine_bytes=value_bytes,
        value_bytes=value_bytes,
        grad_bytes=stack.grad_bytes,
    )
    mem, mem_terms = memory or memory_of(model, lay, stack, act_factor)
    total = st.total + terms.total
    time = replace(st, total=total, model_flops=st.tokens * model.flops_per_token())
    return MoEPlan(lay, mem, time, terms, mem_terms)


def moe_search(
    model: MoEModel,
    cluster: Cluster,
    global_batch: int,
    calib: Calibration | None = None,
    *,
    precision: str = "bf16",
    headroom: float = 0.1,
    stack: Stack = Stack(),
    fixed: dict | None = None,
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    prune: bool = True,
    expert_tp: bool = True,
    keep_within: float | None = None,
) -> MoESearchResult:
    """Rank the layouts x ep x etp (1, or tp: Megatron's expert TP) that fit by predicted
    tokens/s. ``prune``: the dense search's pruning (ZeRO from 1 up, SP on where it runs);
    ``expert_tp`` False: etp 1 only. ``keep_within``: time the fitting layouts in the order of the
    dense proxy's lower bound (``StepModel.lower_bound``) x BOUND_MARGIN and stop once it exceeds
    ``keep_within`` x the best step (1.0: the best alone, as the guide asks)."""
    calib = calib or Calibration()
    fixed = dict(fixed or {})
    ep_pin, etp_pin = fixed.pop("ep", None), fixed.pop("etp", None)
    levels = tuple(
        r for r in RECOMPUTE if r in stack.runs.recompute and not (stack.flash and r == "selective")
    )
    if "recompute" in fixed:
        levels = (fixed["recompute"],)
    if "micro_batch" in fixed:
        micro_batches = (fixed["micro_batch"],)
    usable = cluster.gpu.hbm_bytes * (1 - headroom)
    act_factor = calib.fp8_memory_factor.value if precision != "bf16" else 1.0
    ranked: list[MoEPlan] = []
    rejected, smallest = 0, None
    layouts = _layouts(
        model.proxy,
        cluster,
        global_batch,
        micro_batches,
        levels,
        prune,
        fixed,
        stack.flash,
        stack.runs,
    )
    fitting = []
    for lay, why in layouts:
        if why:
            rejected += 1
            continue
        eps = ep_degrees(model, lay) if ep_pin is None else [ep_pin]
        for ep in eps:
            etps = (1, lay.tp) if lay.tp > 1 and expert_tp else (1,)
            for etp in etps if etp_pin is None else (etp_pin,):
                try:
                    cand = replace(lay, ep=ep, etp=etp)
                except ValueError:
                    rejected += 1
                    continue
                if model.moe.experts % ep:
                    rejected += 1
                    continue
                mem = memory_of(model, cand, stack, act_factor)
                if mem[0].total > usable:
                    rejected += 1
                    if smallest is None or mem[0].total < smallest[0]:
                        smallest = (mem[0].total, cand)
                    continue
                fitting.append((cand, mem))
    if keep_within is not None:
        steps = step_model(model.proxy, cluster, calib, _gemm_precision(precision), 2, stack)
        bounds = [BOUND_MARGIN * steps.lower_bound(c) for c, _ in fitting]
        order = sorted(range(len(fitting)), key=bounds.__getitem__)
        best = float("inf")
        for i in order:
            if bounds[i] > keep_within * best:
                break
            plan = price(
                model, *fitting[i][:1], cluster, calib, precision, stack, act_factor, fitting[i][1]
            )
            best = min(best, plan.time.total)
            ranked.append(plan)
    else:
        ranked = [
            price(model, c, cluster, calib, precision, stack, act_factor, mem) for c, mem in fitting
        ]
    ranked.sort(key=lambda p: (-p.time.tokens_per_s, p.memory.total))
    if ranked:
        reason = f"best of {len(ranked)} fitting plans ({rejected} rejected)"
    elif smallest is not None:
        reason = (
            f"does not fit: even the smallest plan ({describe(smallest[1])}) needs "
            f"{smallest[0] / 1024**3:.1f} GiB per GPU > {usable / 1024**3:.1f} GiB usable on "
            f"{cluster.gpus}x {cluster.gpu.name}"
        )
    else:
        reason = (
            f"no layout of {cluster.gpus} GPUs matches: ep must divide the {model.moe.experts} "
            "experts and dp_shard·cp·tp, and dp·mb the global batch"
        )
    return MoESearchResult(
        ranked[0] if ranked else None,
        ranked,
        rejected,
        reason,
        model,
        cluster,
        global_batch,
        precision,
        headroom,
        stack,
        calib,
        smallest[0] if smallest else 0.0,
    )
