"""Issue 41's joins: the guide's local check gains a row for an MoE run (``moe_run`` record),
priced with the MoE cost model's own terms on this host; the all-to-all's token-count exchange and
allreduce-bench's uneven all-to-all fit reach the price; the GPT's 2-matrix experts are the cost
model's MoE model (parameters and FLOPs) and the gemm-probe times an MoE run's own model."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.core.layout import Layout
from dtrain.costmodel.calibrate import calibrate
from dtrain.costmodel.collectives import all_to_all_uneven_time
from dtrain.costmodel.gemm_targets import shape_of_target, targets
from dtrain.costmodel.gpt_shape import moe_model_of
from dtrain.costmodel.hardware import Cluster, GPUProfile, LinkModel
from dtrain.costmodel.moe_comm import ep_comm
from dtrain.guide.moe_check import all_checks, moe_checks
from dtrain.model.args import GPTConfig, model_dict, num_params
from dtrain.model.flops import flops_per_token
from dtrain.model.moe_args import MoEArgs
from dtrain.results import contract_records
from dtrain.results.metrics import write_summary

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"
TINY_MOE = GPTConfig.from_preset("tiny", moe=MoEArgs(experts=4, top_k=2))
LAYOUT = Layout(dp_shard=2, zero_stage=3, ep=2, micro_batch=2)


def _moe_record(step=0.0525, a2a=0.0193, profiled=0.0549, overload=1.125):
    return contract_records.MoeMeasurement(
        model=model_dict(TINY_MOE),
        layout=LAYOUT,
        precision="fp32",
        tokens_per_step=256,
        step_time_s=step,
        profiled_step_s=profiled,
        a2a_s=a2a,
        a2a_share=a2a / profiled,
        overload=overload,
        expert_overload=1.25,
        dropped_frac=0.0,
        where=contract_records.where_of("cpu", "gloo"),
    )


def _with_moe_run(tmp_path: Path) -> Path:
    """The CPU fixture tree plus an MoE run (a copy of a dense fsdp run, its record replaced)."""
    root = tmp_path / "cpu"
    shutil.copytree(CPU, root)
    fsdp = root / "fsdp-scaling"
    run = fsdp / "20250301-100100-000042"
    shutil.copytree(fsdp / "20250301-100100-000000", run)
    summary = json.loads((run / "summary.json").read_text())
    write_summary(run, {**summary, "guide_inputs": [_moe_record()]})
    return root


def test_the_gpt_experts_are_the_cost_models_moe_model():
    """2-matrix GELU experts: the cost model's MoE model of an MoE GPTConfig has its FLOPs and its
    parameters (less the GPT's learned positions, seq_len x d)."""
    cfg = GPTConfig.from_preset(
        "tiny", moe=MoEArgs(experts=4, top_k=2, shared_experts=1, dense_layers=1)
    )
    model = moe_model_of(cfg)
    assert model.mlp_matrices == 2 and model.expert_params() == 4 * 2 * 64 * 256
    assert model.flops_per_token() == flops_per_token(cfg)
    assert num_params(cfg) - model.num_params() == cfg.seq_len * cfg.d_model


def test_uneven_all_to_all_prices_at_the_uneven_fit():
    # 2 ranks, rank 1 sends 3000 B to rank 0, rank 0 sends 1000 B: the busiest moves 3000 B
    sends = [[0.0, 1000.0], [3000.0, 0.0]]
    even_only = LinkModel(1e-4, 1e9, collectives=(("all_to_all", 2e-4, 2e9),))
    both = LinkModel(
        1e-4, 1e9, collectives=(("all_to_all", 2e-4, 2e9), ("all_to_all_v", 3e-4, 1e9))
    )
    assert all_to_all_uneven_time(sends, even_only) == pytest.approx(3000 / 2e9 + 2e-4)
    assert all_to_all_uneven_time(sends, both) == pytest.approx(3000 / 1e9 + 3e-4)


def test_ep_comm_counts_the_token_count_exchange_by_hand():
    """ep 2 on one node, tiny (d 64), 128 tokens a rank, top-2, fp32 rows, ρ 1.125: each of the 4
    passes moves the busiest rank's ρ x 128·2·64·4/2 B; the counts exchange 4 int64, 8·4/2 B to
    the peer; α per pass (n − 1 = 1 peer)."""
    alpha, beta = 1e-4, 1e9
    link = LinkModel(alpha, beta, "host")
    prof = GPUProfile("host", 1.0, 1.0, 1e6, 0.0, 1.0, 2.0, 2, 0, 1.0, 8.0, "measured")
    cluster = Cluster(2, 2, prof, link, link)
    model = moe_model_of(TINY_MOE)
    model = replace(model, moe=replace(model.moe, imbalance=1.125))
    got = ep_comm(model, LAYOUT, cluster, 4, 4).seconds
    passes = 4 * (1.125 * 128 * 2 * 64 * 4 / 2 / beta + alpha)
    counts = 8 * 4 / 2 / beta + alpha
    assert got == pytest.approx(passes + counts)


def test_an_moe_run_gets_a_row_priced_by_the_moe_cost_model(tmp_path):
    root = _with_moe_run(tmp_path)
    report = calibrate([root], base=root, warn=False)
    [row] = moe_checks(report, root)
    assert row.what == "MoE ep2 step" and row.experiment == "fsdp-scaling"
    assert row.measured_s == pytest.approx(0.0525) and row.predicted_s > 0
    assert "EP a2a comm measured 19 ms" in row.detail
    assert "a share of 35% of the profiled step" in row.detail and "(not judged:" in row.detail
    assert "rho 1.12 = the run's measured overload" in row.basis
    # the predicted all-to-all in the detail is ep_comm's x the 2 MoE layers on the fixture link
    link = report.local_links["intra"]
    per_layer = 4 * (1.125 * 128 * 2 * 64 * 4 / 2 / link.beta_Bps + link.alpha_s) + (
        16 / link.beta_Bps + link.alpha_s
    )
    assert f"vs predicted {2 * per_layer * 1e3:.0f} ms per step" in row.detail
    # among the guide's rows, once, in the local checks' order
    rows = all_checks(report, root)
    assert [c.what for c in rows].count("MoE ep2 step") == 1
    assert rows == sorted(rows, key=lambda c: (c.experiment, c.run, c.what))


def test_no_moe_row_without_a_local_fsdp_run(tmp_path):
    root = _with_moe_run(tmp_path)
    for run in (root / "fsdp-scaling").iterdir():
        if run.name != "20250301-100100-000042":
            shutil.rmtree(run)
    assert moe_checks(calibrate([root], base=root, warn=False), root) == []


def test_the_gemm_probe_times_an_moe_runs_own_model(tmp_path):
    root = _with_moe_run(tmp_path)
    found, _, _ = targets(root / "fsdp-scaling")
    [moe] = [t for t in found if t["config"].get("moe")]
    assert moe["kind"] == "gpt" and moe["micro_batch"] == 2
    # its GEMMs are the active model's: the dense proxy, each MLP k x the expert width
    proxy = shape_of_target(moe)
    assert proxy.ffn_hidden == 2 * 256 and not proxy.gated_mlp


def test_memory_fit_counts_the_experts_and_routed_activations():
    """tiny, 4 experts of 256, top-2, zero3 on 2 ranks with ep 2: rank 0 holds half the non-expert
    weights and its 2 experts of each layer whole (efsdp 1), 166,304 fp32 parameters, as the
    trainer measured (fsdp-scaling's state table: 665,216 bytes of parameters on rank 0); 16 bytes
    each with grads and Adam. The dense twin counts one MLP per layer and no routed rows."""
    from dtrain.train.config import TrainConfig
    from dtrain.train.memory_fit import moe_need, training_need

    train = TrainConfig(micro_batch=2, strategy="zero3", ep=2).resolved(2, "cpu")
    need = training_need(TINY_MOE, train, 2)
    experts = 2 * 4 * 2 * 64 * 256 / 2
    assert (num_params(TINY_MOE) - 2 * experts) / 2 + experts == 166_304
    assert need.states == pytest.approx(16 * 166_304)
    assert LAYOUT.efsdp == 1
    # activations: the dense proxy's (each MLP k x the expert width) and the routed rows
    dense_train = TrainConfig(micro_batch=2, strategy="zero3").resolved(2, "cpu")
    dense = training_need(GPTConfig.from_preset("tiny"), dense_train, 2)
    _, routed = moe_need(moe_model_of(TINY_MOE), LAYOUT, 2.0)  # fp32: 2 x the 16-bit bytes
    assert routed > 0 and need.activations > dense.activations + routed


def test_a_probe_overhead_is_its_own_models():
    """The probe's overhead of an MoE model and of its dense twin (same dims, same micro-batch):
    each row reads its own."""
    from dtrain.costmodel.efficiency import GemmCurve
    from dtrain.guide.local_inputs import _Probe

    dense_cfg = model_dict(GPTConfig.from_preset("tiny"))
    moe_cfg = model_dict(TINY_MOE)
    overheads = [
        {"kind": "gpt", "config": moe_cfg, "micro_batch": 2, "overhead_s": 0.005},
        {"kind": "gpt", "config": dense_cfg, "micro_batch": 2, "overhead_s": 0.003},
    ]
    probe = _Probe(GemmCurve(0.9, 1e5), overheads, "probe", 1e11)
    match = {k: dense_cfg[k] for k in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")}
    assert probe.overhead("gpt", match, 2, 1e11) == 0.003
    assert probe.overhead("gpt", {**match, "moe": moe_cfg["moe"]}, 2, 1e11) == 0.005
