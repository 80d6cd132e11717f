"""The matmul probe that calibrates ``efficiency``: time the model's real GEMM shapes, fit the
achieved-fraction curve, and measure the fixed per-step overhead.

    python -m dtrain.costmodel.gemm_probe results/capstone/<time>     # dtrain capstone runs it

Reads the complete runs under the results folder (through ``dtrain.results.loader``), collects the
forward GEMMs of every model they trained (``gemm_targets``: ``efficiency.layer_gemms`` /
``head_gemm``, TP shards included), times each on this device (CPU: fp32 on the runs' threads per
rank, the peak being the same 512³ probe the runs' MFU used; CUDA: bf16 against the datasheet peak),
fits f(W) = e_max·W/(W + W_half) (``efficiency.fit_curve``), and times one training step of each
model at its real size in one process (forward, backward, gradient clipping, AdamW, loss read-back,
as the trainer does). The fixed per-step overhead of a model is that step minus the time the fitted
curve gives its GEMMs: the cost of Python, autograd, elementwise kernels (norms, activations,
softmax, residuals: work that grows with d_model, so it is measured at the real width, not on a
shrunk model) and the optimizer. Writes a derived run ``<results>/gemm-probe/``
(``dtrain.results.derived``: config.yaml, env.json, summary.json with one
``dtrain.results.contract_records.GemmProbe``) that ``calibrate`` reads like any experiment's.

Load cancels (``probe_timing``, over ``dtrain.run.hostload``): on CPU every timing has the time its
threads waited for a CPU taken out (the kernel's per-thread run-queue delay), and is paired with the
reference matmul (the 512³ of the runs' MFU probe) timed right before and after it, so a slowdown
that is not a wait (a busy SMT sibling, cooled caches) cancels too: a GEMM's fraction is its rate
over the reference's of that moment, a step is scaled to the idle reference (the 90th percentile of
all its timings: the roofline here). Each run the probe read gets the load factor of its own timed
window from the capstone's timeline (``<results>/host-load.jsonl``, when there is one;
``run_loads``): the local check scales that run's prediction by it, with its 10th-90th percentile
spread. A fraction above 1 (faster than the roofline) is a measurement error: the point is timed
again and, if it stays above, left out of the fit and listed in ``rejected``; a fitted e_max above 1
is capped at 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dtrain.core.errors import UserError
from dtrain.model import perf
from dtrain.results import contract_records
from dtrain.results.derived import claim_output, write_derived_run
from dtrain.results.loader import complete_runs
from dtrain.run import envinfo, hostload

from . import hardware
from .efficiency import Gemm, GemmCurve, fit_curve
from .gemm_targets import gemm_step_s, gemms_of, targets
from .probe_timing import Reference, Timer, gemm_seconds, step_s
from .run_loads import LOAD_FILE, run_loads

SUBPROJECT = "gemm-probe"
ABOVE_ROOFLINE = (
    1.05  # a fraction above this is a measurement error; up to it, timer noise (clipped to 1)
)


def fit(points: list[dict]) -> GemmCurve | None:
    """The curve over the kept points; e_max above 1 (above the roofline) is capped at 1, with
    W_half refitted for it (weighted least squares of 1/f - 1 = W_half/W, as ``fit_curve``
    weighs)."""
    if len(points) < 2:
        return None
    pts = [
        (p["flops"], min(p["fraction"], 1.0)) for p in points
    ]  # W: the whole (batched) GEMM, as gemm_time
    curve = fit_curve(pts)
    if curve.e_max <= 1.0:
        return curve
    num = sum(f * f * (1 / w) * (1 / f - 1) for w, f in pts)
    den = sum(f * f * (1 / w) ** 2 for w, f in pts)
    return GemmCurve(1.0, max(num / den, 0.0) if den > 0 else 0.0)


def probe(results: Path, device: str = "auto") -> Path:
    """Run the probe for the runs under ``results``; returns the run directory written."""
    results = Path(results)
    dev = torch.device(
        "cuda"
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    tg, threads, sources = targets(results)
    # its own folder, claimed before the timing (dtrain.results.derived): an earlier probe's is
    # never rewritten
    out = claim_output(results / SUBPROJECT, "gemm-probe", fix="remove it to probe again")
    timer, ref = Timer(dev), None
    if dev.type == "cpu":
        torch.set_num_threads(max(1, int(threads)))
        dtype, peak_source = torch.float32, perf.CPU_PROBE_SOURCE
        ref = Reference(timer, dev, dtype)
    else:
        dtype, (peak, peak_source) = torch.bfloat16, hardware.peak_flops(dev, "bf16")

    def fraction(
        g: Gemm,
    ) -> float:  # of the reference of the moment (CPU) or of the datasheet peak (CUDA)
        seconds, rate = (
            ref.around(lambda: gemm_seconds(g, dev, dtype, timer))
            if ref
            else (gemm_seconds(g, dev, dtype, timer), peak)
        )
        return g.flops * g.count / seconds / rate

    points, rejected, seen = [], [], set()
    # the curve from the dense runs' GEMMs only: an MoE run's are its dense proxy's, shapes its
    # kernels never run (its experts are many small GEMMs), which moved the curve of every dense row
    # (W_half 5.4e5 -> 3e5 FLOP, their predictions 8-10% lower); the MoE run keeps its own overhead
    for t in (t for t in tg if not t["config"].get("moe")):
        for g in gemms_of(t):
            key = (g.m, g.n, g.k, g.count)
            if key in seen:
                continue
            seen.add(key)
            for _ in range(
                3
            ):  # above the roofline is a measurement error: time it again, twice at most
                frac = fraction(g)
                if frac <= ABOVE_ROOFLINE:
                    break
            p = {
                "m": g.m,
                "n": g.n,
                "k": g.k,
                "count": g.count,
                "flops": g.flops * g.count,
                "fraction": frac,
            }
            (points if frac <= ABOVE_ROOFLINE else rejected).append(p)
    # each step as at the idle roofline: x (the reference of its moment / the idle reference)
    steps = [
        (t, *(ref.around(lambda: step_s(t, dev, timer)) if ref else (step_s(t, dev, timer), None)))
        for t in tg
        if t["tp"] == 1
    ]
    if ref:
        peak = ref.idle
    for p in points + rejected:
        p["seconds"] = p["flops"] / (p["fraction"] * peak)  # on the idle host
    curve = fit(points)
    vb = 4 if dtype == torch.float32 else 2
    overheads = []
    for t, step, rate in steps:
        step = step * rate / peak if rate else step
        gemm = gemm_step_s(t, curve, peak, vb) if curve else 0.0
        overheads.append(
            contract_records.StepOverhead(
                t["kind"],
                t["config"],
                t["micro_batch"],
                t["tp"],
                max(step - gemm, 0.0),
                step_s=step,
                gemm_s=gemm,
            )
        )
    runs = [
        r
        for r in complete_runs([results], warn=False)
        if r.path.resolve() in {s.resolve() for s in sources}
    ]
    gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    record = contract_records.GemmProbe(
        dtype=str(dtype).replace("torch.", ""),
        peak_flops=peak,
        peak_flops_source=peak_source,
        points=[contract_records.GemmPoint(**p) for p in points],
        overheads=overheads,
        e_max=curve.e_max if curve else None,
        w_half=curve.w_half if curve else None,
        where=contract_records.where_of(dev, "none", gpu_name),
        rejected=[contract_records.GemmPoint(**p) for p in rejected],
        probe_load=timer.load(),
        loads=run_loads(results, runs, hostload.read(results / LOAD_FILE)),
    )
    env = envinfo.collect(
        backend="none",
        world_size=1,
        device=str(dev),
        launcher="local",
        threads_per_rank=int(threads),
    )
    return write_derived_run(
        out,
        SUBPROJECT,
        sources,
        {"device": dev.type, "threads": int(threads)},
        {"device": str(dev)},
        [record],
        env=env,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtrain.costmodel.gemm_probe RESULTS_DIR")
    try:
        print(probe(Path(sys.argv[1])))
    except UserError as e:  # e.g. an earlier probe's folder: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
