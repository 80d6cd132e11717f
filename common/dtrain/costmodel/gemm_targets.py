"""What the GEMM probe times: the models the runs under a results folder trained (``targets``),
each as a dense shape (``shape_of_target``) and its forward GEMMs (``gemms_of``, TP shards
included), and the time the fitted curve gives a target's GEMMs per training step
(``gemm_step_s``)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from dtrain.model.args import GPTConfig
from dtrain.results import contract, contract_records
from dtrain.results.loader import complete_runs

from .gpt_shape import moe_model_of
from .efficiency import Gemm, GemmCurve, gemm_time, head_gemm, layer_gemms
from .shapes import Layout, ModelShape


def targets(results: Path) -> tuple[list[dict], int, list[Path]]:
    """(models the runs trained: {"kind", "config": GPTConfig fields | block fields,
    "micro_batch", "tp"}, threads per rank, the runs they came from), from the runs' guide inputs
    (dtrain.results.contract)."""
    found, threads, sources = {}, [], []
    for run in complete_runs([results], warn=False):
        if run.derived:  # publishes no measurement of its own; its env.json is a source's copy
            continue
        if run.env.get("threads_per_rank"):
            threads.append(int(run.env["threads_per_rank"]))
        used = False
        for m in contract.read(run.summary):
            # an MoE run (``moe_run``) too: its model's step on one process (ep 1, every expert
            # local) gives its own fixed overhead (routing, the experts' permutation) to the
            # guide's MoE row
            if isinstance(m, (contract.TrainingMeasurement, contract_records.MoeMeasurement)):
                ds = [
                    {
                        "kind": "gpt",
                        "config": dict(m.model),
                        "micro_batch": m.layout.micro_batch,
                        "tp": 1,
                    }
                ]
            elif isinstance(m, contract_records.TpMeasurement):
                ds = [
                    {
                        "kind": m.module,
                        "config": {
                            "d_model": m.d_model,
                            "n_head": m.n_head,
                            "n_kv_head": m.n_kv_head,
                            "seq_len": m.seq_len,
                            "mlp_ratio": m.mlp_ratio,
                        },
                        "micro_batch": m.micro_batch,
                        "tp": tp,
                    }
                    for tp in (1, m.tp)
                ]
            else:
                continue
            used = True
            found.update((repr(d), d) for d in ds)
        if used:
            sources.append(run.path)
    return (
        [found[k] for k in sorted(found)],
        (statistics.median(threads) if threads else 1),
        sources,
    )


def shape_of_target(t: dict) -> ModelShape:
    """The target as a dense shape; an MoE GPT as its dense proxy (every layer's MLP the width a
    token meets: ``moe_model.MoEModel.proxy``), whose GEMMs are its balanced FLOPs."""
    c = t["config"]
    if t["kind"] == "gpt" and c.get("moe"):
        return replace(moe_model_of(GPTConfig(**c)).proxy, name="")
    if t["kind"] == "gpt":
        return ModelShape(
            c["n_layer"],
            c["d_model"],
            c["n_head"],
            c["n_kv_head"] or c["n_head"],
            c["vocab_size"],
            c["seq_len"],
            float(c["mlp_ratio"]),
            False,
            c["tie_embeddings"],
        )
    ffn = float(c["mlp_ratio"]) if t["kind"] == "block" else 0.0
    return ModelShape(
        1, c["d_model"], c["n_head"], c["n_kv_head"] or c["n_head"], 1, c["seq_len"], ffn or 1e-9
    )


def gemms_of(t: dict) -> list[Gemm]:
    shape = shape_of_target(t)
    lay = Layout(tp=t["tp"], micro_batch=t["micro_batch"])
    out = [
        g
        for g in layer_gemms(shape, lay)
        if t["kind"] != "attention" or g.name not in ("fc1", "fc2")
    ]
    return out + ([head_gemm(shape, lay)] if t["kind"] == "gpt" else [])


def gemm_step_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    """Forward + backward (3x the forward FLOPs) of the target's GEMMs on the fitted curve."""
    if t["kind"] == "gpt":
        return 3 * _gpt_gemm_s(t, curve, peak, value_bytes)
    return 3 * sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in gemms_of(t))


def _gpt_gemm_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    shape = shape_of_target(t)
    lay = Layout(tp=t["tp"], micro_batch=t["micro_batch"])
    layer = sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in layer_gemms(shape, lay))
    return shape.n_layer * layer + gemm_time(head_gemm(shape, lay), peak, 0.0, curve, value_bytes)
