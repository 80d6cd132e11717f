"""The guide's MoE section: the layout the cost model picks for four MoE classes on 8 to 2,048
GPUs, expert parallelism against EP = 1, the exposed all-to-all share, the sensitivity to routing
imbalance ρ, and a rule for when EP pays on one node, computed from those cells.

Grid: Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 shapes (``MODELS``, each cited)
x (H100: 8, 64, 512, 2,048 GPUs; B200: 8, 512), 8 per node on NVLink, 400 Gbit/s per GPU, 1,024
sequences of 4,096 tokens per step, BF16, balanced routing (ρ = 1), all-to-all dispatch without
A2A overlap, expert TP 1. Each cell is two pruned ``moe_search``es (the best, and the best with
ep = 1); the best layout is priced again at ρ = 1.1 and 1.25.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtrain.costmodel import Calibration
from dtrain.costmodel.hardware import GiB
from dtrain.costmodel.links import LinkCalibration
from dtrain.costmodel.moe_model import MoEModel, MoESpec
from dtrain.costmodel.moe_search import memory_of, moe_search, price
from dtrain.costmodel.shapes import ModelShape
from dtrain.model.flops import MLA

from .matrix import cluster_for

SEQ = 4096
BATCH = 1024  # sequences: 4M tokens per step
RHOS = (1.1, 1.25)
GRID = (
    ("h100-sxm", 8),
    ("h100-sxm", 64),
    ("h100-sxm", 512),
    ("h100-sxm", 2048),
    ("b200", 8),
    ("b200", 512),
)
MICRO_BATCHES = (1, 2, 4)  # the guide's grid: 4 of the plan's 5 sizes cost the most time
_GPU_LABEL = {"h100-sxm": "H100", "b200": "B200"}

# name -> (model, source). Shapes as released:
#   Mixtral-8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1 (32 x 4096, 32 heads / 8 KV,
#     8 experts of 14336, top-2, vocab 32000): 46.7B parameters, 12.9B active.
#   Qwen3-30B-A3B, Qwen3-235B-A22B: the Qwen3 model cards (config.json: 48 x 2048 and 94 x 4096,
#     32 / 4 and 64 / 4 heads of 128, 128 experts of 768 and 1536, top-8, vocab 151936): 30.5B /
#     3.3B and 235B / 22B.
#   DeepSeek-V3: DeepSeek-V3 technical report §4.2 (61 layers, d 7168, 128 heads, MLA with
#     d_c 512, d_c' 1536, d_h 128, d_h^R 64; 1 shared + 256 routed experts of 2048, top-8; the
#     first 3 layers dense, FFN 18432 and vocab 129280 from its config.json): 671B / 37B.
MODELS = {
    "Mixtral-8x7B": MoEModel(
        ModelShape(32, 4096, 32, 8, 32000, SEQ, 1.0, True, name="Mixtral-8x7B"),
        MoESpec(8, 2, 14336),
        name="Mixtral-8x7B",
    ),
    "Qwen3-30B-A3B": MoEModel(
        ModelShape(48, 2048, 32, 4, 151936, SEQ, 1.0, True, name="Qwen3-30B-A3B"),
        MoESpec(128, 8, 768),
        head_dim=128,
        name="Qwen3-30B-A3B",
    ),
    "Qwen3-235B-A22B": MoEModel(
        ModelShape(94, 4096, 64, 4, 151936, SEQ, 1.0, True, name="Qwen3-235B-A22B"),
        MoESpec(128, 8, 1536),
        head_dim=128,
        name="Qwen3-235B-A22B",
    ),
    "DeepSeek-V3": MoEModel(
        ModelShape(61, 7168, 128, 128, 129280, SEQ, 18432 / 7168, True, name="DeepSeek-V3"),
        MoESpec(256, 8, 2048, 1, 0, 3),
        mla=MLA(1536, 512, 64, 128, 128),
        name="DeepSeek-V3",
    ),
}


@dataclass(frozen=True)
class MoECell:
    model: str
    gpu: str
    gpus: int
    best: str = ""  # "" when nothing fits
    ep: int = 1
    pp: int = 1
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    mem_gib: float = 0.0
    a2a_share: float = 0.0  # exposed all-to-all / step
    tokens_per_expert: float = 0.0
    ep1: str = ""  # the best with ep = 1 ("" when none fits)
    ep1_tokens_per_s: float = 0.0
    rho_tokens_per_s: tuple = ()  # the best layout at RHOS (0.0: no longer fits)
    need_gib: float = 0.0  # when nothing fits: the least memory any layout needs
    a2a_s: float = 0.0  # the best layout's exposed all-to-all, seconds per step
    ep1_weights_s: float = 0.0  # the best EP = 1 layout's exposed weight traffic (DP + experts')

    @property
    def ep_gain(self) -> float | None:
        return self.tokens_per_s / self.ep1_tokens_per_s - 1 if self.ep1_tokens_per_s else None


def _short(p) -> str:
    lay = p.layout
    return (
        f"dp{lay.dp} ep{lay.ep} tp{lay.tp} pp{lay.pp}"
        + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        + f" Z{lay.zero_stage}"
        + (f" {lay.recompute} rc" if lay.recompute != "none" else "")
    )


def moe_cell(args) -> MoECell:
    """One cell of the grid (picklable, for the guide's pool)."""
    name, gpu, gpus, calib, links = args
    model = MODELS[name]
    cluster = cluster_for(gpu, gpus, "NVLink", 400, links)
    kw = dict(micro_batches=MICRO_BATCHES, expert_tp=False, keep_within=1.0)
    res = moe_search(model, cluster, BATCH, calib, **kw)
    cell = MoECell(name, gpu, gpus)
    if res.best is None:
        return replace(cell, need_gib=res.smallest_bytes / GiB)
    b, usable = res.best, cluster.gpu.hbm_bytes * (1 - res.headroom)
    rho = []
    for r in RHOS:
        skewed = replace(model, moe=replace(model.moe, imbalance=r))
        mem = memory_of(skewed, b.layout)
        fits = mem[0].total <= usable
        priced = price(skewed, b.layout, cluster, res.calib, memory=mem) if fits else None
        rho.append(priced.time.tokens_per_s if priced else 0.0)
    one = moe_search(model, cluster, BATCH, calib, fixed={"ep": 1}, **kw).best
    return replace(
        cell,
        best=_short(b),
        ep=b.layout.ep,
        pp=b.layout.pp,
        mfu=b.time.mfu,
        tokens_per_s=b.time.tokens_per_s,
        mem_gib=b.memory.total / GiB,
        a2a_share=b.moe.exposed_all_to_all / b.time.total,
        tokens_per_expert=b.moe.tokens_per_expert,
        ep1=_short(one) if one else "",
        ep1_tokens_per_s=one.time.tokens_per_s if one else 0.0,
        rho_tokens_per_s=tuple(rho),
        a2a_s=b.moe.exposed_all_to_all,
        ep1_weights_s=(one.moe.expert_dp + one.time.dp_comm_exposed) if one else 0.0,
    )


def moe_tasks(calib: Calibration, links: LinkCalibration | None) -> list[tuple]:
    """Every cell's search, the largest first (DeepSeek-V3 on 2,048 GPUs)."""
    grid = [(m, g, n, calib, links) for m in MODELS for g, n in GRID]
    return sorted(grid, key=lambda a: -(MODELS[a[0]].num_params() * a[2]))


def moe_cells(found: list[MoECell]) -> list[MoECell]:
    """The cells in grid order (model, then GRID)."""
    by = {(c.model, c.gpu, c.gpus): c for c in found}
    return [by[m, g, n] for m in MODELS for g, n in GRID]


def compute_moe(calib: Calibration, links: LinkCalibration | None, pool=None) -> list[MoECell]:
    tasks = moe_tasks(calib, links)
    found = pool.map(moe_cell, tasks, chunksize=1) if pool else [moe_cell(t) for t in tasks]
    return moe_cells(found)


def ep_rule(cells: list[MoECell]) -> str:
    """When EP pays on one node, in numbers from the 8-GPU cells."""
    one_node = [c for c in cells if c.gpus == 8 and c.best]
    parts = []
    for c in one_node:
        where = f"{c.model} on 8 {_GPU_LABEL[c.gpu]}"
        if c.ep == 1:
            parts.append(f"{where} keeps EP = 1 (its experts FSDP-sharded)")
        elif c.ep_gain is None:
            parts.append(f"{where} takes ep{c.ep}: nothing fits without it")
        else:
            parts.append(
                f"{where} takes ep{c.ep}, {c.ep_gain:+.0%} over EP = 1: its all-to-all leaves "
                f"{c.a2a_s:.1f} s of the step exposed against the {c.ep1_weights_s:.1f} s of "
                "weight and gradient traffic the best EP = 1 layout leaves exposed"
            )
    if not parts:
        return "**Expert parallelism on one node:** no MoE model of the grid fits on 8 GPUs."
    return (
        "**When EP pays on one node.** "
        + "; ".join(parts)
        + ". Inside one NVLink domain EP pays when the all-to-all of the tokens, 2·(b_dispatch + "
        "b_combine)·T·k·h·(ep−1)/ep bytes per MoE layer and micro-batch, costs less than "
        "gathering and reducing the experts' weights over FSDP with EP = 1 (E·3·d·F per MoE "
        "layer, every micro-batch under ZeRO-3), or when without it the experts' states fit only "
        "in slower layouts (deeper pipelines, recompute, fewer tokens per micro-batch); wider EP "
        "also leaves each local expert more rows (T·k·ep/E), so its grouped GEMMs run nearer "
        "their peak. A gain within the backtest's median error (below) is a tie."
    )


def backtest_line(rows: list) -> str:
    """The MoE backtest's figures (``dtrain backtest --moe``), in one sentence."""
    if not rows:
        return ""
    from dtrain.costmodel.moe_backtest import moe_summary

    s = moe_summary(rows)
    return (
        f"Against {s['rows']} published MoE runs (`dtrain backtest --moe`, leave-one-source-out; "
        f"the sources issue 41 released) the model's tokens/s is off by a median "
        f"{s['median_abs_error']:.0%}, {s['within_15pct']} of {s['rows']} within 15%, and "
        f"{s['fit']} of {s['rows']} published layouts are predicted to fit: read the cells "
        "with that error in mind."
    )


def moe_section(cells: list[MoECell], backtest_rows: list | None = None) -> list[str]:
    """The section; ``backtest_rows``: ``moe_backtest()``'s (computed when None; [] leaves the
    sentence out)."""
    if backtest_rows is None:
        from dtrain.costmodel.moe_backtest import moe_backtest

        backtest_rows = moe_backtest()
    out = [
        "## Mixture of experts: expert parallelism",
        "",
        "The layout the cost model picks for four MoE classes (`dtrain plan --experts ...`; "
        "shapes from their model cards and reports, `common/dtrain/guide/moe_guide.py`) on H100 "
        "and B200 (8 per node, NVLink, 400 Gbit/s per GPU), 1,024 sequences of 4,096 tokens per "
        "step, BF16, balanced routing (ρ = 1, as vendor benchmarks force it), all-to-all "
        "dispatch without A2A overlap. Layout: dp ep tp pp, ZeRO stage, recompute; MFU by "
        "Megatron's MoE FLOP rule (routed top-k and shared experts, router not counted). "
        "*EP gain*: the best layout against the best with EP = 1. *ρ 1.1 / 1.25*: the same "
        "layout's tokens/s when the busiest rank routes 10% / 25% more tokens than the "
        "balanced share (its expert compute, received bytes and activations grow by ρ).",
        "",
        ep_rule(cells),
        "",
    ]
    if backtest_rows:
        out += [backtest_line(backtest_rows), ""]
    out += [
        "| model | GPUs | best layout | MFU | memory/GPU | exposed A2A | best with EP = 1 "
        "| EP gain | ρ 1.1 / 1.25 |",
        "|---|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for c in cells:
        gpus = f"{c.gpus:,} {_GPU_LABEL[c.gpu]}"
        if not c.best:
            need = f" (needs ≥ {c.need_gib:.0f} GiB)" if c.need_gib else ""
            out.append(f"| {c.model} | {gpus} | does not fit{need} | | | | | | |")
            continue
        gain = "—" if c.ep == 1 else ("only fit" if c.ep_gain is None else f"{c.ep_gain:+.0%}")
        rho = " / ".join(
            f"{t / c.tokens_per_s - 1:+.0%}" if t else "no fit" for t in c.rho_tokens_per_s
        )
        out.append(
            f"| {c.model} | {gpus} | {c.best} | {c.mfu:.0%} | {c.mem_gib:.0f} GiB | "
            f"{c.a2a_share:.0%} | {c.ep1 or 'does not fit'} | {gain} | {rho} |"
        )
    return out + [""]
