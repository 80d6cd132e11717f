"""The calibration's per-record-kind readers: each turns one kind of guide input
(dtrain.results.contract) into candidate values with their provenance (``Source``);
``calibrate.calibrate`` picks among them."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from dtrain.core.layout import SHARDED
from dtrain.results import contract_records
from dtrain.results.loader import Run

from .efficiency import fit_curve
from .hardware import LinkModel
from .calibration import Param
from .collectives import p2p_time
from .timemodel import bubble_fraction
from .comm_time import tp_comm_time

LINK_CLASSES = {"intra_node": "intra", "inter_node": "inter"}


@dataclass(frozen=True)
class Source:
    """The run a measured value comes from."""

    run: str
    date: str
    device: str
    backend: str
    world_size: int
    gpu_name: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def gpu_profile(self) -> str | None:
        """The hardware.yaml profile of the GPU it ran on (None off GPUs or for an unknown GPU)."""
        from .hardware import gpu_profile_name

        return gpu_profile_name(self.gpu_name) if self.on_gpu and self.gpu_name else None

    def provenance(self, detail: str = "") -> str:
        what = self.gpu_name or self.device
        extra = f"; {detail}" if detail else ""
        return (
            f"measured here: {self.run}, {self.date}, {what} ({self.backend}, "
            f"{self.world_size} ranks){extra}"
        )


@dataclass(frozen=True)
class Candidate:
    """One measured value of a calibration field, with the run it comes from."""

    name: str
    value: float
    source: Source
    detail: str = ""
    # leave_one_out's median: the other runs' candidates it is taken over (() for a measured one)
    pooled: tuple[Candidate, ...] = ()

    def param(self) -> Param:
        return Param(self.value, self.source.provenance(self.detail))


@dataclass(frozen=True)
class RunInputs:
    """One run's guide inputs and where they were measured."""

    run: Run
    source: Source
    records: tuple

    def of(self, kind) -> list:
        return [r for r in self.records if isinstance(r, kind)]


def _num(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------- per record kind

# Collectives the time model costs with their own α–β when allreduce-bench fitted them
# (``LinkModel.of``), with the ring hops their whole-collective α spans over n ranks (all-to-all:
# one per peer, ``collectives.all_to_all_time``).
OWN_FIT_HOPS = {
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "sendrecv": lambda n: 1,
    "all_to_all": lambda n: n - 1,
    "all_to_all_v": lambda n: n - 1,  # uneven (expert parallelism's dispatch): allreduce-bench
}


def from_allreduce(fits: list[contract_records.CollectiveFit], src: Source) -> list[Candidate]:
    out = []
    for fit in map(dataclasses.asdict, fits):
        cls = LINK_CLASSES.get(fit.get("link_class"))
        alpha, beta = _num(fit.get("alpha_us")), _num(fit.get("beta_GBps"))
        name = fit.get("collective")
        if cls is None or alpha is None or not beta:
            continue
        if (
            name in OWN_FIT_HOPS
        ):  # "<cls>_<collective>_alpha_s" / "_beta_Bps": the local link's own entries
            n = int(fit.get("world_size") or 2)
            hops = max(1, OWN_FIT_HOPS[name](n))
            detail = f"{name} {fit.get('dtype', '?')} fit over {n} ranks; α per hop = α/{hops}"
            out.append(
                Candidate(f"{cls}_{name}_alpha_s", max(alpha, 0.0) * 1e-6 / hops, src, detail)
            )
            out.append(Candidate(f"{cls}_{name}_beta_Bps", beta * 1e9, src, detail))
            continue
        if name != "all_reduce":
            continue
        # The fit's α is the latency of a whole all_reduce over `world_size` ranks; the time model
        # charges α per ring hop, 2(n−1) of them, so convert to per-hop latency.
        n = int(fit.get("world_size") or 2)
        hops = 2 * (n - 1) if n > 1 else 1
        detail = (
            f"all_reduce {fit.get('dtype', '?')} fit over {n} ranks, {fit.get('n_points', '?')} "
            f"sizes, r²={fit.get('r2', float('nan')):.3f}; α per hop = α/{hops}"
        )
        out.append(Candidate(f"{cls}_alpha_s", max(alpha, 0.0) * 1e-6 / hops, src, detail))
        out.append(Candidate(f"{cls}_beta_Bps", beta * 1e9, src, detail))
        pct = _num(fit.get("beta_pct_of_theoretical"))
        if pct:
            out.append(
                Candidate(f"{cls}_efficiency", pct / 100, src, detail + f", {pct:.0f}% of nominal")
            )
    return out


def training_entries(
    inputs: RunInputs, recipe: bool = False
) -> list[contract_records.TrainingMeasurement]:
    """The run's plain training records (they measure compute efficiency), or with ``recipe`` its
    numerics-recipe runs (fp8-train's)."""
    return [
        m
        for m in inputs.of(contract_records.TrainingMeasurement)
        if (m.recipe is not None) == recipe
    ]


def from_fsdp(runs: list[contract_records.TrainingMeasurement], src: Source) -> list[Candidate]:
    out = []
    for m in runs:
        lay = m.layout
        if lay.tp * lay.pp * lay.cp > 1:
            # a TP / PP / CP layout run: its step holds TP comm, bubble, ring sends; the guide
            # checks it
            continue
        step, mfu = _num(m.step_time_s), _num(m.mfu)
        exposed = _num(m.exposed_comm_s) or 0.0
        label = f"{m.strategy} x{lay.world_size}"
        if step and mfu and step > exposed and not src.on_gpu:
            # (on a GPU the model prices compute term by term: a run's MFU checks it, it does not
            # calibrate it) compute-only efficiency: the time model costs communication separately
            eff = mfu * step / (step - exposed)
            out.append(
                Candidate(
                    "mfu",
                    eff,
                    src,
                    f"{label}: MFU {mfu:.1%} with "
                    f"{exposed / step:.0%} of the step exposed communication",
                )
            )
        overlap = _num(m.overlap_fraction)
        if overlap is not None and m.strategy in SHARDED:
            out.append(Candidate("dp_overlap", overlap, src, label))
    return out


def from_layout(
    runs: list[contract_records.TrainingMeasurement], src: Source, link: LinkModel | None
) -> list[Candidate]:
    """TP and PP factors of DP x TP x PP layout runs (``training_entries``: the record's layout and
    its profiled step breakdown):

    tp_overhead  measured TP comm (profile) / ``traffic.tp_comm_time`` (α–β with this device's link)
    pp_overhead  measured (PP p2p wait + idle) − α–β p2p sends, over compute + TP comm, / the bubble
                 formula ``bubble_fraction(p, m, v, L)`` (Narayanan et al. 2021), the factor the
                 time model puts on its bubble
    """
    from dtrain.model.args import GPTConfig

    from .gpt_shape import shape_of

    if link is None:
        return []
    out = []
    for m in runs:
        lay, b = m.layout, m.breakdown
        tp, pp = lay.tp, lay.pp
        if tp * pp == 1 or b is None:
            continue
        shape = shape_of(GPTConfig(**m.model))
        mb, ga, v = lay.micro_batch, lay.grad_accum, lay.pp_virtual
        vb = 4 if m.precision == "fp32" else 2
        name = f"dp{lay.dp} x tp{tp} x pp{pp}"
        tp_meas = _num(b.tp_comm_s) or 0.0
        if tp > 1 and tp_meas > 0:
            model = tp_comm_time(shape, lay, link, vb)
            out.append(
                Candidate(
                    "tp_overhead",
                    tp_meas / model,
                    src,
                    f"{name}: TP comm measured {tp_meas * 1e3:.0f} ms (profile) / "
                    f"alpha-beta {model * 1e3:.0f} ms",
                )
            )
        compute = _num(b.compute_s)
        if pp > 1 and compute:
            sends = 2 * v * ga * p2p_time(mb * shape.seq_len * shape.d_model * vb / tp, link)
            idle = max((_num(b.pp_p2p_s) or 0.0) + (_num(b.idle_s) or 0.0) - sends, 0.0)
            formula = bubble_fraction(pp, ga, v, shape.n_layer)
            share = idle / (compute + tp_meas)
            out.append(
                Candidate(
                    "pp_overhead",
                    share / formula,
                    src,
                    f"{name}: p2p wait + idle {share:.0%} of compute (profile) / "
                    f"bubble formula {formula:.0%}",
                )
            )
    return out


def leave_one_out(
    cands: list[Candidate], name: str, run: str, on_gpu: bool = False
) -> Candidate | None:
    """The median of every ``name`` value measured on this kind of device by a run other than
    ``run`` (a display path, as ``Source.run``); None when no other run measured it."""
    pool = [
        c for c in cands if c.name == name and c.source.run != run and c.source.on_gpu == on_gpu
    ]
    if not pool:
        return None
    vals = sorted(c.value for c in pool)
    med = statistics.median(vals)
    runs = ", ".join(
        f"{c.source.run} {c.value:.2f}" for c in sorted(pool, key=lambda c: c.source.run)
    )
    detail = f"leave-one-out: median of {len(pool)} other run(s) ({runs})"
    return Candidate(name, med, pool[0].source, detail, pooled=tuple(pool))


def tp_regions(module: str) -> int:
    """TP regions per layer: a block has two (attention, MLP), attention alone one."""
    return 1 if module == "attention" else 2


def tp_modelled_comm_s(row: dict, link: LinkModel, regions: int = 2) -> float:
    """α–β time of one layer's TP collectives, forward + backward. ``comm_bytes_per_layer`` is
    already in bus bytes (tp-attention's convention, = nccl-tests busbw bytes), so it goes over β
    unchanged; each region issues 2 all-reduces (or all-gather + reduce-scatter pairs with SP)
    per direction, 2(n−1) latency hops each (Megatron §3; Korthikanti §4.2.2)."""
    tp = int(row["tp"])
    return (
        float(row["comm_bytes_per_layer"]) / link.beta_Bps + 4 * regions * (tp - 1) * link.alpha_s
    )


def tp_rows(inputs: RunInputs) -> list[tuple[dict, int]]:
    """The run's TP layer records as the flat rows the checks read, each with its TP regions per
    layer."""
    return [
        (
            {
                "tp": m.tp,
                "sequence_parallel": m.sequence_parallel,
                "step_time_s": m.step_time_s,
                "single_rank_step_time_s": m.single_rank_step_time_s,
                "dtensor_step_time_s": m.dtensor_step_time_s,
                "comm_share": m.comm_share,
                "comm_bytes_per_layer": m.comm_bytes_per_layer,
                "batch": m.micro_batch,
                "seq": m.seq_len,
                "d_model": m.d_model,
                "n_head": m.n_head,
                "n_kv_head": m.n_kv_head,
                "mlp_ratio": m.mlp_ratio,
            },
            tp_regions(m.module),
        )
        for m in inputs.of(contract_records.TpMeasurement)
    ]


def from_tp(rows: list[tuple[dict, int]], src: Source, link: LinkModel | None) -> list[Candidate]:
    if link is None:
        return []
    ratios = []
    for row, regions in rows:
        step, share = _num(row.get("step_time_s")), _num(row.get("comm_share"))
        if (
            not step
            or share is None
            or int(row.get("tp", 1)) < 2
            or not row.get("comm_bytes_per_layer")
        ):
            continue
        ratios.append(step * share / tp_modelled_comm_s(row, link, regions))
    if not ratios:
        return []
    ratios.sort()
    med = ratios[len(ratios) // 2]
    return [
        Candidate(
            "tp_overhead",
            med,
            src,
            f"median over {len(ratios)} tp>1 rows of measured TP comm time "
            "(profile) / alpha-beta time with this device's measured link",
        )
    ]


def from_cp(layers: list[contract_records.CpMeasurement], src: Source) -> list[Candidate]:
    """cp_overlap: the median over the ring rows of the share of the overlapped K/V sends hidden
    behind attention (tp-attention's CP study: (serial − overlapped) / the sends alone)."""
    shares = sorted(
        m.overlap_fraction for m in layers if m.impl == "ring" and m.overlap_fraction is not None
    )
    if not shares:
        return []
    return [
        Candidate(
            "cp_overlap",
            shares[len(shares) // 2],
            src,
            f"median over {len(shares)} ring layers (cp "
            f"{', '.join(sorted({str(m.cp) for m in layers if m.impl == 'ring'}))}) of the K/V "
            "sends' hidden share",
        )
    ]


def from_fp8(
    comparisons: list[contract_records.Fp8Comparison], src: Source
) -> tuple[list[Candidate], list[str] | None]:
    if not comparisons:
        return [], None
    recipes = {c.recipe: dataclasses.asdict(c) for c in comparisons}
    guide = {
        "baseline": comparisons[0].baseline,
        "keep_high_precision": comparisons[0].keep_high_precision,
    }
    good = {k: v for k, v in recipes.items() if v.get("within_noise")} or recipes
    name = sorted(good, key=lambda k: (-(_num(good[k].get("speedup")) or 0), k))[0]
    r = good[name]
    detail = f"recipe {name} vs {guide.get('baseline', '?')}" + (
        "" if r.get("within_noise") else ", NOT within the loss noise band"
    )
    out = []
    if _num(r.get("speedup")):
        out.append(Candidate("fp8_speedup", _num(r["speedup"]), src, detail))
    if _num(r.get("memory_factor")):
        out.append(
            Candidate(
                "fp8_memory_factor", _num(r["memory_factor"]), src, detail + "; peak-memory ratio"
            )
        )
    return out, list(guide.get("keep_high_precision") or [])


# ---------------------------------------------------------------- assembling


def probe_entry(m: contract_records.GemmProbe) -> dict:
    """A GEMM probe record as the dict the local checks read."""
    g = dataclasses.asdict(m)
    g["overheads"] = [
        {**{k: v for k, v in o.items() if k != "model_kind"}, "kind": o["model_kind"]}
        for o in g["overheads"]
    ]
    return g


def from_probe(g: dict, src: Source) -> list[Candidate]:
    """The GEMM curve (and, off GPUs, the fixed per-step overhead) a gemm-probe measured.

    On a GPU the curve is refitted over the single GEMMs alone: attention runs there in a fused
    kernel, not as the batched per-head products the probe also timed, and the step's
    memory-bound kernels, attention and optimizer are priced term by term (``compute``), so no
    fixed overhead is taken."""
    e_max, w_half = _num(g.get("e_max")), _num(g.get("w_half"))
    points = g.get("points") or []
    if src.on_gpu:
        # single GEMMs of >= 100 us: below that a probe timed with a synchronisation per call times
        # the sync
        single = [
            (p["flops"], p["fraction"])
            for p in points
            if p.get("count", 1) == 1
            and _num(p.get("fraction"))
            and (_num(p.get("seconds")) or 0) >= 1e-4
        ]
        if len(single) < 2:
            return []
        w_half, whence = _table_w_half(src.gpu_name)
        if w_half is None:  # no kernel table for this GPU: the probe's own two-parameter fit
            curve = fit_curve(single)
            e_max, w_half, whence = curve.e_max, curve.w_half, "fitted with e_max"
        else:
            # The runs' GEMMs of >= 100 us all sit on the plateau (W >> W_half), where W_half is not
            # determined: fitting it there extrapolates wildly to small GEMMs (a 62 GFLOP W_half
            # from one H100 probe against 342 shapes swept at ~5). The plateau is what the probe
            # measures.
            e_max = statistics.median(f * (w + w_half) / w for w, f in single)
        detail = (
            f"{len(single)} single GEMMs (>= 100 us) of the runs' models, {g.get('dtype', '?')}: "
            f"e_max their median of f·(W + W_half)/W, W_half {w_half / 1e9:.1f} GFLOP {whence} "
            "(attention, memory-bound kernels and the optimizer: costmodel/kernels.yaml)"
        )
        return [
            Candidate("mfu", e_max, src, detail + "; e_max"),
            Candidate("gemm_half_flops", w_half, src, detail + "; W_half"),
        ]
    if not e_max:
        return []
    detail = f"fit over {len(points)} GEMM shapes of the runs' models, {g.get('dtype', '?')}"
    if g.get("rejected"):
        detail += f", {len(g['rejected'])} left out (above the roofline: measurement errors)"
    if g.get("probe_load"):
        detail += f", timed against the reference matmul under load x{g['probe_load']:.2f}"
    out = [
        Candidate("mfu", e_max, src, detail + "; e_max"),
        Candidate("gemm_half_flops", w_half or 0.0, src, detail + "; W_half"),
    ]
    over = [(o, _num(o.get("overhead_s"))) for o in g.get("overheads") or []]
    over = [(o, v) for o, v in over if v is not None]
    if over:
        per = ", ".join(f"{_target_label(o)} {v * 1e3:.1f} ms" for o, v in over)
        out.append(
            Candidate(
                "step_overhead_s",
                statistics.median(v for _, v in over),
                src,
                f"median over {len(over)} models of the measured step minus the curve's GEMM time "
                f"(per model: {per}); the local checks use each model's own",
            )
        )
    return out


def _table_w_half(gpu_name: str | None) -> tuple[float | None, str]:
    """W_half of the GPU's published bf16 GEMM curve (kernels.yaml), and where it is from."""
    from .compute import published
    from .hardware import gpu_profile_name

    profile = gpu_profile_name(gpu_name) if gpu_name else None
    table = published(profile) if profile else None
    if table is None or "bf16" not in table.gemm:
        return None, ""
    return table.gemm["bf16"].w_half, f"from kernels.yaml ({profile})"


def _target_label(o: dict) -> str:
    c = o.get("config") or {}
    if o.get("kind") == "gpt":
        return f"GPT {c.get('n_layer')}x{c.get('d_model')} mb{o.get('micro_batch')}"
    return f"{o.get('kind')} d{c.get('d_model')} mb{o.get('micro_batch')}"
