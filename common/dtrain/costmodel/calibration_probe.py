"""The gemm-probe's record as calibration candidates: the GEMM curve and, off GPUs, the fixed
per-step overhead (``from_probe``, over ``probe_entry``'s dict)."""

from __future__ import annotations

import dataclasses
import statistics

from dtrain.results import contract_records

from .calibration_records import Candidate, Source, finite_number
from .efficiency import fit_curve


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
    e_max, w_half = finite_number(g.get("e_max")), finite_number(g.get("w_half"))
    points = g.get("points") or []
    if src.on_gpu:
        # single GEMMs of >= 100 us: below that a probe timed with a synchronisation per call times
        # the sync
        single = [
            (p["flops"], p["fraction"])
            for p in points
            if p.get("count", 1) == 1
            and finite_number(p.get("fraction"))
            and (finite_number(p.get("seconds")) or 0) >= 1e-4
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
    over = [(o, finite_number(o.get("overhead_s"))) for o in g.get("overheads") or []]
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
    from .kernel_rates import published
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
