"""Training runs' records as calibration candidates: compute efficiency and DP overlap of plain
FSDP runs (``from_fsdp``), the TP and PP factors of DP x TP x PP layout runs (``from_layout``), and
fp8-train's recipe comparison (``from_fp8``)."""

from __future__ import annotations

import dataclasses

from dtrain.core.layout import SHARDED
from dtrain.results import contract, contract_records

from .calibration_records import Candidate, Source, finite_number
from .collectives import p2p_time
from .comm_time import tp_comm_time
from .hardware import LinkModel
from .timemodel import bubble_fraction


def from_fsdp(runs: list[contract.TrainingMeasurement], src: Source) -> list[Candidate]:
    out = []
    for m in runs:
        lay = m.layout
        if lay.tp * lay.pp * lay.cp > 1:
            # a TP / PP / CP layout run: its step holds TP comm, bubble, ring sends; the guide
            # checks it
            continue
        step, mfu = finite_number(m.step_time_s), finite_number(m.mfu)
        exposed = finite_number(m.exposed_comm_s) or 0.0
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
        overlap = finite_number(m.overlap_fraction)
        if overlap is not None and m.strategy in SHARDED:
            out.append(Candidate("dp_overlap", overlap, src, label))
    return out


def from_layout(
    runs: list[contract.TrainingMeasurement], src: Source, link: LinkModel | None
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
        tp_meas = finite_number(b.tp_comm_s) or 0.0
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
        compute = finite_number(b.compute_s)
        if pp > 1 and compute:
            sends = 2 * v * ga * p2p_time(mb * shape.seq_len * shape.d_model * vb / tp, link)
            idle = max(
                (finite_number(b.pp_p2p_s) or 0.0) + (finite_number(b.idle_s) or 0.0) - sends, 0.0
            )
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
    name = sorted(good, key=lambda k: (-(finite_number(good[k].get("speedup")) or 0), k))[0]
    r = good[name]
    detail = f"recipe {name} vs {guide.get('baseline', '?')}" + (
        "" if r.get("within_noise") else ", NOT within the loss noise band"
    )
    out = []
    if finite_number(r.get("speedup")):
        out.append(Candidate("fp8_speedup", finite_number(r["speedup"]), src, detail))
    if finite_number(r.get("memory_factor")):
        out.append(
            Candidate(
                "fp8_memory_factor",
                finite_number(r["memory_factor"]),
                src,
                detail + "; peak-memory ratio",
            )
        )
    return out, list(guide.get("keep_high_precision") or [])
