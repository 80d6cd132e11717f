"""What `dtrain plan --json` prints: one JSON object with every term of the choice, the
calibration, the trainer overrides and the explanation; a given layout's; and ``layout_of``, which
reads a plan's layout back."""

from __future__ import annotations

from .calibration import calibration_inputs
from .explain import explain
from .plan_flops import flops
from .plan_header import describe_power
from .plan_runnable import Runnable
from .search import SearchResult
from .shapes import Layout
from .uncertainty import PLAN_BAND


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
            "grad_accum": t.grad_accum,  # of compute_terms' memory
            "fsdp_copy_out": t.fsdp_copy_out,  # of compute_terms' memory
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
