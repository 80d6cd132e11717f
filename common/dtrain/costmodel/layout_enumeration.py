"""Walking the layout space (``layout_space``): the layouts of ``AXES`` that pass ``FILTERS``, depth
first, each filter right after its axis; kept per what they depend on (``_layouts``)."""

from __future__ import annotations

from functools import lru_cache

from .hardware import Cluster
from .software import SOFTWARE, Software
from .shapes import Layout, ModelShape
from .layout_space import AXES, FILTERS, LAYOUT_FIELDS, Axis, Filter, Space


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
