"""Every `train_overrides` that `dtrain plan` prints runs in the trainer as printed (issue 40).

Full-size plans (a dense one, a long-sequence one with cp, one with pp whose best layout pairs cp
with pp, which dtrain refuses, and an hsdp one) are checked by the trainer's own validation on the
composed fsdp-scaling config (`run_checks.check_values`: TrainConfig.validate and validate_model,
no ranks started); a small plan's overrides are run for real for a few steps."""

from __future__ import annotations

import json

import pytest

from conftest import py
from dtrain.costmodel.overrides import train_overrides, trainer_refusal
from dtrain.costmodel.plan_inputs import global_batch_of
from dtrain.costmodel.search import search
from dtrain.costmodel.shapes import ModelShape
from dtrain.costmodel.hardware import Cluster
from dtrain.costmodel.software import SOFTWARE
from dtrain.core.errors import UserError
from dtrain.results import loader
from dtrain.run import precheck
from dtrain.train import run_checks

LLAMA3_70B = (
    "--layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn-hidden 28672 --gated-mlp "
    "--vocab 128256"
).split()
LLAMA3_8B = (
    "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --gated-mlp "
    "--vocab 128256"
).split()
PLANS = {
    "dense 8B on 8": [*LLAMA3_8B, "--gpus", "8"],
    "long-sequence 8B 128K on 64 (cp)": [*LLAMA3_8B, "--seq", "131072", "--gpus", "64"],
    "70B 8K on 64 (pp; its best pairs cp with pp)": [*LLAMA3_70B, "--seq", "8192", "--gpus", "64"],
}


def plan_json(args: list[str]) -> dict:
    out = py("-m", "dtrain.cli.main", "plan", *args, "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def trainer_validates(overrides: list[str]) -> None:
    """The composed fsdp-scaling config passes the trainer's value checks (no host checks: a
    full-size model is not this host's to fit)."""
    precheck.check_overrides(
        "fsdp_scaling.conf", "config", overrides, lambda cfg: run_checks.check_values(cfg)
    )


@pytest.mark.parametrize("name", sorted(PLANS))
def test_printed_overrides_validate_in_the_trainer(name):
    answer = plan_json(PLANS[name])
    overrides = answer["train_overrides"]
    assert overrides and trainer_refusal(overrides) is None
    trainer_validates(overrides)
    if answer["dtrain_runs"]:
        assert answer["train_overrides_for"] == "choice" and answer["dtrain_refusal"] is None
    else:  # the best layout dtrain cannot run is said, with the best it can beside it
        assert answer["train_overrides_for"] == "dtrain_choice"
        theirs, _ = train_overrides_of(answer)
        with pytest.raises(UserError):
            trainer_validates(theirs)
        assert answer["dtrain_choice"]["slower_than_best_pct"] >= 0
    if "cp" in name and "pp" not in name:
        assert "train.cp=" in " ".join(overrides)
    if "pp" in name:
        # the printed overrides are dtrain's best, not the cp-with-pp choice it refuses
        assert not ("train.cp=2" in overrides and "train.pp=4" in overrides)
        assert (
            answer["dtrain_runs"] is False
            and "train.cp=2 with train.pp=4" in (answer["dtrain_refusal"])
        )


def train_overrides_of(answer: dict) -> tuple[list[str], list[str]]:
    """The overrides of the plan's own choice (not necessarily the printed ones)."""
    from dtrain.costmodel.plan_json import layout_of

    layout = layout_of(answer["choice"])
    m = answer["model"]
    shape = ModelShape(
        m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["vocab"], m["seq"], 3.5, True
    )
    return train_overrides(layout, shape, answer["global_batch"])


def test_an_hsdp_layout_validates_in_the_trainer():
    """HSDP is scored when pinned (--layout hsdp=2), never searched: its best completion."""
    shape = ModelShape.from_params(8e9)
    res = search(shape, Cluster.from_profile("h100-sxm", 64, 8), 1024, fixed={"dp_replicate": 2})
    assert res.best is not None and res.best.dp_replicate == 2
    overrides, _ = train_overrides(res.best, shape, 1024)
    assert "train.strategy=hsdp" in overrides and trainer_refusal(overrides) is None
    trainer_validates(overrides)


def test_dtrain_row_holds_the_trainers_rules():
    """--software dtrain's layouts are the trainer's: cp with pp (check_cp_layout) and pp·v
    chunks within the layers (check_pipeline) come from dtrain.parallel.feasibility."""
    sw = SOFTWARE["dtrain"]
    assert not sw.cp_with_pp and sw.trainer_rules
    from dtrain.costmodel.software import unsupported

    assert "model.n_layer=6 < pipeline stages" in unsupported(
        sw, {"pp": 4, "virtual_stages": 2}, n_layer=6
    )
    assert unsupported(SOFTWARE["any"], {"pp": 4, "virtual_stages": 2}, n_layer=6) is None


class Args:
    def __init__(self, seq, global_batch=None, tokens=1024 * 4096):
        self.seq, self.global_batch, self.global_batch_tokens = seq, global_batch, tokens


def test_the_default_global_batch_is_tokens():
    assert global_batch_of(Args(4096)) == 1024  # the guide's matrix at 4K is unchanged
    assert global_batch_of(Args(131072)) == 32
    assert global_batch_of(Args(8192)) == 512
    assert global_batch_of(Args(6000)) == 512  # a power of two within the tokens
    assert global_batch_of(Args(1 << 23)) == 1  # at least one sequence
    assert global_batch_of(Args(131072, global_batch=96)) == 96  # --global-batch wins


@pytest.mark.slow  # a 2-rank fsdp-scaling run in a subprocess
def test_a_small_plans_overrides_run_as_printed(tmp_path):
    tiny = "--layers 4 --hidden 64 --heads 4 --seq 64 --vocab 256 --gpus 2 --gpus-per-node 2"
    answer = plan_json([*tiny.split(), "--global-batch", "8"])
    assert answer["dtrain_runs"] is True
    overrides = answer["train_overrides"]
    run = py(
        "-m",
        "fsdp_scaling",
        *overrides,
        "train.steps=6",
        "train.timing_warmup=1",
        "profile.enabled=false",
        "train.dataset_tokens=20000",
        f"results_dir={tmp_path}",
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [done] = loader.complete_runs([tmp_path])
    assert done.summary["world_size"] == 2 and done.summary["final_loss"] > 0
