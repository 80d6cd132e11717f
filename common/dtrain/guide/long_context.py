"""The guide's sequence-length axis: the layout the cost model picks for long sequences, with and
without context parallelism, and the rule of when CP beats more TP or PP, computed from those cells.

Grid: the Llama 3 8B, 70B, 405B shapes of ``dtrain.guide.models`` x sequence 4K, 32K, 128K x 64
and 512 GPUs (8 per node on NVLink, 400 Gbit/s per GPU), a batch of about 4M tokens per step
(4M / seq sequences; at least one per DP rank), BF16. Each cell is searched twice: freely (CP
allowed) and with cp = 1.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass, replace

from dtrain.costmodel import Calibration, search
from dtrain.costmodel.hardware import GiB
from dtrain.costmodel.links import LinkCalibration
from dtrain.costmodel.layout_space import MIN_CP_CHUNK
from dtrain.costmodel.uncertainty import ErrorBand

from .matrix import cluster_for
from .models import LONG_MODELS, model_label, shape

SHAPES = {model_label(p): shape(p, 4096) for p in LONG_MODELS}  # the guide's one set of models
SEQS = (4096, 32768, 131072)
GPUS = (64, 512)
TOKENS_PER_STEP = 4 * 1024 * 1024


@dataclass(frozen=True)
class LongCell:
    model: str
    seq: int
    gpus: int
    best: str = ""  # "" when nothing fits
    cp: int = 1
    mfu: float = 0.0
    mem_gib: float = 0.0
    tokens_per_s: float = 0.0
    plain: str = ""  # the best layout with cp = 1 ("" when nothing fits without CP)
    plain_tokens_per_s: float = 0.0
    plain_mem_gib: float = 0.0  # with cp = 1: the smallest memory need when nothing fits

    @property
    def cp_gain(self) -> float | None:
        """How much faster the free choice is than the best plan without CP (None: CP is the only
        fit)."""
        return self.tokens_per_s / self.plain_tokens_per_s - 1 if self.plain_tokens_per_s else None


def _layout(p) -> str:
    cp = f" cp{p.cp}{' ulysses' if p.cp_impl == 'ulysses' else ''}" if p.cp > 1 else ""
    return (
        f"dp{p.dp}{cp} tp{p.tp} pp{p.pp}"
        + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
        + f" Z{p.zero_stage}"
        + (f" {p.recompute} rc" if p.recompute != "none" else "")
    )


def long_search(args) -> tuple:
    """One search of the grid: (model, seq, GPUs, free?) -> the summary ``long_cells`` assembles
    (picklable)."""
    name, seq, gpus, free, calib, links, gpu = args
    shape = replace(SHAPES[name], seq_len=seq)
    cluster = cluster_for(gpu, gpus, "NVLink", 400, links)
    batch = max(TOKENS_PER_STEP // seq, 1)
    res = search(
        shape, cluster, batch, calib, prune=True, keep_within=1.0, fixed=None if free else {"cp": 1}
    )
    if res.best is None:
        needs = [w.need for _, w in res.rejected_with_reasons if hasattr(w, "need")]
        return (name, seq, gpus, free, None, min(needs) / GiB if needs else 0.0)
    b = res.best
    return (
        name,
        seq,
        gpus,
        free,
        (_layout(b), b.cp, b.time.mfu, b.time.tokens_per_s),
        b.memory.total / GiB,
    )


def long_tasks(
    calib: Calibration, links: LinkCalibration | None, gpu: str = "h100-sxm"
) -> list[tuple]:
    """Every search of the grid, the longest first (405B, 128K tokens, 512 GPUs), so two workers
    finish together."""
    grid = [
        (m, s, g, free, calib, links, gpu)
        for m in SHAPES
        for s in SEQS
        for g in GPUS
        for free in (True, False)
    ]
    return sorted(grid, key=lambda a: -(SHAPES[a[0]].n_layer * a[1] * a[2]))


def long_cells(found: list[tuple]) -> list[LongCell]:
    """The cells, in grid order (model, seq, GPUs), from ``long_search``'s results in any order."""
    by = {(r[0], r[1], r[2], r[3]): r for r in found}
    out = []
    for name in SHAPES:
        for seq in SEQS:
            for gpus in GPUS:
                cell = LongCell(name, seq, gpus)
                _, _, _, _, best, mem = by[name, seq, gpus, True]
                if best is not None:
                    layout, cp, mfu, tps = best
                    cell = replace(cell, best=layout, cp=cp, mfu=mfu, mem_gib=mem, tokens_per_s=tps)
                _, _, _, _, plain, mem = by[name, seq, gpus, False]
                if plain is not None:
                    cell = replace(
                        cell, plain=plain[0], plain_tokens_per_s=plain[3], plain_mem_gib=mem
                    )
                else:
                    cell = replace(cell, plain_mem_gib=mem)
                out.append(cell)
    return out


def compute_long(
    calib: Calibration, links: LinkCalibration | None, gpu: str = "h100-sxm", pool=None
) -> list[LongCell]:
    """Every cell; the searches run on ``pool`` (a multiprocessing pool) when given, else on the
    usable cores."""
    tasks = long_tasks(calib, links, gpu)
    if pool is not None:
        return long_cells(pool.map(long_search, tasks, chunksize=1))
    workers = min(len(os.sched_getaffinity(0)), 8)
    if workers <= 1:
        return long_cells([long_search(a) for a in tasks])
    with multiprocessing.get_context("fork").Pool(workers) as p:
        return long_cells(p.map(long_search, tasks, chunksize=1))


def cp_rule(cells: list[LongCell]) -> str:
    """When CP beats more TP/PP, in numbers from the cells."""
    by_seq = {}
    for s in SEQS:
        mine = [c for c in cells if c.seq == s and c.best]
        use = [c for c in mine if c.cp > 1]
        only = [c for c in use if c.cp_gain is None]
        gains = [c.cp_gain for c in use if c.cp_gain is not None]
        by_seq[s] = (len(use), len(mine), len(only), gains)
    parts = []
    for s, (use, n, only, gains) in by_seq.items():
        g = (
            f", {min(gains):.0%} to {max(gains):.0%} faster than the best plan without it"
            if gains
            else ""
        )
        o = f"; in {only} of them nothing fits without it" if only else ""
        parts.append(f"at {s // 1024}K tokens CP is chosen in {use} of {n} cells that fit{g}{o}")
    short = min(SEQS)
    why_short = (
        f" At {short // 1024}K tokens each rank's chunks would be under {MIN_CP_CHUNK:,} tokens, "
        "where fused attention runs far below its rate, so the search does not split them."
        if by_seq[short][0] == 0
        else ""
    )
    return (
        "**Context parallelism is for long sequences.** "
        + _sentence("; ".join(parts))
        + ". CP splits every sequence, so activations per GPU fall by cp while each rank sends "
        "its K and V chunk around the ring (2·s·kv bytes per layer, hidden behind the "
        "attention, which grows with s²) or swaps sequence for heads with all-to-alls; more "
        "TP instead adds per-layer all-reduces of s·h on the critical path and more PP a "
        "bubble, and neither divides the attention's work." + why_short
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def long_context_section(
    cells: list[LongCell], band: ErrorBand | None = None, hbm_gib: float = 0.0
) -> list[str]:
    """The table; with ``band``: CP's gain marked ``≈`` when it is within the backtest's error (CP
    and the best plan without it tie), memory marked ``⚠`` within the memory check's band of
    ``hbm_gib``."""
    out = [
        "## Long context: sequence length and context parallelism",
        "",
        "The layout the cost model picks for the Llama 3 models of *Models* (8B, 70B, 405B: the "
        "matrix's shapes) at 4K, 32K and 128K tokens per sequence on H100 (8 per node, NVLink, "
        "400 Gbit/s per GPU), about "
        f"{TOKENS_PER_STEP // 2**20}M tokens per step, BF16, with context parallelism allowed "
        "(`dtrain plan --seq ...`) and without it (`--layout cp=1`). Layout: dp×cp×tp×pp, ZeRO "
        "stage, recompute; MFU counts the full (non-causal) attention FLOPs, as PaLM and "
        "Megatron do, so at 128K tokens it runs high."
        + (
            f" `≈`: CP's gain is within {band.time_text()}, a tie with the best plan without "
            f"it; `⚠`: memory within {band.memory_text()} of the {hbm_gib:g} GiB HBM (may run "
            "out of memory)."
            if band
            else ""
        ),
        "",
        cp_rule(cells),
        "",
        "| model | seq | GPUs | best layout | MFU | memory/GPU | best without CP | CP's gain |",
        "|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for c in cells:
        if not c.best:
            out.append(f"| {c.model} | {c.seq:,} | {c.gpus} | does not fit | | | | |")
            continue
        plain = c.plain or f"does not fit (needs ≥ {c.plain_mem_gib:.0f} GiB)"
        gain = "—" if c.cp == 1 else ("only fit" if c.cp_gain is None else f"{c.cp_gain:+.0%}")
        if (
            band
            and c.cp > 1
            and c.cp_gain is not None
            and band.tie(c.tokens_per_s, c.plain_tokens_per_s)
        ):
            gain += " ≈"
        risk = " ⚠" if band and hbm_gib and band.memory_risk(c.mem_gib, hbm_gib) else ""
        out.append(
            f"| {c.model} | {c.seq:,} | {c.gpus} | {c.best} | {c.mfu:.0%} | {c.mem_gib:.0f} GiB"
            f"{risk} | "
            f"{plain} | {gain} |"
        )
    return out + [""]
