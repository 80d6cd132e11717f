"""`dtrain plan --experts ...` prints the trainer's overrides for an MoE layout it runs (train.ep,
train.etp, model.moe.*), and, when the trainer refuses the best plan (an MoE model with tp or
pp > 1, or etp > 1: ``feasibility.check_moe``), the refusal and the best plan it runs, as the
dense plan's ``dtrain_refusal``."""

from __future__ import annotations

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel.moe_model import MoEModel, MoESpec
from dtrain.costmodel.overrides import moe_overrides, trainer_refusal
from dtrain.costmodel.shapes import Layout, ModelShape

TINY = MoEModel(ModelShape(2, 64, 4, 4, 256, 64, 4.0, True), MoESpec(4, 2, 256))
QWEN3_30B = [
    "--layers", "48", "--hidden", "2048", "--heads", "32", "--kv-heads", "4", "--head-dim", "128",
    "--vocab", "151936", "--experts", "128", "--top-k", "8", "--expert-ffn", "768",
]  # fmt: skip


def test_the_overrides_of_an_ep_layout_run_in_the_trainer():
    lay = Layout(dp_shard=2, zero_stage=3, ep=2, micro_batch=2)
    overrides, _ = moe_overrides(lay, TINY, 8)
    for key in ("train.ep=2", "train.etp=1", "model.moe.experts=4", "model.moe.top_k=2"):
        assert key in overrides
    assert "model.moe.expert_ffn=256" in overrides and "world_size=2" in overrides
    assert trainer_refusal(overrides) is None


@pytest.mark.parametrize(
    "lay, why",
    [
        (
            Layout(dp_shard=2, tp=2, zero_stage=3, ep=2, etp=2, micro_batch=2),
            "train.etp=2: expert tensor parallelism is not implemented",
        ),
        (
            Layout(dp_replicate=2, zero_stage=0, ep=2, micro_batch=2),
            "train.ep=2 does not divide dp_shard",
        ),
    ],
)
def test_the_trainers_moe_refusals(lay, why):
    overrides, _ = moe_overrides(lay, TINY, 8)
    assert why in trainer_refusal(overrides)


def test_moe_with_tp_on_attention_runs_as_printed():
    """MoE composes with TP on attention (each tp rank routes its share of the tokens, etp 1), so
    tp2 x ep2 passes the trainer's own checks."""
    overrides, _ = moe_overrides(Layout(tp=2, zero_stage=3, ep=2, micro_batch=2), TINY, 8)
    assert "train.tp=2" in overrides and "train.ep=2" in overrides
    assert trainer_refusal(overrides) is None


def test_plan_json_names_the_refusal_and_the_overrides_the_trainer_runs(capsys):
    rc = main(["plan", *QWEN3_30B, "--gpus", "8", "--gpu", "h100-sxm", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["dtrain_runs"] in (True, False)
    overrides = out["train_overrides"]
    assert (
        any(o.startswith("train.ep=") for o in overrides) and "model.moe.experts=128" in overrides
    )
    assert trainer_refusal(overrides) is None  # what it prints, the trainer runs
    if not out["dtrain_runs"]:
        assert out["dtrain_refusal"] and out["train_overrides_for"] == "dtrain_choice"
        assert out["dtrain_choice"]["slower_than_best_pct"] >= 0


def test_plan_text_has_the_dtrain_line(capsys):
    main(["plan", *QWEN3_30B, "--gpus", "8", "--gpu", "h100-sxm"])
    text = capsys.readouterr().out
    words = " ".join(text.split())  # the command wraps within 100 columns
    assert "dtrain:   " in text and "python -m fsdp_scaling" in words and "train.ep=" in words
    assert all(len(line) <= 100 for line in text.splitlines())
