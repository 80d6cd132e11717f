"""The moe_run record (dtrain.results.contract_records.MoeMeasurement): what an MoE training run
publishes for the guide's local check of expert parallelism, round-tripped through summary.json; a
dense run publishes none; and the issue's check command, `python -m fsdp_scaling world_size=2
train.ep=2 model.preset=tiny model.moe.experts=4 model.moe.top_k=2 train.steps=8`, completes and
records ep, the overload factor and the all-to-all share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.core.layout import Layout
from dtrain.model.args import GPTConfig, model_dict
from dtrain.model.moe_args import MoEArgs
from dtrain.results import contract, contract_records, trainer_inputs

MODEL = model_dict(GPTConfig.from_preset("tiny", moe=MoEArgs(experts=4, top_k=2)))
LAYOUT = Layout(dp_shard=2, zero_stage=3, ep=2, micro_batch=2)
RESULT = {
    "mixed_precision": "fp32",
    "tokens_per_step": 256,
    "step_time_s": 0.05,
    "moe_overload_mean": 1.125,
    "moe_expert_overload_mean": 1.25,
    "moe_dropped_frac_mean": 0.0,
}
BREAKDOWN = {"step_s": 0.08, "ep_comm_s": 0.02, "compute_s": 0.03}
WHERE = contract_records.where_of("cpu", "gloo")


def test_an_moe_run_record_round_trips():
    [m] = trainer_inputs.moe_inputs(RESULT, MODEL, LAYOUT, WHERE, BREAKDOWN)
    assert (m.a2a_s, m.a2a_share, m.overload, m.layout.ep) == (0.02, 0.25, 1.125, 2)
    encoded = contract.encode([m])
    assert encoded["records"][0]["kind"] == "moe_run"
    [back] = contract.read({"guide_inputs": json.loads(json.dumps(encoded))})
    assert back == m
    assert GPTConfig(**back.model).moe == MoEArgs(experts=4, top_k=2)


def test_no_record_without_experts_or_a_profile():
    dense = model_dict(GPTConfig.from_preset("tiny"))
    assert trainer_inputs.moe_inputs(RESULT, dense, LAYOUT, WHERE, BREAKDOWN) == []
    assert trainer_inputs.moe_inputs(RESULT, MODEL, LAYOUT, WHERE, None) == []


def test_a_record_outside_the_folding_rule_is_a_contract_error():
    [m] = trainer_inputs.moe_inputs(RESULT, MODEL, LAYOUT, WHERE, BREAKDOWN)
    value = json.loads(json.dumps(contract.encode([m])))
    value["records"][0]["layout"]["ep"] = 4
    with pytest.raises(contract_records.ContractError) as e:
        contract.decode(value)
    assert "ep·etp = 4 must divide the ranks experts fold from" in str(e.value)


@pytest.mark.slow  # ~20 s on 2 busy cores; test_train_ep keeps the fast parity run
def test_the_issues_check_command_records_ep_and_the_overload_factor(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "fsdp_scaling",
        "world_size=2",
        "train.ep=2",
        "model.preset=tiny",
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "train.steps=8",
        f"results_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [path] = tmp_path.rglob("summary.json")
    summary = json.loads(path.read_text())
    assert summary["ep"] == 2 and summary["moe_overload_mean"] >= 1.0
    [m] = contract.read(summary)
    assert m.kind == "moe_run" and m.layout.ep == 2 and 0 < m.a2a_share < 1
    steps = [json.loads(x) for x in (path.parent / "records.jsonl").open()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert len(steps) == 8 and all(s["moe_overload"] >= 1.0 for s in steps)
    assert all(sum(s["moe_tokens_per_expert"]) == 2 * 256 * 2 for s in steps)  # layers x T x k
