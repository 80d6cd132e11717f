"""The rules the decision matrix shows, in words, computed from its cells (never hand-written,
so they cannot contradict the matrix they summarise)."""

from __future__ import annotations

import statistics
from collections import Counter

from .matrix import GPU_COUNTS, IB_GBITS, MODELS, Cell, model_label

REFERENCE_IB = 400


def _fit(cells: list[Cell]) -> list[Cell]:
    return [c for c in cells if c.fits]


def _ranges(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def rule_memory_floor(cells: list[Cell]) -> str:
    parts = []
    for p in MODELS:
        ok = [c.gpus for c in _fit(cells) if c.params == p]
        parts.append(f"{model_label(p)} ≥ {min(ok)}" if ok else f"{model_label(p)} never")
    return (
        "**Memory sets the floor.** Smallest GPU count of the grid at which each model fits at "
        "all: "
        + ", ".join(parts)
        + ". Below it no DP×TP×PP, ZeRO stage or recompute setting fits the "
        "weights, gradients, optimizer state and activations in HBM."
    )


def rule_tp_in_node(cells: list[Cell]) -> str:
    fit = _fit(cells)
    wide = [c for c in fit if c.tp > 8]
    if not wide:
        return (
            f"**Tensor parallelism stays inside a node.** TP ≤ 8 in all {len(fit)} cells that "
            "fit: its per-layer all-reduces sit on the critical path and would cross InfiniBand "
            "otherwise."
        )
    return (
        f"**Tensor parallelism crosses nodes in {len(wide)} of {len(fit)} cells** (TP > 8), only "
        "where memory leaves no alternative: "
        + ", ".join(sorted({f"{c.model}@{c.gpus}" for c in wide}))
        + "."
    )


def rule_tp_by_size(cells: list[Cell]) -> str:
    parts = []
    for p in MODELS:
        nv = [c.tp for c in _fit(cells) if c.params == p and c.topology == "NVLink"]
        pc = [c.tp for c in _fit(cells) if c.params == p and c.topology == "PCIe"]
        if nv or pc:
            parts.append(
                f"{model_label(p)}: {_ranges(nv) if nv else '–'} / {_ranges(pc) if pc else '–'}"
            )
    return (
        "**TP degree grows with the model** (range over GPU counts and IB rates, NVLink / PCIe "
        "node): " + "; ".join(parts) + "."
    )


def rule_topology(cells: list[Cell]) -> str:
    pairs = _paired(cells, lambda c: (c.params, c.gpus, c.ib_gbit), "topology", "NVLink", "PCIe")
    if not pairs:
        return ""
    ratio = statistics.median(b.mfu / a.mfu for a, b in pairs)
    tp_nv = sum(a.tp > 1 for a, _ in pairs) / len(pairs)
    tp_pc = sum(b.tp > 1 for _, b in pairs) / len(pairs)
    pp_nv = sum(a.pp > 1 for a, _ in pairs) / len(pairs)
    pp_pc = sum(b.pp > 1 for _, b in pairs) / len(pairs)
    head = (
        "Without NVLink, trade TP for PP."
        if tp_pc < tp_nv and pp_pc > pp_nv
        else "PCIe vs NVLink nodes."
    )
    return (
        f"**{head}** Over {len(pairs)} cells that fit on both node types, a PCIe "
        f"node uses TP > 1 in {tp_pc:.0%} of cells (NVLink: {tp_nv:.0%}) and PP > 1 in {pp_pc:.0%} "
        f"(NVLink: {pp_nv:.0%}); its predicted MFU is {ratio:.0%} of the NVLink node's (median)."
    )


def rule_pipeline(cells: list[Cell]) -> str:
    nv = [c for c in _fit(cells) if c.topology == "NVLink"]
    with_pp = [c for c in nv if c.pp > 1]
    if not with_pp:
        return "**No pipeline parallelism** is chosen on NVLink nodes."
    smallest = min(with_pp, key=lambda c: c.params)
    share = {
        model_label(p): sum(c.pp > 1 for c in nv if c.params == p)
        / max(1, sum(c.params == p for c in nv))
        for p in MODELS
    }
    inter = sum(c.virtual_stages > 1 for c in with_pp) / len(with_pp)
    return (
        f"**Pipeline parallelism enters from {smallest.model}** on NVLink nodes; share of fitting "
        "cells with PP > 1: "
        + ", ".join(f"{k} {v:.0%}" for k, v in share.items())
        + f". {inter:.0%} of those use the interleaved schedule (v > 1) to shrink the bubble "
        "(p−1)/(v·m)."
    )


def rule_zero(cells: list[Cell]) -> str:
    fit = _fit(cells)
    counts = Counter(c.zero for c in fit)
    flat = [c for c in fit if c.zero == 3 and c.pp == 1]
    piped = [c for c in fit if c.zero == 3 and c.pp > 1]
    text = (
        "**ZeRO stage: the least memory among the fastest.** Stages chosen over all fitting cells: "
        + ", ".join(f"ZeRO-{z} {n}" for z, n in sorted(counts.items()))
        + ". From ZeRO-1 up a higher stage never shortens the predicted step, and ZeRO-1 moves "
        "less than ZeRO-0 (fp32 reduce-scatter + bf16 all-gather against an fp32 all-reduce). "
    )
    if flat:
        text += (
            "Without PP, ZeRO-3 gathers the weights again for every micro-batch; it is chosen in "
            f"{len(flat)} cells ("
            + ", ".join(sorted({c.model for c in flat}, key=lambda m: float(m.rstrip("B"))))
            + ") where sharding the bf16 weights is what makes the layout fit, or its traffic "
            "hides behind the backward. "
        )
    if piped:
        text += (
            "Under PP a stage keeps its weights gathered through the step (torchtitan's FSDP "
            "with PP, the trainer's zero3), so ZeRO-3 moves what ZeRO-1 moves with smaller "
            f"states: {len(piped)} cells."
        )
    return text.rstrip()


def rule_recompute(cells: list[Cell]) -> str:
    fit = _fit(cells)
    some = [c for c in fit if c.recompute != "none"]
    if not some:
        return (
            "**No activation recompute** is chosen: with FlashAttention and sequence parallelism "
            "the activations fit in every cell that fits at all."
        )
    floor = {p: min(c.gpus for c in fit if c.params == p) for p in {c.params for c in fit}}
    near = sum(c.gpus <= 4 * floor[c.params] for c in some)
    by_level = "; ".join(
        f"{label} in {len(cs)} ({', '.join(sorted({c.model for c in cs}, key=_size))})"
        for label, cs in (
            ("selective op AC", [c for c in some if c.recompute == "op"]),
            ("full recompute", [c for c in some if c.recompute == "full"]),
        )
        if cs
    )
    return (
        f"**Activation recompute** in {len(some)} of {len(fit)} fitting cells: {by_level}; {near} "
        "of them within 4× of the model's smallest fitting GPU count. Selective op AC "
        "(torchtitan's: every other matmul's output kept) re-runs about a third of a block's "
        "forward matmuls, full recompute the whole forward (a third more compute), so the search "
        "takes them only where the activations would not fit otherwise."
    )


def rule_ib(cells: list[Cell]) -> str:
    lo, hi = min(IB_GBITS), max(IB_GBITS)
    pairs = _paired(cells, lambda c: (c.params, c.gpus, c.topology), "ib_gbit", lo, hi)
    multi = [(a, b) for a, b in pairs if a.gpus > 8]
    if not multi:
        return ""
    loss = statistics.median(1 - a.mfu / b.mfu for a, b in multi)
    worst = max(multi, key=lambda ab: 1 - ab[0].mfu / ab[1].mfu)
    changed = sum((a.dp, a.tp, a.pp, a.zero) != (b.dp, b.tp, b.pp, b.zero) for a, b in multi)
    more_pp = sum(a.pp > b.pp for a, b in multi)
    return (
        f"**InfiniBand bandwidth.** Going from {hi} to {lo} Gbit/s per GPU costs a median "
        f"{loss:.1%} of predicted MFU over {len(multi)} multi-node cells (worst: {worst[0].model} "
        f"on {worst[0].gpus} GPUs, {worst[0].topology} node, {worst[1].mfu:.0%} → "
        f"{worst[0].mfu:.0%}). The chosen DP×TP×PP or ZeRO stage changes in {changed} of them "
        f"({more_pp} with deeper pipelines at {lo} Gbit/s)."
    )


def rule_scale(cells: list[Cell]) -> str:
    parts = []
    for p in MODELS:
        row = sorted(
            (
                c
                for c in _fit(cells)
                if c.params == p and c.topology == "NVLink" and c.ib_gbit == REFERENCE_IB
            ),
            key=lambda c: c.gpus,
        )
        if len(row) >= 2:
            parts.append(
                f"{row[0].model} {row[0].mfu:.0%} @ {row[0].gpus} → {row[-1].mfu:.0%} @ "
                f"{row[-1].gpus}"
            )
    return (
        f"**Scale at a fixed 4M-token batch** (NVLink, {REFERENCE_IB} Gbit/s), predicted MFU from "
        "the smallest to the largest GPU count that fits: "
        + "; ".join(parts)
        + ". More GPUs mean fewer micro-batches each: less compute to hide DP "
        "traffic behind and a larger pipeline bubble."
    )


def rule_micro_batch(cells: list[Cell]) -> str:
    counts = Counter(c.micro_batch for c in _fit(cells))
    return (
        "**Micro-batch.** Chosen sizes: "
        + ", ".join(f"{mb}: {n} cells" for mb, n in sorted(counts.items()))
        + ". A larger micro-batch makes every GEMM larger (higher achieved fraction of the "
        "roofline) but adds activation memory; the search weighs both."
    )


def _size(label: str) -> float:
    return float(label.rstrip("B"))


def _paired(cells, key, field, a_val, b_val):
    a = {key(c): c for c in _fit(cells) if getattr(c, field) == a_val}
    b = {key(c): c for c in _fit(cells) if getattr(c, field) == b_val}
    return [(a[k], b[k]) for k in sorted(a) if k in b]


RULES = (
    rule_memory_floor,
    rule_tp_in_node,
    rule_tp_by_size,
    rule_topology,
    rule_pipeline,
    rule_zero,
    rule_recompute,
    rule_ib,
    rule_scale,
    rule_micro_batch,
)


def derive_rules(cells: list[Cell]) -> list[str]:
    assert len({c.gpus for c in cells}) <= len(GPU_COUNTS)
    return [text for rule in RULES if (text := rule(cells))]
