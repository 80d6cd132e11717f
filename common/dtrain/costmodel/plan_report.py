"""What `dtrain plan` prints: a search result as text (the choice, its step term by term, why the
runners-up lost, a given layout against it) and as one JSON object (every term, the trainer
overrides)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from .calibration import calibration_inputs
from .explain import runners_up, explain
from .device_rates import device_of
from .hardware import GiB, Cluster
from .kernel_rates import published
from .search import SearchResult
from .shapes import Layout, ModelShape, params_text
from .token_flops import (
    EXECUTED_CONVENTION,
    FLOP_CONVENTION,
    executed_flops_per_token,
    model_flops_per_token,
)
from .uncertainty import PLAN_BAND, ErrorBand


def calibration_notes(report) -> list[str]:
    gpu = [c for c in report.candidates if c.source.on_gpu]
    cpu = [c for c in report.candidates if not c.source.on_gpu]
    notes = [
        f"calibration: {len(report.runs)} complete run(s); {len(gpu)} value(s) measured on CUDA "
        "used"
    ]
    if cpu:
        notes.append(
            f"  {len(cpu)} value(s) measured on CPU ignored: a CPU/gloo run does not describe a "
            "GPU cluster"
        )
    if not gpu:
        notes.append("  no GPU measurements: datasheet/published values are used")
    return notes


def describe_cluster(c: Cluster) -> str:
    """The links as the model uses them: the bus bandwidth collectives reach (datasheet rate x
    link efficiency, or allreduce-bench's measurement)."""
    return (
        f"{c.gpus} x {c.gpu.name}, {c.gpus_per_node} per node; intra-node {c.nvlink.name} "
        f"{c.nvlink.beta_Bps / 1e9:.4g} GB/s per direction achieved, inter-node "
        f"{c.ib.beta_Bps / 1e9:.4g} GB/s per GPU achieved ({c.ib.beta_Bps * 8 / 1e9:.4g} Gbit/s)"
    )


def describe_power(c: Cluster) -> str | None:
    """The power-cap term, when the cluster's GPUs run below the board power their kernel rates
    were measured at (``--power-w``); None otherwise."""
    table = published(c.gpu.name)
    scale = table.power_scale(c.gpu.power_w) if table else 1.0
    if scale == 1.0:
        return None
    return (
        f"{c.gpu.power_w:g} W cap of the {table.power_w:g} W the kernel rates were measured at: "
        f"tensor-core work x{scale:.3f} the time (the clock's cube root of the power above the "
        f"{table.idle_w:g} W idle draw; kernels.yaml)"
    )


def describe_model(s: ModelShape) -> str:
    return (
        f"{s.name or 'custom'}: {s.n_layer} layers, d_model {s.d_model}, {s.n_head} heads "
        f"({s.n_kv_head} KV), seq {s.seq_len}, {params_size(s.num_params())} params"
    )


def params_size(n: int) -> str:
    """Billions to one decimal (6.7B, 405.9B), as the plan always printed them; below 1B: 29M."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else params_text(n)


@dataclass(frozen=True)
class Runnable:
    """Whether dtrain's trainer runs the choice's overrides as printed: ``refusal`` is the
    trainer's reason when it does not (``overrides.trainer_refusal``), and ``alt`` then the search
    restricted to ``--software dtrain``, whose best layout the trainer runs."""

    refusal: str | None = None
    alt: SearchResult | None = None


def wrapped(head: str, text: str, width: int = 100) -> list[str]:
    """``head`` + ``text`` wrapped by words within ``width`` columns, continued under the text."""
    return textwrap.wrap(
        text,
        width,
        initial_indent=head,
        subsequent_indent=" " * len(head),
        break_long_words=False,
        break_on_hyphens=False,
    )


_HEAD = re.compile(r"^(\s*- |\s*[a-z][\w/ -]*?(?::\s+|\s{2,})|\s*)")


def fit_lines(lines: list[str], width: int = 100) -> list[str]:
    """Each line within ``width`` columns, wrapped by words under its text: a longer line's head
    (its label, "model:    ", "  step time   ", or its "  - " bullet) starts it and its
    continuation lines are indented to the text after the head."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        head = _HEAD.match(line).group(1)
        if len(head) > width // 2:
            head = head[: len(head) - len(head.lstrip())]
        out += wrapped(head, line[len(head) :], width) or [line]
    return out


def batch_text(res: SearchResult) -> str:
    tokens = res.global_batch * res.model.seq_len
    return (
        f"{tokens / 1e6:.2f}M tokens/step = {res.global_batch} sequences x {res.model.seq_len} "
        "tokens"
    )


def runnable_text(res: SearchResult, run: Runnable) -> list[str]:
    """What dtrain's trainer does with the choice: runs it (its overrides), or the reason it
    cannot and the best layout it runs, with its step time and overrides."""
    from .overrides import train_overrides

    if res.best is None:
        return []
    if run.refusal is None:
        overrides, _ = train_overrides(res.best, res.model, res.global_batch, res.precision)
        return wrapped("dtrain:   ", "runs it: python -m fsdp_scaling " + " ".join(overrides))
    out = wrapped("dtrain:   ", f"cannot run it ({run.refusal})")
    alt = run.alt
    if alt is None or alt.best is None:
        return out + ["          no layout dtrain runs fits"]
    gap = 100 * (1 - alt.best.time.tokens_per_s / res.best.time.tokens_per_s)
    overrides, _ = train_overrides(alt.best, alt.model, alt.global_batch, alt.precision)
    return out + [
        *wrapped(
            "          ",
            f"its best (--software dtrain): {alt.best.describe()}, step "
            f"{alt.best.time.total:.3f} s, {gap:.1f}% slower; its overrides:",
        ),
        *wrapped("          ", "python -m fsdp_scaling " + " ".join(overrides)),
    ]


def text_report(
    res: SearchResult,
    top: int,
    notes: list[str],
    runs: list[str] = (),
    band: ErrorBand = PLAN_BAND,
) -> list[str]:
    """The report; ``runs``: what dtrain's trainer does with the choice (``runnable_text``);
    ``band``: the backtest's error band the ties and the memory risk are judged by."""
    out = [
        f"model:    {describe_model(res.model)}",
        f"cluster:  {describe_cluster(res.cluster)}",
        *([f"power:    {power}"] if (power := describe_power(res.cluster)) else []),
        f"batch:    {batch_text(res)}, {res.precision}",
        f"stack:    {res.stack.describe()} (--attention, --kernels, --loss, --tp-overlap, "
        "--async-tp, --fp8-all-gather, --grad-reduce, --optimizer-states, --dp-sync: the run's "
        "software moves the cost; --software: the layouts it runs)",
        *notes,
        "",
    ]
    if res.best is None:
        return out + [res.reason]
    out += [f"choice:   {res.best.describe()}", *plan_lines(res.best, res_usable(res), res)]
    out += uncertainty_lines(res, top, band) + list(runs)
    why = explain(res, top, band.time)[1:]
    return out + (["", "why the runners-up lost:"] + [f"  - {line}" for line in why] if why else [])


def uncertainty_lines(res: SearchResult, top: int, band: ErrorBand = PLAN_BAND) -> list[str]:
    """The choice against the backtest's error band: runners-up it cannot tell from the best (a
    tie), and memory within the memory check's band of the HBM (may run out of memory)."""
    best, out = res.best, []
    ties = [
        p for p in runners_up(res, top) if band.tie(best.time.tokens_per_s, p.time.tokens_per_s)
    ]
    if ties:
        out.append(
            f"  tie         {len(ties)} runner-up(s) within {band.time_text()}: measure them"
        )
    hbm = res.cluster.gpu.hbm_bytes
    if band.memory_risk(best.memory.total, hbm):
        out.append(
            f"  memory risk at the memory check's {band.memory_low:+.0%} (vs reported peaks) "
            f"the peak is {band.memory_worst(best.memory.total) / GiB:.0f} GiB > "
            f"{hbm / GiB:g} GiB HBM"
        )
    return out


def res_usable(res: SearchResult) -> float:
    return res.cluster.gpu.hbm_bytes * (1 - res.headroom) / GiB


def flops(res: SearchResult, p) -> dict:
    """One plan's FLOP rates per GPU: model FLOPs (``model_flops_per_token``, the MFU
    convention, ``FLOP_CONVENTION``) and the FLOPs its kernels execute
    (``executed_flops_per_token``: causal attention half, the recompute counted), against the
    GPU's dense peak and its measured GEMM peak (dense peak x e_max of the GEMM curve)."""
    t = p.time
    fp8 = res.precision == "fp8"
    gpu = res.cluster.gpu
    curves = device_of(res.cluster, res.calib, res.stack).kernels.gemm
    curve = (curves.get("fp8") if fp8 else None) or curves["bf16"]
    peak = gpu.peak_fp8_flops if fp8 and "fp8" in curves else gpu.peak_bf16_flops
    executed = executed_flops_per_token(res.model, p.recompute)
    per_gpu_s = t.total * t.gpus
    return {
        "flop_convention": FLOP_CONVENTION,
        "executed_convention": EXECUTED_CONVENTION,
        "model_flops_per_token": model_flops_per_token(res.model),
        "executed_flops_per_token": executed,
        "executed_tflops_per_gpu": executed * t.tokens / per_gpu_s / 1e12,
        "peak_tflops": peak / 1e12,
        "gemm_e_max": curve.e_max,
        "gemm_peak_tflops": peak * curve.e_max / 1e12,
    }


def flops_lines(res: SearchResult, p) -> list[str]:
    """Throughput, model TFLOP/s and MFU with their convention named, and beside them the TFLOP/s
    the kernels execute against the measured GEMM peak."""
    t, f = p.time, flops(res, p)
    return wrapped(
        "  throughput  ",
        f"{t.tokens_per_s:,.0f} tokens/s; {t.tflops_per_gpu:.0f} TFLOP/s per GPU of model FLOPs, "
        f"MFU {t.mfu:.1%} ({FLOP_CONVENTION}); executed {f['executed_tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU ({EXECUTED_CONVENTION}, recompute={p.recompute}); measured GEMM peak "
        f"{f['gemm_peak_tflops']:.0f} TFLOP/s ({f['peak_tflops']:.0f} dense x e_max "
        f"{f['gemm_e_max']:.2f})",
    )


def plan_lines(p, usable_gib: float, res: SearchResult | None = None) -> list[str]:
    """The step breakdown, throughput and memory of one plan (``res``: its search, for the FLOP
    rates)."""
    t, m = p.time, p.memory
    c = t.terms
    return [
        f"  step time   {t.total:.3f} s = compute {t.compute:.3f} + TP comm {t.tp_comm:.3f} + PP "
        f"comm {t.pp_comm:.3f} + bubble {t.bubble:.3f} + exposed DP comm {t.dp_comm_exposed:.3f} "
        f"(of {t.dp_comm:.3f}"
        + (
            f"; {t.dp_contention:.3f} of it the SMs and HBM the overlapped part takes"
            if t.dp_contention
            else ""
        )
        + ")"
        + (f" + fixed overhead {t.overhead:.3f}" if t.overhead else "")
        + ("; launch-bound: the dispatch floor below, not this sum" if t.launch_bound else ""),
        f"  compute     {t.compute:.3f} s = GEMMs {c.gemm:.3f} + attention {c.attention:.3f} + "
        f"memory-bound {c.memory:.3f} + output layer & loss {c.head:.3f} + recompute "
        f"{c.recompute:.3f} + optimizer {c.optimizer:.3f} (busiest GPU; costmodel/compute.py)",
        *(
            flops_lines(res, p)
            if res is not None
            else [
                f"  throughput  {t.tokens_per_s:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per "
                f"GPU (model FLOPs), MFU {t.mfu:.1%}"
            ]
        ),
        f"  memory/GPU  {m.total / GiB:.1f} GiB of {usable_gib:.1f} GiB usable: params "
        f"{m.params / GiB:.1f}, grads {m.grads / GiB:.1f}, optimizer {m.optimizer / GiB:.1f}, "
        f"activations {m.activations / GiB:.1f}, ZeRO-3 buffers {m.buffers / GiB:.1f}",
        *eager_lines(t, res.stack if res is not None else None),
    ]


def eager_lines(t, stack=None) -> list[str]:
    """The eager stack's launch terms (costmodel/eager.py): its dispatch floor and optimizer."""
    if not t.kernels:
        return []
    opt = (stack.optimizer if stack is not None else None) or "foreach"
    bound = (
        "launch-bound: the host, not the GPU, sets the step"
        if t.launch_bound
        else (f"GPU-bound: the GPU's work is {t.total / t.dispatch_floor:.1f}x the floor")
    )
    return [
        f"  dispatch    floor {t.dispatch_floor:.3f} s = {t.kernels:,} kernel launches (+ FSDP2's "
        f"hooks) x the host's issue time per launch (costmodel/eager.yaml); {bound}",
        f"  optimizer   {opt} AdamW + gradient clipping {t.terms.optimizer:.3f} s over the rank's "
        "shard (costmodel/eager.py)",
    ]


def layout_text(
    res: SearchResult, gap: float | None, spec: str, usable_gib: float, tight: bool = False
) -> list[str]:
    head = f'your layout "{spec}"'
    if res.best is None:
        return [f"{head}: {res.reason}"]
    out = [f"{head}: best completion {res.best.describe()}", *plan_lines(res.best, usable_gib, res)]
    if tight:
        out.append(
            "  caution     fits only in the HBM that --headroom keeps free when choosing: it runs "
            "by this count, with little margin for allocator fragmentation"
        )
    if gap is not None:
        sw = res.stack.software
        best = "the unconstrained best" if sw == "any" else f"the best layout {sw} runs"
        out.append(
            f"  vs best     {gap:.1f}% slower than {best}"
            + (f" (a tie: within {PLAN_BAND.time_text()})" if gap / 100 <= PLAN_BAND.time else "")
            if gap > 0.05
            else f"  vs best     this is {best} (within 0.05%)"
        )
    return out


def framework_gap(res: SearchResult, free: SearchResult) -> float | None:
    """How much faster (%) the best layout of every framework ("any") is than the best of
    ``res``'s software."""
    if res.best is None or free.best is None:
        return None
    return 100 * (free.best.time.tokens_per_s / res.best.time.tokens_per_s - 1)


def framework_text(res: SearchResult, free: SearchResult) -> list[str]:
    """One line: what the framework's restriction costs against the unrestricted search
    (``--software``)."""
    gap, sw = framework_gap(res, free), res.stack.software
    if gap is None:
        return (
            []
            if free.best is None
            else [
                f"framework: no layout {sw} runs fits; the best of any framework is "
                f"{free.best.describe()}"
            ]
        )
    if gap <= 0.05:
        return [f"framework: {sw}'s best is the best of any framework (within 0.05%)"]
    return [
        f"framework: the best layout of any framework, {free.best.describe()}, is {gap:.1f}% "
        f"faster than {sw}'s best ({len(res.ranked)} of its layouts fit)"
    ]


def layout_json(res: SearchResult, gap: float | None, spec: str, tight: bool = False) -> dict:
    d = {
        "spec": spec,
        "fits": res.best is not None,
        "tight": tight,
        "reason": res.reason,
        "hbm_usable_bytes": res.cluster.gpu.hbm_bytes * (1 - res.headroom),
    }
    if res.best is not None:
        d.update(plan_dict(res.best, res), slower_than_best_pct=gap)
    return d


def layout_of(plan: dict) -> Layout:
    """The layout of a plan as ``plan_dict`` writes it (``dtrain plan --json``'s ``choice``)."""
    return Layout(
        dp_replicate=plan["hsdp_replicate"],
        dp_shard=plan["dp"] // plan["hsdp_replicate"],
        cp=plan["cp"],
        tp=plan["tp"],
        pp=plan["pp"],
        zero_stage=plan["zero_stage"],
        recompute=plan["recompute"],
        micro_batch=plan["micro_batch"],
        grad_accum=plan["grad_accum"],
        sequence_parallel=plan["sequence_parallel"],
        pp_schedule=plan["pp_schedule"],
        pp_virtual=plan["virtual_stages"],
        cp_impl=plan["cp_impl"],
        pp_split=plan["pp_split"],
    )


def plan_dict(p, res: SearchResult | None = None) -> dict:
    """One plan as JSON; with ``res`` (its search) also its FLOP rates (``flops``)."""
    t, m = p.time, p.memory
    return {
        "dp": p.dp,
        "tp": p.tp,
        "pp": p.pp,
        "virtual_stages": p.virtual_stages,
        "zero_stage": p.zero_stage,
        "recompute": p.recompute,
        "micro_batch": p.micro_batch,
        "grad_accum": p.grad_accum,
        "sequence_parallel": p.sequence_parallel,
        "describe": p.describe(),
        "memory_bytes": {
            "params": m.params,
            "grads": m.grads,
            "optimizer": m.optimizer,
            "activations": m.activations,
            "buffers": m.buffers,
            "total": m.total,
        },
        "pp_schedule": p.pp_schedule,
        "pp_split": p.pp_split,
        "cp": p.cp,
        "cp_impl": p.cp_impl,
        "hsdp_replicate": p.dp_replicate,
        "step_time_s": {
            "total": t.total,
            "compute": t.compute,
            "tp_comm": t.tp_comm,
            "cp_comm": t.cp_comm,
            "pp_comm": t.pp_comm,
            "bubble": t.bubble,
            "dp_comm": t.dp_comm,
            "dp_comm_exposed": t.dp_comm_exposed,
            "dp_contention": t.dp_contention,
            "overhead": t.overhead,
            "compute_terms": t.terms.as_dict(),
            "dispatch_floor": t.dispatch_floor,
        },
        "kernels_per_step": t.kernels,
        "launch_bound": t.launch_bound,
        "tokens_per_s": t.tokens_per_s,
        "tflops_per_gpu": t.tflops_per_gpu,
        "mfu": t.mfu,
    } | (flops(res, p) if res is not None else {})


def to_json(res: SearchResult, top: int, notes: list[str], run: Runnable = Runnable()) -> dict:
    s, c = res.model, res.cluster
    calib = {
        k: {"value": getattr(res.calib, k).value, "provenance": getattr(res.calib, k).provenance}
        for k in calibration_inputs()
    }
    return {
        "model": {
            "name": s.name,
            "layers": s.n_layer,
            "hidden": s.d_model,
            "heads": s.n_head,
            "kv_heads": s.n_kv_head,
            "seq": s.seq_len,
            "vocab": s.vocab,
            "params": s.num_params(),
        },
        "cluster": {
            "gpu": c.gpu.name,
            "gpus": c.gpus,
            "gpus_per_node": c.gpus_per_node,
            "intra_node_GBps_per_direction": c.nvlink.beta_Bps / 1e9,
            "inter_node_Gbps_per_gpu": c.ib.beta_Bps * 8 / 1e9,
            "hbm_usable_bytes": c.gpu.hbm_bytes * (1 - res.headroom),
            "power_w": c.gpu.power_w,
            "power_note": describe_power(c),
        },
        "global_batch": res.global_batch,
        "global_batch_tokens": res.global_batch * s.seq_len,
        "precision": res.precision,
        "calibration": calib,
        "notes": notes,
        "attention": res.stack.attention,
        "kernels": res.stack.kernels,
        "loss": res.stack.loss or res.stack.kernels,
        "tp_overlap": res.stack.tp_overlap,
        "async_tp": res.stack.async_tp,
        "fp8_all_gather": res.stack.fp8_all_gather,
        "fp8_scaling": res.stack.fp8_casts,
        "grad_reduce": res.stack.grad_reduce,
        "optimizer_states": res.stack.optimizer_states,
        "optimizer": res.stack.optimizer,
        "dp_sync": res.stack.dp_sync,
        "software": res.stack.software,
        "fits": res.best is not None,
        "reason": res.reason,
        "choice": plan_dict(res.best, res) if res.best else None,
        **_overrides_json(res, run),
        "explanation": explain(res, top, PLAN_BAND.time),
    }


def _overrides_json(res: SearchResult, run: Runnable) -> dict:
    """`train_overrides`: fsdp-scaling overrides (costmodel/overrides.py) that the trainer runs as
    printed, and their notes: the choice's when ``dtrain_runs``, else (``train_overrides_for``:
    dtrain_choice) those of the best layout dtrain runs, ``dtrain_choice``, beside the reason
    (``dtrain_refusal``)."""
    from .overrides import train_overrides

    out = {"dtrain_runs": None, "dtrain_refusal": run.refusal, "dtrain_choice": None}
    if res.best is None:
        return out | {
            "train_overrides": None,
            "train_overrides_notes": [],
            "train_overrides_for": None,
        }
    overrides, notes = train_overrides(res.best, res.model, res.global_batch, res.precision)
    out["dtrain_runs"] = run.refusal is None
    if run.refusal is None:
        return out | {
            "train_overrides": overrides,
            "train_overrides_notes": notes,
            "train_overrides_for": "choice",
        }
    alt = run.alt.best if run.alt is not None else None
    if alt is None:
        return out | {
            "train_overrides": None,
            "train_overrides_notes": [],
            "train_overrides_for": None,
        }
    overrides, notes = train_overrides(alt, run.alt.model, run.alt.global_batch, run.alt.precision)
    slower = 100 * (1 - alt.time.tokens_per_s / res.best.time.tokens_per_s)
    out["dtrain_choice"] = plan_dict(alt, run.alt) | {"slower_than_best_pct": slower}
    return out | {
        "train_overrides": overrides,
        "train_overrides_notes": notes,
        "train_overrides_for": "dtrain_choice",
    }
