"""`dtrain plan --experts E --top-k K --expert-ffn F ...`: the plan of an MoE model (issue 41).

``add_arguments`` adds the MoE flags to ``dtrain plan``; ``run`` answers when --experts is given:
the best layout with its ep (and etp), the routed experts' terms (``moe_cost.MoETerms``) and memory,
the best with EP = 1 beside it, the trainer's overrides (``overrides.moe_overrides``) for the best
layout it runs (its refusal of the best, when it refuses it: ``trainer_refusal``, whose MoE rules
are ``feasibility.check_moe``), and ``--json`` naming every MoE term.
"""

from __future__ import annotations

import json
from dataclasses import replace

from dtrain.core.errors import UserError
from dtrain.model.flops import MLA

from dtrain.core import terminal

from .hardware import GiB
from .plan_wrap import fit_lines
from .moe_model import DISPATCHERS, MoEModel, MoESpec
from .moe_search import MoEPlan, MoESearchResult, moe_search
from .overrides import moe_overrides, trainer_refusal
from .shapes import ModelShape

PRECISIONS = ("bf16", "fp8", "mxfp8")
BLACKWELL = ("b200", "b300", "gb200", "gb300")
_MLA_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim")


def add_arguments(p, pos_int, nonneg_int, pos_float) -> None:
    g = p.add_argument_group("mixture of experts (with --experts; SwiGLU experts)")
    g.add_argument("--experts", type=pos_int, help="routed experts per MoE layer")
    g.add_argument("--top-k", type=pos_int, help="experts each token is routed to")
    g.add_argument("--expert-ffn", type=pos_int, help="one expert's FFN hidden size")
    g.add_argument("--shared-experts", type=nonneg_int, default=0, help="always-on experts")
    g.add_argument("--shared-ffn", type=nonneg_int, default=0, help="a shared expert's FFN width")
    g.add_argument(
        "--dense-layers",
        type=nonneg_int,
        default=0,
        help="first layers that stay dense (their FFN: --ffn-hidden), as DeepSeek-V3's 3",
    )
    g.add_argument(
        "--imbalance",
        type=pos_float,
        default=1.0,
        help="rho: the busiest rank's routed tokens over the balanced count (1.0 = balanced, as "
        "benchmarks force it; scales expert compute, received bytes and activations)",
    )
    g.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall")
    g.add_argument(
        "--a2a-overlap",
        action="store_true",
        help="dispatch/combine hidden behind other micro-batches' compute (DualPipe, Megatron's "
        "EP overlap), at the SMs its kernels hold",
    )
    g.add_argument("--head-dim", type=pos_int, help="head dim when heads x head dim != hidden")
    g.add_argument("--mla", action="store_true", help="DeepSeek's multi-head latent attention")
    for flag in _MLA_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=nonneg_int, help="MLA shape (--mla)")


def moe_model(a, base: ModelShape) -> MoEModel:
    """The MoE model of the flags, each bad value one error line."""
    for flag in ("top_k", "expert_ffn"):
        if getattr(a, flag) is None:
            raise UserError(f"--experts needs --{flag.replace('_', '-')}")
    mla = None
    if a.mla:
        missing = [f for f in _MLA_FLAGS if getattr(a, f) is None]
        if missing:
            raise UserError("--mla needs " + ", ".join("--" + f.replace("_", "-") for f in missing))
        mla = MLA(*(getattr(a, f) for f in _MLA_FLAGS))
    elif any(getattr(a, f) is not None for f in _MLA_FLAGS):
        raise UserError("--q-lora-rank, --kv-lora-rank, ... shape MLA: add --mla")
    if a.imbalance < 1.0:
        raise UserError(f"--imbalance {a.imbalance:g} must be >= 1.0 (1.0 = balanced)")
    try:
        spec = MoESpec(
            a.experts,
            a.top_k,
            a.expert_ffn,
            a.shared_experts,
            a.shared_ffn,
            a.dense_layers,
            a.imbalance,
            a.dispatcher,
            a.a2a_overlap,
        )
        return MoEModel(replace(base, gated_mlp=True), spec, a.head_dim or 0, mla, base.name)
    except ValueError as e:
        raise UserError(f"bad MoE shape: {e}") from None


def refuse_moe_flags(a) -> None:
    """MoE-only flags and layout fields without --experts are one error line."""
    given = [f for f in ("top_k", "expert_ffn", "head_dim") if getattr(a, f) is not None]
    given += ["mla"] if a.mla else []
    if a.layout and any(k in a.layout for k in ("ep=", "etp=")):
        given.append("--layout ep=/etp=")
    if given:
        raise UserError(
            f"{', '.join(given)} shape(s) an MoE model: add --experts E (with --top-k and "
            "--expert-ffn), or leave them out"
        )


def check_precision(precision: str, gpu: str) -> None:
    if precision == "mxfp8" and not gpu.startswith(BLACKWELL):
        raise UserError(
            f"--precision mxfp8 needs Blackwell's block-scaled FP8 tensor cores ({gpu} has none): "
            "use --gpu b200/b300/gb200/gb300 or --precision fp8"
        )


def plan_json(p: MoEPlan, res: MoESearchResult) -> dict:
    lay, t, m = p.layout, p.time, p.moe
    return {
        "layout": {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "cp": lay.cp,
            "ep": lay.ep,
            "etp": lay.etp,
            "efsdp": lay.efsdp,
            "expert_dp": lay.expert_dp,
            "zero_stage": lay.zero_stage,
            "recompute": lay.recompute,
            "micro_batch": lay.micro_batch,
            "grad_accum": lay.grad_accum,
            "virtual_stages": lay.virtual_stages,
            "sequence_parallel": lay.sequence_parallel,
        },
        "describe": p.describe(),
        "step_s": t.total,
        "tokens_per_s": t.tokens_per_s,
        "mfu": t.mfu,
        "model_tflops_per_gpu": t.tflops_per_gpu,
        "dense_proxy": {
            "compute_s": t.compute,
            "tp_comm_s": t.tp_comm,
            "cp_comm_s": t.cp_comm,
            "pp_comm_s": t.pp_comm,
            "bubble_s": t.bubble,
            "dp_comm_exposed_s": t.dp_comm_exposed,
        },
        "moe_terms": {
            "expert_gemm_s": m.expert_gemm,
            "router_s": m.router,
            "attention_extra_s": m.attention_extra,
            "all_to_all_s": m.all_to_all,
            "all_to_all_hidden_s": m.all_to_all_hidden,
            "all_to_all_contention_s": m.a2a_contention,
            "all_to_all_exposed_s": m.exposed_all_to_all,
            "all_to_all_exposed_share": m.exposed_all_to_all / t.total,
            "all_to_all_exposed_without_overlap_s": m.all_to_all,
            "all_to_all_exposed_with_overlap_s": m.exposed_with_overlap,
            "all_to_all_hidden_share_with_overlap": (
                1 - m.exposed_with_overlap / m.all_to_all if m.all_to_all else 0.0
            ),
            "expert_dp_s": m.expert_dp,
            "expert_optimizer_s": m.optimizer,
            "tokens_per_expert": m.tokens_per_expert,
            "a2a_wire_bytes_per_layer_microbatch": m.a2a_wire_bytes,
            "a2a_link": m.a2a_link,
        },
        "memory_gib": {
            "params": p.memory.params / GiB,
            "grads": p.memory.grads / GiB,
            "optimizer": p.memory.optimizer / GiB,
            "activations": p.memory.activations / GiB,
            "buffers": p.memory.buffers / GiB,
            "total": p.memory.total / GiB,
            "expert_params_per_gpu": p.memory_terms["expert_params_per_gpu"],
            "expert_states": p.memory_terms["expert_state_bytes"] / GiB,
            "expert_shard_group": p.memory_terms["expert_shard_group"],
            "routed_activations": p.memory_terms["routed_activation_bytes"] / GiB,
        },
    }


def model_json(model: MoEModel) -> dict:
    m = model.moe
    return {
        "params": model.num_params(),
        "active_params": model.active_params(),
        "flops_per_token": model.flops_per_token(),
        "flop_rule": "Megatron's MoE rule: 6 x (attention + top_k routed + shared experts + "
        "dense layers + lm_head weights) + attention core; router not counted",
        "experts": m.experts,
        "top_k": m.top_k,
        "expert_ffn": m.expert_ffn,
        "shared_experts": m.shared_experts,
        "dense_layers": m.dense_layers,
        "imbalance": m.imbalance,
        "dispatcher": m.dispatcher,
        "a2a_overlap": m.a2a_overlap,
        "head_dim": model.hd,
        "mla": model.mla._asdict() if model.mla else None,
    }


# plans tried for the best one the trainer runs when it refuses the best (each check builds the
# model's config: bounded)
RUNNABLE_TRIES = 50


def trainer_run(res: MoESearchResult) -> dict:
    """Whether dtrain's trainer runs the best plan (``dtrain_runs``; ``dtrain_refusal``: its
    reason, e.g. an MoE model with tp or pp > 1, or etp > 1) and the overrides of the plan it runs:
    the best's, else the best-ranked plan it runs (``train_overrides_for``: choice or
    ``dtrain_choice``, a describe() of it)."""
    out = {"dtrain_runs": None, "dtrain_refusal": None, "dtrain_choice": None}
    none = {"train_overrides": None, "train_overrides_notes": [], "train_overrides_for": None}
    if res.best is None:
        return out | none
    args = (res.model, res.global_batch, res.precision)
    overrides, notes = moe_overrides(res.best.layout, *args)
    why = trainer_refusal(overrides)
    out |= {"dtrain_runs": why is None, "dtrain_refusal": why}
    if why is None:
        return out | {
            "train_overrides": overrides,
            "train_overrides_notes": notes,
            "train_overrides_for": "choice",
        }
    # the trainer's MoE rules first (tp = pp = etp = 1), then its own check of each
    near = [p for p in res.ranked if p.layout.tp * p.layout.pp * p.layout.etp == 1]
    for p in near[:RUNNABLE_TRIES]:
        overrides, notes = moe_overrides(p.layout, *args)
        if trainer_refusal(overrides) is None:
            slower = 100 * (1 - p.time.tokens_per_s / res.best.time.tokens_per_s)
            return out | {
                "dtrain_choice": {"describe": p.describe(), "slower_than_best_pct": slower},
                "train_overrides": overrides,
                "train_overrides_notes": notes,
                "train_overrides_for": "dtrain_choice",
            }
    return out | none


def trainer_lines(run: dict) -> list[str]:
    """The plan's dtrain line: runs it (its overrides), or why not and the plan it runs."""
    if run["dtrain_runs"] is None:
        return []
    cmd = "python -m fsdp_scaling " + " ".join(run["train_overrides"] or [])
    if run["dtrain_runs"]:
        return [f"dtrain:   runs it: {cmd}"]
    out = [f"dtrain:   cannot run it ({run['dtrain_refusal']})"]
    alt = run["dtrain_choice"]
    if alt is None:
        return out + ["          no plan dtrain runs fits"]
    return out + [
        f"          best it runs: {alt['describe']}, {alt['slower_than_best_pct']:.0f}% slower: "
        + cmd
    ]


def to_json(res: MoESearchResult, top: int) -> dict:
    out = {
        "model": model_json(res.model),
        "gpus": res.cluster.gpus,
        "gpu": res.cluster.gpu.name,
        "precision": res.precision,
        "global_batch": res.global_batch,
        "reason": res.reason,
        "choice": plan_json(res.best, res) if res.best else None,
        "runners_up": [plan_json(p, res) for p in res.ranked[1 : 1 + top]],
    }
    one = res.best_at(ep=1)
    out["best_ep1"] = plan_json(one, res) if one else None
    return out | trainer_run(res)


def text(res: MoESearchResult) -> list[str]:
    model, m = res.model, res.model.moe
    lines = [
        f"MoE model: {model.num_params() / 1e9:.1f}B parameters, {model.active_params() / 1e9:.1f}B"
        f" active; {m.experts} experts, top-{m.top_k}, {m.shared_experts} shared, "
        f"{m.dense_layers} dense layers; rho {m.imbalance:g}; {m.dispatcher}"
        + (" with A2A overlap" if m.a2a_overlap else ""),
        f"{res.cluster.gpus}x {res.cluster.gpu.name}, {res.precision}, global batch "
        f"{res.global_batch} x {model.base.seq_len} tokens: {res.reason}",
    ]
    if res.best is None:
        return lines
    for label, p in (("best", res.best), ("best with ep=1", res.best_at(ep=1))):
        if p is None:
            lines.append(f"{label}: none fits")
            continue
        t, e = p.time, p.moe
        lines += [
            f"{label}: {p.describe()}",
            f"  step {t.total:.3f} s, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%} "
            f"({t.tflops_per_gpu:.0f} model TFLOP/s per GPU), {p.memory.total / GiB:.1f} GiB",
            f"  all-to-all {e.all_to_all:.3f} s over {e.a2a_link or 'none'}, exposed "
            f"{e.exposed_all_to_all:.3f} s ({e.exposed_all_to_all / t.total:.1%} of the step); "
            f"expert GEMMs +{e.expert_gemm:.3f} s at {e.tokens_per_expert:,.0f} tokens per "
            f"local expert; expert DP {e.expert_dp:+.3f} s",
        ]
    return lines


def run(a, base: ModelShape, cluster, calib, stack, fixed: dict | None) -> int:
    check_precision(a.precision, cluster.gpu.name)
    model = moe_model(a, base)
    if fixed and "ep" in fixed and model.moe.experts % fixed["ep"]:
        raise UserError(
            f"--layout: ep={fixed['ep']} does not divide --experts {model.moe.experts}: "
            "give a divisor"
        )
    res = moe_search(
        model,
        cluster,
        a.global_batch,
        calib,
        precision=a.precision,
        headroom=a.headroom,
        stack=stack,
        fixed=fixed,
    )
    if a.json:
        print(json.dumps(to_json(res, a.top), indent=2, sort_keys=True))
    else:
        lines = text(res) + trainer_lines(trainer_run(res))
        print("\n".join(fit_lines(lines, terminal.width())))
    return 0 if res.best else 1
